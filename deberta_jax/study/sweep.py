"""Ablation sweeps: variants x seeds x training lengths -> training runs -> length evaluation -> report.

    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py               # run everything here
    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py --mode print  # the commands, in order
    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py --mode report # evaluate + report only
    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py --mode score --runs=bert-L64-s0
    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py --mode train --seeds=1  # one seed's runs

A sweep config (`get_config(arg)`) names, per variant, a model-family config and `--config.*` overrides, plus seeds,
training lengths, overrides common to all runs, and the evaluation settings. Each run is an ordinary `train.py`
invocation in its own workdir (`<root>/<variant>-L<len>-s<seed>`), so a sweep is resumable for free: finished runs
(a checkpoint at `num_steps`) are skipped and interrupted ones resume from their last checkpoint. A SIGTERM to the
sweep (a preemption notice) is passed on to the run training, which saves a checkpoint and stops; the sweep then
names it and exits 143, as train.py does. Received while scoring, it stops the scoring the same way, every run scored
before it kept. Runs that differ from an earlier run of the sweep only in their long phase
(`deberta_jax.train.branching`) are not trained from step 0: the earlier run (the trunk) trains to the last step
they share (`--stop_at_step`), each of them starts from that checkpoint (`train.py --branch_from`), and the trunk
then trains on. `--mode print` writes the same commands, in that order, for a cluster scheduler instead of
running them (a `--branch_from` command needs the trunk's `--stop_at_step` command before it done; a trunk's line
comes twice); `--mode report` evaluates whatever has finished. A finished run that trained on another config than
the sweep now gives it (another data file, another model size) is refused, naming what changed, instead of being
skipped and reported as the new config's. Each run's evaluation is kept in its workdir (`length_eval.json`), so an
interrupted report resumes and a finished one is rebuilt in seconds; it is keyed by the evaluation settings and by
what the checkpoint and the eval files contain, so moving a workdir or spelling the data path differently keeps it,
and retraining a run or changing an eval file does not. `--mode score --runs=...` evaluates only the named runs and
writes no report, so runs can be scored side by side (a process per core or per machine) before one `--mode report`
gathers them; a run is scored under its workdir's lock, so two processes never score it at once. `--mode train`
trains and stops there, and with `--seeds` only those seeds' runs, in the same order: every trunk and its branches
share a seed, so one process per seed (per core, per machine) trains a sweep side by side without the hand-kept order
of `--mode print`'s lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
from absl import app, flags, logging
from ml_collections import config_dict, config_flags

from deberta_jax import storage
from deberta_jax.data import errors, library_logs, packing, synthetic
from deberta_jax.data.text import load_documents
from deberta_jax.model.config import ModelConfig
from deberta_jax.study import length_study, report
from deberta_jax.train import branching, checkpoint, config_checks, preemption, workdir_lock

config_flags.DEFINE_config_file("sweep", None, "Sweep config, e.g. configs/sweeps/ablation.py.", lock_config=False)
flags.DEFINE_enum("mode", "run", ["run", "train", "print", "report", "score"],
                  "run: train missing runs here, then evaluate and report; train: train missing runs only; print: "
                  "write one command per run; report: evaluate finished runs and write the report; score: evaluate "
                  "only the --runs named.")
errors.list_flag("runs", [], "With --mode score: the runs to evaluate, by name (the last part of their workdir, "
                  "e.g. deberta-L64-s0), comma-separated.")
errors.list_flag("seeds", [], "With --mode train or print: only these seeds' runs (all by default), comma-separated; "
                  "processes given different seeds train side by side.")
FLAGS = flags.FLAGS
PROGRAM = "python -m deberta_jax.study.sweep"


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
                runs.append(dict(name=name, workdir=workdir, command=command, config=variant.config,
                                 overrides=overrides, num_steps=int(overrides["train.num_steps"])))
    return runs


def of_seeds(runs: list[dict], seeds: list[str]) -> list[dict]:
    """The runs of `seeds` (every run when none is given), in the sweep's order. A branch's trunk has its seed
    (`branching.trunk_key` includes it), so `trainings` of these runs are the sweep's own, less the other seeds'."""
    if not seeds:
        return runs
    known = list(dict.fromkeys(run["overrides"]["seed"] for run in runs))
    unknown = [seed for seed in seeds if not seed.lstrip("-").isdigit() or int(seed) not in known]
    if unknown:
        raise ValueError(f"--seeds: no seed {', '.join(unknown)} in this sweep; its seeds: "
                         f"{', '.join(map(str, known))}")
    chosen = {int(seed) for seed in seeds}
    return [run for run in runs if run["overrides"]["seed"] in chosen]


@dataclasses.dataclass(frozen=True)
class Training:
    """One train.py invocation of the sweep's: `run` trained to `stop` (None: to its end), or started from `trunk`'s
    checkpoint at step `branch_step` (`branching`)."""

    run: dict
    stop: int | None = None
    trunk: dict | None = None
    branch_step: int | None = None

    @property
    def command(self) -> list[str]:
        if self.trunk is not None:
            return self.run["command"] + ["--branch_from", self.trunk["workdir"]]
        return self.run["command"] + ([f"--stop_at_step={self.stop}"] if self.stop is not None else [])


def branches(runs: list[dict]) -> dict[str, tuple[dict, int]]:
    """`{name: (trunk, step)}` for each run that can start from an earlier run's checkpoint at `step` instead of from
    step 0: the first run of the sweep that trains what it trains before its long phase (`branching.trunk_key`)."""
    trunks: dict[str, tuple[dict, config_dict.ConfigDict]] = {}
    found = {}
    for run in runs:
        config = config_checks.load_config_file(run["config"])
        config.update_from_flattened_dict(run["overrides"])
        trunk, trunk_config = trunks.setdefault(branching.trunk_key(config), (run, config))
        step = min(branching.shared_steps(trunk_config), branching.shared_steps(config))
        if trunk is not run and step:
            found[run["name"]] = trunk, step
    return found


def trainings(runs: list[dict]) -> list[Training]:
    """The train.py invocations that train `runs`, in order: each trunk to every step a branch starts from, those
    branches, then the rest of the trunk; every other run whole."""
    found = branches(runs)
    order = []
    for run in runs:
        if run["name"] in found:
            continue
        for stop in sorted({step for trunk, step in found.values() if trunk is run}):
            order.append(Training(run, stop=stop))
            order += [Training(other, trunk=run, branch_step=stop) for other in runs
                      if found.get(other["name"], (None, None)) == (run, stop)]
        order.append(Training(run))
    return order


def checkpoint_steps(run: dict) -> list[int]:
    """The steps of the checkpoints in the run's workdir (local or in a bucket), oldest first."""
    if not (storage.path(run["workdir"]) / checkpoint.CHECKPOINT_DIR).is_dir():
        return []
    manager = checkpoint.checkpoint_manager(run["workdir"], read_only=True)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def latest_step(run: dict) -> int | None:
    """The step of the newest checkpoint in the run's workdir, None before its first."""
    steps = checkpoint_steps(run)
    return steps[-1] if steps else None


def finished(run: dict) -> bool:
    """A run is done when its workdir holds a checkpoint at the final step."""
    return latest_step(run) == run["num_steps"]


# Beside a run the sweep trained: the fingerprint (`length_study.config_fingerprint`) of what it trained with.
TRAINED_FILE = "sweep_trained.json"
# Where train.py's config.json records the vocabulary it trained the tokenizer for (train.VOCAB_REQUEST).
VOCAB_REQUEST = "tokenizer_trained_for_vocab_size"


def planned_config(run: dict, saved: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """The config.json `train.py` would write for `run`'s command, beside the one a run wrote (`saved`): the model
    complete at the training length, its vocabulary the size of the tokenizer the run trained (which train.py
    reads from the tokenizer, not the config)."""
    config = config_checks.load_config_file(run["config"])
    config.update_from_flattened_dict(run["overrides"])
    model = dict(config.model.to_dict(), trained_length=config.data.seq_len, vocab_size=saved.model.vocab_size)
    planned = config_checks.resolved(config, ModelConfig.from_dict(model)).to_dict()
    trains_tokenizer = not (config.data.tokenizer or synthetic.is_synthetic_spec(config.data.train_files))
    planned["data"][VOCAB_REQUEST] = config.model.vocab_size if trains_tokenizer else None
    # Fields added to train.py's config since the run was written (its model's are completed by
    # length_study.config_differences): it trained as they do by default.
    written = saved.to_dict()
    for section, fields in planned.items():
        if section != "model" and isinstance(fields, dict):
            for field in set(fields) - set(written.get(section, {})):
                del fields[field]
    return config_dict.ConfigDict({key: value for key, value in planned.items() if key in written})


def changed_since_trained(run: dict) -> str | None:
    """None if a finished run trained what the sweep now plans for it, else one line naming what changed and the
    choices. Runs the sweep trained are compared by their stored fingerprint, which also sees the training text
    rewritten in place; others (trained from `--mode print`'s commands, or before fingerprints were stored) by
    their config.json."""
    saved = checkpoint.read_config(run["workdir"])
    planned = planned_config(run, saved)
    changes = length_study.config_differences(saved, planned)
    stored = storage.path(run["workdir"]) / TRAINED_FILE
    if not changes and stored.is_file():
        try:
            fingerprint = json.loads(storage.read_text(stored))["config_fingerprint"]
        except (ValueError, KeyError, TypeError):  # cut short, or edited by something else
            raise ValueError(f"{stored} is damaged: it is not the record the sweep writes when {run['name']} finishes "
                             "training (what its training text held, to compare with the sweep's now). Remove it to "
                             f"compare {run['name']}'s config.json alone, as for a run trained by a printed command, "
                             f"or remove {run['workdir']} to retrain this run") from None
        # A record written before fingerprints were taken by content matches the text by path, size and time.
        if fingerprint not in (length_study.config_fingerprint(run["workdir"], planned),
                               length_study.config_fingerprint(run["workdir"], planned, by_content=False)):
            changes = [f"the files config.data.train_files names ({planned.data.train_files}) were rewritten since "
                       "it trained"]
    if not changes:
        return None
    return (f"{run['name']} ({run['workdir']}) finished training on another config than this sweep gives it: "
            f"{'; '.join(changes)} (trained vs now). Give another --sweep.workdir_root to train the sweep anew there, "
            f"or remove {run['workdir']} to retrain this run")


def check_finished_runs(runs: list[dict]) -> None:
    """Refuses a sweep whose finished runs trained on another config than it now gives them: skipped, they would be
    reported as the new config's."""
    changed = [line for line in map(changed_since_trained, filter(finished, runs)) if line]
    if changed:
        others = f" (and {len(changed) - 1} other runs)" if len(changed) > 1 else ""
        raise ValueError(changed[0] + others)


class RunStopped(Exception):
    """A SIGTERM to the sweep (a preemption notice) stopped the run in training, passed on to its train.py."""


class ScoringStopped(Exception):
    """A SIGTERM to the sweep (a preemption notice) while it scored: the runs scored before it keep their cached
    evaluations."""

    def __init__(self):
        super().__init__(f"preempted (SIGTERM) while scoring: every run scored before it keeps its evaluation in its "
                         f"workdir ({EVAL_CACHE}); rerun the same command to score the rest")


# Set by the scoring block's SIGTERM handler. A signal is process-wide, so is the notice.
_sigterm_while_scoring = threading.Event()


@contextlib.contextmanager
def stopping_scoring_on_sigterm():
    """Within the block a SIGTERM stops the scoring before its next unit of work (a model at one length: `cached_study`
    hands `stop_if_sigterm_noticed` to the study), or at the block's end, by raising `ScoringStopped`; the run being
    scored gives back its workdir's lock on the way out instead of the process ending inside it. The handler only
    takes note: an exception raised from it would land wherever the main thread is, and library code there may catch
    it (jax's compilation cache turns any error while it reads an entry into a warning, and compiles anew)."""
    _sigterm_while_scoring.clear()
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: _sigterm_while_scoring.set())
    try:
        yield
        stop_if_sigterm_noticed()
    finally:
        signal.signal(signal.SIGTERM, previous)


def stop_if_sigterm_noticed() -> None:
    """Raises `ScoringStopped` once a SIGTERM has reached the scoring block."""
    if _sigterm_while_scoring.is_set():
        raise ScoringStopped()


def train_run(command: list[str]) -> tuple[int, bool]:
    """Runs a train.py `command`; returns its exit status and whether the sweep received SIGTERM meanwhile. SIGTERM
    and SIGINT (Ctrl-C, or a kill -INT of the sweep alone) are passed on, so the run stops as train.py does on its
    own (`preemption` for SIGTERM: a checkpoint first) instead of training on after the sweep is gone; once it has,
    a SIGINT ends the sweep (KeyboardInterrupt)."""
    received: list[int] = []
    process = None

    def forward(signum, frame):
        received.append(signum)
        if process is not None:
            process.send_signal(signum)

    previous = {signum: signal.signal(signum, forward) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        process = subprocess.Popen(command)
        for signum in received:  # it came while the process was being started
            process.send_signal(signum)
        status = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if signal.SIGINT in received:
        raise KeyboardInterrupt
    return status, signal.SIGTERM in received


def next_command(training: Training) -> tuple[list[str] | None, str]:
    """The command `training` needs now (None: nothing to do) and what to print about it. A branch whose trunk no
    longer holds a checkpoint it can start from (a trunk trained before, whose retention dropped it) trains whole."""
    run = training.run
    steps = checkpoint_steps(run)  # one listing of the workdir for every question below
    if steps and steps[-1] == run["num_steps"]:
        return None, "finished, skipped"
    if training.stop is not None and steps and steps[-1] >= training.stop:
        return None, f"past step {training.stop}, where runs branch off it: skipped"
    if (training.trunk is not None and not steps
            and not any(step <= training.branch_step for step in checkpoint_steps(training.trunk))):
        return run["command"], (f"{training.trunk['name']} holds no checkpoint at or before step "
                                f"{training.branch_step} to branch off, so it trains whole: "
                                + shlex.join(run["command"]))
    return training.command, shlex.join(training.command)


def train_all(runs: list[dict]) -> None:
    """Trains every run not finished, one after the other, branching runs off their trunks (`trainings`). Raises
    RunStopped when a SIGTERM stopped one."""
    check_finished_runs(runs)
    order = trainings(runs)
    for i, training in enumerate(order, 1):
        run = training.run
        command, said = next_command(training)
        print(f"[{i}/{len(order)}] {run['name']}: {said}", flush=True)
        if command is None:
            continue
        status, stopped = train_run(command)
        if status and not stopped:  # train.py has said why on its own stderr, just above
            raise ChildProcessError(
                f"run {run['name']} failed (exit status {status}; its message is above): "
                f"{shlex.join(command)}. Fix the cause and run the sweep again: finished runs are skipped, "
                "this one resumes")
        step = latest_step(run)
        if step == run["num_steps"]:  # not after a stop (--stop_at_step, SIGTERM), which leaves it to resume
            storage.write_text(storage.path(run["workdir"]) / TRAINED_FILE,
                               json.dumps(dict(config_fingerprint=length_study.config_fingerprint(run["workdir"]))))
        if stopped:
            where = ("before its first checkpoint" if step is None else
                     f"at its checkpoint of step {step} in {storage.path(run['workdir']) / checkpoint.CHECKPOINT_DIR}")
            raise RunStopped(f"preempted (SIGTERM): passed on to run {run['name']}, which stopped {where}; rerun the "
                             "same sweep command to resume it (finished runs are skipped)")


def code_version(report_dir: str) -> str:
    """The commit, marked when tracked files other than the report's own (where it lies in the checkout) differ."""
    def git(*args) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout.strip()

    try:
        rev, top = git("rev-parse", "--short", "HEAD"), git("rev-parse", "--show-toplevel")
        # git refuses a pathspec outside the checkout (a report in /tmp or a bucket): nothing of it to leave out.
        inside = not storage.is_remote(report_dir) and Path(os.path.realpath(report_dir)).is_relative_to(top)
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                    *([f":(exclude){report_dir}"] if inside else []))
        return rev + ("+uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


EVAL_CACHE = "length_eval.json"


def study_settings(sweep: config_dict.ConfigDict) -> length_study.StudySettings:
    ev = sweep.eval
    return length_study.StudySettings(
        multiples=tuple(ev.multiples), extra=tuple(ev.extra), policies=tuple(ev.policies),
        protocols=tuple(ev.protocols), max_eval_tokens=ev.max_eval_tokens, num_spans=ev.num_spans,
        bootstrap=ev.bootstrap, methods=tuple(ev.methods))


def cached_study(cache_path: str, fingerprint: dict, load_model, datasets, settings, corpora) -> tuple[list, list]:
    """`run_study` for one model, kept in `cache_path` so an interrupted or repeated report does not
    evaluate a run again; the cache is used only if `fingerprint` (what the result depends on: settings,
    the eval files' contents, the checkpoint's) is unchanged, and a damaged one is redone with a warning."""
    fingerprint = json.loads(json.dumps(fingerprint))  # tuples -> lists, as they come back from the file
    if storage.path(cache_path).is_file():
        try:
            cached = json.loads(storage.read_text(cache_path))
        except json.JSONDecodeError as err:  # written whole, so cut short or edited by something else
            logging.warning("%s is not valid JSON (%s): a cached length evaluation, damaged; evaluating the run "
                            "again, which replaces it", cache_path, err)
        else:
            if cached.get("fingerprint") == fingerprint:
                return cached["records"], cached["skipped"]
    records, skipped = length_study.run_study([load_model()], datasets, settings, corpora,
                                              before_each_unit=stop_if_sigterm_noticed)
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
    check_finished_runs([by_name[name] for name in names])
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
    check_finished_runs(done)
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
        *report.paired_markdown(pd.concat([report.records_frame(records), means], ignore_index=True)),
        *[f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in plots], "",
        "Full tables (centred-target protocol, every policy, intervals): [summary.md](summary.md); "
        "raw records: [results.json.gz](results.json.gz) (`deberta_jax.study.report.load_results`).", "",
        "## What each run trained", "", trained_table(done), "",
        "## Sweep configuration", "", "```json", json.dumps(sweep.to_dict(), indent=1, default=str), "```", "",
        # `python`, not this machine's interpreter path, as in the sweep command above.
        "## Commands", "", *[f"    {shlex.join(['python', *r['command'][1:]])}" for r in runs], "",
    ]
    path = os.path.join(out, "REPORT.md")
    storage.write_text(path, "\n".join(lines))
    return path


def trained_table(runs: list[dict]) -> str:
    """A table of what each run trained on, from its own config.json: its training text and length, and every model,
    data and training field that differs between the runs (a recipe such as a long final phase, a changed step
    count), the seed aside; the sweep's configuration, below, is what it gives runs now. A field missing from a
    run's config (written before the field existed) shows as "-"."""
    configs = [checkpoint.read_config(run["workdir"]) for run in runs]
    # Model fields added since a workdir was written hold their defaults, which is what it trained with.
    fields = [{**flatten(ModelConfig.from_dict(config.model.to_dict()).to_dict(), "model."),
               **flatten(config.data.to_dict(), "data."), **flatten(config.train.to_dict(), "train.")}
              for config in configs]
    shown = ("data.train_files", "data.seq_len")
    differing = sorted(key for key in set().union(*fields)
                       if key not in shown and len({repr(f.get(key)) for f in fields}) > 1)
    rows = [[run["name"], *(f.get(key, "-") for key in (*shown, *differing))] for run, f in zip(runs, fields)]
    return report.markdown_table(pd.DataFrame(rows, columns=["run", *shown, *differing]))


def sweep_command(sweep: config_dict.ConfigDict) -> str:
    """The command that runs this sweep again: its config file, and a `--sweep.*` flag for each value the sweep holds
    other than the file's (its roots, its data_dir, a changed step count; without them a rerun would train, read or
    report elsewhere, or be another sweep). Values no flag can set (lists) are not given."""
    written = config_checks.load_config_file(sweep.config_path)
    defaults = flatten(written.to_dict())
    command = ["python", "-m", "deberta_jax.study.sweep", "--sweep", sweep.config_path]
    # Top-level fields first: the fields that refer to one (data_dir's paths) then hold what the flag gives them.
    for key, value in sorted(flatten(sweep.to_dict()).items(), key=lambda item: (item[0].count("."), item[0])):
        if value != defaults.get(key, value) and isinstance(value, (str, int, float, bool, tuple)):
            command.append(f"--sweep.{key}={_flag_value(value)}")
            written.update_from_flattened_dict({key: value})
            defaults = flatten(written.to_dict())
    return shlex.join(command + ["--mode", "run"])


def main(argv):
    if len(argv) > 1:  # a value without its flag would otherwise be dropped and the sweep run without it
        raise ValueError(f"unexpected arguments {argv[1:]}: give every option as a flag, e.g. --mode=print")
    library_logs.quiet()
    sweep = FLAGS.sweep
    sweep.config_path = config_flags.get_config_filename(FLAGS["sweep"])
    for field in ("workdir_root", "report_dir"):  # before any run is planned under them
        errors.check_location(f"--sweep.{field}", sweep[field])
    runs = planned_runs(sweep)
    if FLAGS.runs and FLAGS.mode != "score":
        raise ValueError(f"--runs applies to --mode score only (given with --mode {FLAGS.mode})")
    if FLAGS.seeds and FLAGS.mode not in ("train", "print"):
        raise ValueError(f"--seeds applies to --mode train and --mode print only (given with --mode {FLAGS.mode}); "
                         "--mode score takes --runs")
    if FLAGS.mode == "print":
        for training in trainings(of_seeds(runs, FLAGS.seeds)):
            print(shlex.join(training.command))  # with this interpreter: runs as printed from the repository root
        return
    try:
        if FLAGS.mode == "train":  # each train.py locks its own workdir, not the root: seeds train side by side
            train_all(of_seeds(runs, FLAGS.seeds))
            return
        if FLAGS.mode == "score":  # locks each run's workdir, not the root: scoring processes run side by side
            with stopping_scoring_on_sigterm():
                score_named(sweep, runs, FLAGS.runs)
            return
        # One sweep per workdir root (each run's train.py also locks its own workdir).
        with workdir_lock.hold(sweep.workdir_root, what=f"deberta_jax.study.sweep --mode {FLAGS.mode}"):
            if FLAGS.mode == "run":
                train_all(runs)
            with stopping_scoring_on_sigterm():
                print("report:", evaluate_and_report(sweep, runs, FLAGS.mode))
    except (RunStopped, ScoringStopped) as notice:
        preemption.stop(PROGRAM, notice)


if __name__ == "__main__":
    flags.mark_flags_as_required(["sweep"])
    app.run(errors.reporting_user_errors(main, PROGRAM, also=(workdir_lock.WorkdirBusyError,)),
            flags_parser=lambda argv: config_checks.parse_config_flags(FLAGS, argv, "sweep"))
