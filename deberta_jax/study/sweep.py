"""Ablation sweeps: variants x seeds x training lengths -> training runs -> length evaluation -> report.

    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py               # run everything here
    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py --mode print  # one command per run
    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py --mode report # evaluate + report only
    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py --mode score --runs=bert-L64-s0

A sweep config (`get_config(arg)`) names, per variant, a model-family config and `--config.*`
overrides, plus seeds, training lengths, overrides common to all runs, and the evaluation settings.
Each run is an ordinary `train.py` invocation in its own workdir (`<root>/<variant>-L<len>-s<seed>`),
so a sweep is resumable for free: finished runs (a checkpoint at `num_steps`) are skipped and
interrupted ones resume from their last checkpoint. `--mode print` writes the same commands for a
cluster scheduler instead of running them; `--mode report` evaluates whatever has finished. Each
run's evaluation is kept in its workdir (`length_eval.json`), so an interrupted report resumes and a
finished one is rebuilt in seconds; it is keyed by the evaluation settings and by what the checkpoint and
the eval files contain, so moving a workdir or spelling the data path differently keeps it, and retraining
a run or changing an eval file does not. `--mode score --runs=...` evaluates only the named runs and writes
no report, so runs can be scored side by side (a process per core or per machine) before one `--mode report`
gathers them; a run is scored under its workdir's lock, so two processes never score it at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shlex
import subprocess
import sys

from absl import app, flags
from ml_collections import config_dict, config_flags

from deberta_jax import storage
from deberta_jax.data import errors, packing, synthetic
from deberta_jax.data.text import load_documents
from deberta_jax.study import length_study, report
from deberta_jax.train import checkpoint, config_checks, workdir_lock

config_flags.DEFINE_config_file("sweep", None, "Sweep config, e.g. configs/sweeps/ablation.py.", lock_config=False)
flags.DEFINE_enum("mode", "run", ["run", "print", "report", "score"],
                  "run: train missing runs here, then evaluate and report; print: write one command per run; "
                  "report: evaluate finished runs and write the report; score: evaluate only the --runs named.")
flags.DEFINE_list("runs", [], "With --mode score: the runs to evaluate, by name (the last part of their workdir, "
                  "e.g. deberta-L64-s0), comma-separated.")
FLAGS = flags.FLAGS


def _flag_value(value) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def flatten(tree: dict, prefix: str = "") -> dict:
    """{"model": {"use_emd": True}} -> {"model.use_emd": True}: the `--config.*` override names."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def planned_runs(sweep: config_dict.ConfigDict) -> list[dict]:
    """Every (variant, training length, seed) with its workdir and `train.py` command."""
    runs = []
    # Seed-major order: a sweep stopped early has every variant at the same number of seeds.
    for seed in sweep.seeds:
        for seq_len in sweep.seq_lens:
            for variant in sweep.variants:
                name = f"{variant.name}-L{seq_len}-s{seed}"
                workdir = os.path.join(sweep.workdir_root, name)
                overrides = flatten(sweep.common_overrides.to_dict())
                overrides.update(flatten(variant.overrides.to_dict()))
                overrides.update({"seed": seed, "data.seq_len": seq_len})
                command = [sys.executable, "train.py", "--config", variant.config, "--workdir", workdir]
                command += [f"--config.{key}={_flag_value(value)}" for key, value in sorted(overrides.items())]
                runs.append(dict(name=name, workdir=workdir, command=command,
                                 num_steps=int(overrides["train.num_steps"])))
    return runs


def finished(run: dict) -> bool:
    """A run is done when its workdir (local or in a bucket) holds a checkpoint at the final step."""
    if not (storage.path(run["workdir"]) / checkpoint.CHECKPOINT_DIR).is_dir():
        return False
    manager = checkpoint.checkpoint_manager(run["workdir"], read_only=True)
    try:
        return manager.latest_step() == run["num_steps"]
    finally:
        manager.close()


def train_all(runs: list[dict]) -> None:
    for i, run in enumerate(runs, 1):
        if finished(run):
            print(f"[{i}/{len(runs)}] {run['name']}: finished, skipped", flush=True)
            continue
        print(f"[{i}/{len(runs)}] {run['name']}: {shlex.join(run['command'])}", flush=True)
        try:
            subprocess.run(run["command"], check=True)
        except subprocess.CalledProcessError as err:  # train.py has said why on its own stderr, just above
            raise ChildProcessError(
                f"run {run['name']} failed (exit status {err.returncode}; its message is above): "
                f"{shlex.join(run['command'])}. Fix the cause and run the sweep again: finished runs are skipped, "
                "this one resumes") from None


def code_version(report_dir: str) -> str:
    """The commit, marked when tracked files other than the report's own differ from it."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                f":(exclude){report_dir}"], capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


EVAL_CACHE = "length_eval.json"


def study_settings(sweep: config_dict.ConfigDict) -> length_study.StudySettings:
    ev = sweep.eval
    return length_study.StudySettings(
        multiples=tuple(ev.multiples), extra=tuple(ev.extra), policies=tuple(ev.policies),
        protocols=tuple(ev.protocols), max_eval_tokens=ev.max_eval_tokens, num_targets=ev.num_targets,
        bootstrap=ev.bootstrap, methods=tuple(ev.methods))


def cached_study(cache_path: str, fingerprint: dict, load_model, datasets, settings, corpora) -> tuple[list, list]:
    """`run_study` for one model, kept in `cache_path` so an interrupted or repeated report does not
    evaluate a run again; the cache is used only if `fingerprint` (what the result depends on: settings,
    the eval files' contents, the checkpoint's) is unchanged."""
    fingerprint = json.loads(json.dumps(fingerprint))  # tuples -> lists, as they come back from the file
    if storage.path(cache_path).is_file():
        cached = json.loads(storage.read_text(cache_path))
        if cached.get("fingerprint") == fingerprint:
            return cached["records"], cached["skipped"]
    records, skipped = length_study.run_study([load_model()], datasets, settings, corpora)
    report.check_finite(records)
    storage.write_text(cache_path, json.dumps(dict(fingerprint=fingerprint, records=records, skipped=skipped)))
    return records, skipped


def evaluation_inputs(sweep: config_dict.ConfigDict) -> tuple[length_study.StudySettings, dict, dict]:
    """The study settings, the eval texts, and the part of every cached evaluation's key they make."""
    settings = study_settings(sweep)
    datasets = {name: load_documents(spec) for name, spec in sweep.eval.data_files.items()}
    # Keyed by the eval files' bytes, not their paths or modification times: a fresh copy of the same texts keeps
    # hours of scoring.
    base = dict(settings=dataclasses.asdict(settings),
                data_files={name: packing.source_fingerprint(spec, by_content=True)
                            for name, spec in sweep.eval.data_files.items()})
    return settings, datasets, base


def score_run(run: dict, settings, datasets: dict, base: dict, corpora: dict) -> tuple[list, list]:
    """One finished run's length evaluation, cached in its workdir, under the workdir's lock: a second process
    scoring the same run (or training into it) is refused, naming the holder, instead of repeating the work.

    The records name the run as it is now (`length_study.run_identity`): the cache holds for the same checkpoint,
    config and tokenizer wherever the workdir lives, and records cached before they carried their identity get it."""
    identity = checkpoint.content_fingerprint(run["workdir"], run["num_steps"])
    with workdir_lock.hold(run["workdir"], what="deberta_jax.study.sweep scoring"):
        records, skipped = cached_study(
            os.path.join(run["workdir"], EVAL_CACHE), dict(base, checkpoint=identity),
            lambda: length_study.load_workdir_model(run["workdir"]), datasets, settings, corpora)
    now = length_study.run_identity(run["workdir"], run["num_steps"])
    return [dict(r, **now) for r in records], [dict(s, **now) for s in skipped]


def score_named(sweep: config_dict.ConfigDict, runs: list[dict], names: list[str]) -> None:
    """`--mode score`: evaluates the named runs (each cached in its workdir) without writing a report."""
    by_name = {run["name"]: run for run in runs}
    if not names:
        raise ValueError(f"--mode score needs the runs to evaluate: --runs={runs[0]['name']}[,...]; this sweep's "
                         f"runs: {', '.join(by_name)}")
    unknown = [name for name in names if name not in by_name]
    if unknown:
        raise ValueError(f"--runs: no run named {', '.join(unknown)} in this sweep; its runs: {', '.join(by_name)}")
    unfinished = [name for name in names if not finished(by_name[name])]
    if unfinished:
        raise FileNotFoundError(f"--runs: {', '.join(unfinished)} not finished under {sweep.workdir_root} (no "
                                "checkpoint at its final step); train it first (--mode run, or --mode print's "
                                "command)")
    settings, datasets, base = evaluation_inputs(sweep)
    corpora = {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] evaluating {name}", flush=True)
        score_run(by_name[name], settings, datasets, base, corpora)
        print(f"[{i}/{len(names)}] {name}: {os.path.join(by_name[name]['workdir'], EVAL_CACHE)}", flush=True)


def evaluate_and_report(sweep: config_dict.ConfigDict, runs: list[dict], mode: str) -> str:
    """Length-evaluate every finished run (each cached in its workdir) and a unigram floor, then write
    raw results, summary, plots and REPORT.md."""
    done = [r for r in runs if finished(r)]
    missing = [r["name"] for r in runs if r not in done]
    if not done:
        raise FileNotFoundError(f"no finished run under {sweep.workdir_root}; train first (--mode run)")
    settings, datasets, base = evaluation_inputs(sweep)
    # Runs are evaluated one at a time, so run_study cannot see whether they share a tokenizer.
    note = length_study.unpaired_note(
        (run["name"], storage.read_text(storage.path(run["workdir"]) / checkpoint.TOKENIZER_FILE)) for run in done)
    corpora, records, skipped = {}, [], []
    for i, run in enumerate(done, 1):
        print(f"[{i}/{len(done)}] evaluating {run['name']}", flush=True)
        recs, skips = score_run(run, settings, datasets, base, corpora)
        records += recs
        skipped += skips
    # The floor every variant must beat (unigram counts from the shared training files and tokenizer) and, for
    # synthetic data, the oracle no variant can beat, on the first run's windows.
    first = done[0]["workdir"]
    first_identity = checkpoint.content_fingerprint(first, done[0]["num_steps"])
    recs, _ = cached_study(
        os.path.join(sweep.workdir_root, "unigram_" + EVAL_CACHE), dict(base, counts_from=first_identity),
        lambda: length_study.unigram_reference(length_study.load_workdir_model(first)), datasets, settings, corpora)
    records += recs
    for i, (name, spec) in enumerate(sweep.eval.data_files.items()):
        if synthetic.is_synthetic_spec(spec) and synthetic.has_exact_oracle(spec):
            recs, _ = cached_study(
                os.path.join(sweep.workdir_root, f"oracle{i}_" + EVAL_CACHE),
                dict(base, oracle=spec, windows_from=first_identity),
                lambda name=name, spec=spec: length_study.oracle_references(
                    length_study.load_workdir_model(first), {name: spec})[0], datasets, settings, corpora)
            records += recs
    out = sweep.report_dir
    means, _, plots = report.write_report(records, skipped, out, notes=[note] if note else [])
    lines = [
        f"# Ablation report: {sweep.title}", "",
        f"Generated {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} from code version "
        f"`{code_version(out)}` by `--mode {mode}`; to train what is missing and report: `{sweep_command(sweep)}`.",
        "",
        sweep.description, "",
        f"Runs: {len(done)} finished" + (f"; missing: {', '.join(missing)}" if missing else "") + ".", "",
        report.ablation_table(means, sweep.table_policy, sweep.eval.multiples), "",
        *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots], "",
        "Full tables (fixed-target protocol, every policy, intervals): [summary.md](summary.md); "
        "raw records: [results.json.gz](results.json.gz) (`deberta_jax.study.report.load_results`).", "",
        "## Sweep configuration", "", "```json", json.dumps(sweep.to_dict(), indent=1, default=str), "```", "",
        # `python`, not this machine's interpreter path, as in the sweep command above.
        "## Commands", "", *[f"    {shlex.join(['python', *r['command'][1:]])}" for r in runs], "",
    ]
    path = os.path.join(out, "REPORT.md")
    storage.write_text(path, "\n".join(lines))
    return path


def sweep_command(sweep: config_dict.ConfigDict) -> str:
    """The command that runs this sweep, with its data location when the config has one."""
    command = ["python", "-m", "deberta_jax.study.sweep", "--sweep", sweep.config_path]
    if "data_dir" in sweep:
        command.append(f"--sweep.data_dir={sweep.data_dir}")
    return shlex.join(command + ["--mode", "run"])


def main(argv):
    if len(argv) > 1:  # a value without its flag would otherwise be dropped and the sweep run without it
        raise ValueError(f"unexpected arguments {argv[1:]}: give every option as a flag, e.g. --mode=print")
    sweep = FLAGS.sweep
    sweep.config_path = config_flags.get_config_filename(FLAGS["sweep"])
    runs = planned_runs(sweep)
    if FLAGS.runs and FLAGS.mode != "score":
        raise ValueError(f"--runs applies to --mode score only (given with --mode {FLAGS.mode})")
    if FLAGS.mode == "print":
        for run in runs:
            print(shlex.join(run["command"]))  # with this interpreter: runs as printed from the repository root
        return
    if FLAGS.mode == "score":  # locks each run's workdir, not the root: scoring processes run side by side
        score_named(sweep, runs, FLAGS.runs)
        return
    # One sweep per workdir root (each run's train.py also locks its own workdir).
    with workdir_lock.hold(sweep.workdir_root, what=f"deberta_jax.study.sweep --mode {FLAGS.mode}"):
        if FLAGS.mode == "run":
            train_all(runs)
        print("report:", evaluate_and_report(sweep, runs, FLAGS.mode))


if __name__ == "__main__":
    flags.mark_flags_as_required(["sweep"])
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.study.sweep",
                                         also=(workdir_lock.WorkdirBusyError,)),
            flags_parser=lambda argv: config_checks.parse_config_flags(FLAGS, argv, "sweep"))
