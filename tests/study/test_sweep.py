"""Ablation sweep: every variant of the ablation config trains and extrapolates; the runner skips finished runs."""

import copy
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from ml_collections import config_dict

import train
from configs.sweeps import ablation, natural, synthetic, variants
from deberta_jax.data import errors
from deberta_jax.data.text import load_documents
from deberta_jax.study import length_study, sweep
from deberta_jax.train import checkpoint, config_checks, metrics_io, workdir_lock
from tests.helpers import REPO, variant_config, write_brown_slices

pytestmark = pytest.mark.slow  # every variant trains and is length-evaluated

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_brown_slices(tmp_path_factory.mktemp("corpus"), 60_000, 30_000, vocab_size=300)


def micro_variant_config(variant, corpus):
    """The variant's family config at micro size with its model overrides, as the runner would build it."""
    config = variant_config(variant, "micro")
    config.update_from_flattened_dict({
        "data.train_files": str(corpus / "train.txt"), "data.eval_files": str(corpus / "valid.txt"),
        "data.tokenizer": str(corpus / "tokenizer.json"), "data.cache_dir": str(corpus / "cache"),
        "data.seq_len": 16, "train.num_steps": 3, "train.warmup_steps": 1, "train.log_every": 1,
        "train.eval_every": 3, "train.checkpoint_every": 3, "train.eval_batches": 2})
    return config


@pytest.mark.parametrize("index", range(len(ablation.get_config("full").variants)))
def test_every_variant_trains_and_extrapolates(index, corpus, tmp_path):
    variant = ablation.get_config("full").variants[index]
    workdir = tmp_path / f"{variant.name}-L16-s0"
    config = micro_variant_config(variant, corpus)
    config.data.eval_files = ""  # the study below evaluates; one compile fewer per variant
    config.model.num_layers = 1  # what is asserted does not depend on depth; a smaller program to compile
    metrics = train.train_and_evaluate(config, workdir)
    assert np.isfinite(metrics["loss"]) and metrics["loss"] > 0
    model = length_study.load_workdir_model(str(workdir))
    assert model.label == f"{variant.name}-L16"
    settings = length_study.StudySettings(multiples=(1, 4), extra=(), policies=("clip",), protocols=("chunked",),
                                          bootstrap=20)
    records, skipped = length_study.run_study([model], {"valid": load_documents(str(corpus / "valid.txt"))}, settings)
    lengths = {r["eval_len"] for r in records if r["metric"] == "loss" and r["bucket"] == "all"}
    assert lengths == {16, 64} and not skipped


def test_runner_plans_commands_and_skips_finished_runs(corpus, tmp_path, monkeypatch):
    plan = ablation.get_config("smoke")
    plan.workdir_root = str(tmp_path / "runs")
    runs = sweep.planned_runs(plan)
    assert [r["name"] for r in runs] == ["bert-L16-s0", "deberta-L16-s0"]
    deberta_cmd = runs[1]["command"]
    assert "--config.model.use_emd=True" in deberta_cmd and "--config.data.seq_len=16" in deberta_cmd
    # Finish the first run for real (its planned num_steps), leave the second untouched.
    config = micro_variant_config(plan.variants[0], corpus)
    config.train.num_steps = runs[0]["num_steps"]
    train.train_and_evaluate(config, runs[0]["workdir"])
    assert sweep.finished(runs[0]) and not sweep.finished(runs[1])
    # Trained at micro size, not the smoke config's: what is tested here is the skipping.
    monkeypatch.setattr(sweep, "changed_since_trained", lambda run: None)
    launched = []
    monkeypatch.setattr(sweep, "train_run", lambda command: launched.append(command) or (0, False))
    sweep.train_all(runs)
    assert launched == [runs[1]["command"]]


@pytest.mark.long
def test_runs_that_differ_only_in_their_long_phase_branch_off_the_first(corpus, tmp_path):
    """A sweep of a plain run and two long phases (one of them on rows cut to L, which cuts nothing before the phase)
    trains the plain run to the last step they share, starts both long phases there (`--branch_from`), then trains
    the plain run on; printed in that order. A rerun skips all three."""
    plan = ablation.get_config("smoke")
    plan.workdir_root = str(tmp_path / "runs")
    common = plan.common_overrides
    common.data.update(train_files=str(corpus / "train.txt"), eval_files="", tokenizer=str(corpus / "tokenizer.json"),
                       cache_dir=str(corpus / "cache"))
    common.train.update(num_steps=4, log_every=1, checkpoint_every=4)
    plan.variants = [variants.variant("deberta", variants.DEBERTA),
                     variants.variant("deberta-long", variants.DEBERTA, train=dict(long_steps=2),
                                      data=dict(long_seq_len=32)),
                     variants.variant("deberta-long-mixed", variants.DEBERTA, train=dict(long_steps=2, long_share=0.5),
                                      data=dict(long_seq_len=32, min_row_length=16))]
    runs = sweep.planned_runs(plan)
    trunk, *others = runs
    order = [(t.run["name"], t.command[len(t.run["command"]):]) for t in sweep.trainings(runs)]
    assert order == [(trunk["name"], ["--stop_at_step=2"]),
                     *((run["name"], ["--branch_from", trunk["workdir"]]) for run in others), (trunk["name"], [])]
    smoke = sweep.trainings(sweep.planned_runs(ablation.get_config("smoke")))
    assert [t.command for t in smoke] == [t.run["command"] for t in smoke]  # its bert and deberta share nothing
    sweep.train_all(runs)
    for run in others:
        assert json.loads((Path(run["workdir"]) / "branch.json").read_text()) == dict(trunk=trunk["workdir"], step=2)
        logged = [record["step"] for record in metrics_io.read_metrics(run["workdir"]) if "loss" in record]
        assert sweep.finished(run) and logged == [1, 2, 3, 4]  # the trunk's first two, then its own
    assert sweep.finished(trunk) and not (Path(trunk["workdir"]) / "branch.json").exists()
    assert all(sweep.next_command(t)[0] is None for t in sweep.trainings(runs))


def test_one_seeds_trainings_are_the_sweeps_own_in_its_order():
    """What `--mode train --seeds=K` (and `--mode print --seeds=K`) runs: the whole sweep's commands for seed K's runs,
    trunks before their branches, so that one process per seed trains the sweep side by side."""
    plan = natural.get_config("past-scale")
    runs = sweep.planned_runs(plan)
    every = [training.command for training in sweep.trainings(runs)]
    per_seed = []
    for seed in plan.seeds:
        commands = [training.command for training in sweep.trainings(sweep.of_seeds(runs, [str(seed)]))]
        assert commands == [c for c in every if c[c.index("--workdir") + 1].endswith(f"-s{seed}")]
        assert any("--branch_from" in command for command in commands)
        per_seed += commands
    assert sorted(map(tuple, per_seed)) == sorted(map(tuple, every))
    assert sweep.of_seeds(runs, []) == runs
    with pytest.raises(ValueError, match="--seeds: no seed 7, x in this sweep; its seeds: 0, 1$"):
        sweep.of_seeds(runs, ["0", "7", "x"])


@pytest.mark.parametrize("module, smoke, full", [(ablation, "smoke", "cpu"), (natural, "smoke", ""),
                                                 (synthetic, "markov,smoke", "markov")])
def test_a_smoke_sweep_never_writes_into_committed_results(module, smoke, full):
    """Its 4-step numbers under a REPORT describing the full recipe would replace the committed ones."""
    plan, full_plan = module.get_config(smoke), module.get_config(full)
    assert plan.workdir_root != full_plan.workdir_root
    for path in (plan.report_dir, plan.workdir_root):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0, path


def test_print_with_seeds_prints_only_those_seeds_runs():
    """The command line's wiring of --seeds into --mode print: seed 1's commands, every one of them, and no other."""
    result = subprocess.run([sys.executable, "-m", "deberta_jax.study.sweep", "--sweep",
                             "configs/sweeps/natural.py:past-scale", "--mode", "print", "--seeds=1"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    runs = sweep.planned_runs(natural.get_config("past-scale"))
    want = [shlex.join(training.command[1:]) for training in sweep.trainings(sweep.of_seeds(runs, ["1"]))]
    printed = [shlex.join(shlex.split(line)[1:]) for line in result.stdout.splitlines()]
    assert printed == want and all("-s1" in line for line in printed) and len(printed) < len(runs)


def test_printed_commands_run_as_printed_from_the_repository_root():
    result = subprocess.run([sys.executable, "-m", "deberta_jax.study.sweep", "--sweep",
                             "configs/sweeps/ablation.py:smoke", "--mode", "print"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    for line in result.stdout.splitlines():
        program, script, *_ = shlex.split(line)
        assert shutil.which(program) and (REPO / script).is_file(), line


def test_a_failed_run_is_named_with_its_command_in_one_line(tmp_path):
    """What the sweep's argument errors (passed on to train.py) and failed runs end in."""
    command = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(ChildProcessError) as info:
        sweep.train_all([dict(name="bert-L16-s0", workdir=str(tmp_path / "run"), command=command, num_steps=4,
                              config="configs/bert.py:micro", overrides={})])
    assert isinstance(info.value, errors.USER_ERRORS)  # reported as one line, without a traceback
    message = str(info.value)
    assert "\n" not in message and "run bert-L16-s0 failed (exit status 3" in message
    assert shlex.join(command) in message


def test_a_finished_run_trained_on_another_config_is_refused_naming_what_changed(corpus, tmp_path, monkeypatch):
    """A finished run is skipped only while it trained what the sweep gives it: another model size, another data
    file, or its training text rewritten are named in one line with the choices; an unchanged rerun skips it."""
    data = tmp_path / "data"
    for name, source in (("brown/train.txt", "train.txt"), ("other/train.txt", "train.txt"),
                         ("brown/valid.txt", "valid.txt"), ("wikitext-2/test.txt", "valid.txt")):
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(corpus / source, data / name)
    plan = ablation.get_config("smoke")
    plan.workdir_root, plan.data_dir = str(tmp_path / "runs"), str(data)
    plan.variants = plan.variants[:1]
    plan.common_overrides.data.cache_dir = str(tmp_path / "cache")
    [run] = sweep.planned_runs(plan)

    def train_in_process(command):
        assert command == run["command"]
        config = config_checks.load_config_file(run["config"])
        config.update_from_flattened_dict(run["overrides"])
        train.train_and_evaluate(config, run["workdir"])
        return 0, False

    monkeypatch.setattr(sweep, "train_run", train_in_process)
    sweep.train_all([run])
    assert (tmp_path / "runs" / run["name"] / sweep.TRAINED_FILE).is_file()
    assert sweep.changed_since_trained(run) is None
    sweep.train_all([run])  # skipped: train_in_process would refuse a second training
    monkeypatch.setattr(sweep, "train_run", lambda command: pytest.fail("trained again"))

    def refusal(**changes) -> str:
        changed = copy.deepcopy(plan)
        changed.common_overrides.update_from_flattened_dict(changes.pop("overrides", {}))
        changed.update(changes)
        with pytest.raises(ValueError) as info:
            sweep.train_all(sweep.planned_runs(changed))
        message = str(info.value)
        assert "\n" not in message and "--sweep.workdir_root" in message and f"remove {run['workdir']}" in message
        return message

    assert "config.model.hidden_size 32 vs 48" in refusal(overrides={"model.hidden_size": 48})
    assert "config.data.train_files" in refusal(overrides={
        "data.train_files": str(data / "other/train.txt")})
    # The same bytes written again (a copy, a re-download, a checkout): the same text, whatever its time stamp.
    (data / "brown/train.txt").write_bytes((data / "brown/train.txt").read_bytes())
    os.utime(data / "brown/train.txt", (1, 1))
    assert sweep.changed_since_trained(run) is None
    (data / "brown/train.txt").write_text((corpus / "train.txt").read_text().replace("the", "a"))
    assert "brown/train.txt) were rewritten since it trained" in refusal()
    (tmp_path / "runs" / run["name"] / sweep.TRAINED_FILE).write_text('{"config_fingerp')
    with pytest.raises(ValueError, match=f"{sweep.TRAINED_FILE} is damaged: .* Remove it to compare"):
        sweep.train_all([run])
    # A run trained without the sweep (a printed command) has no fingerprint: its config.json is compared.
    (tmp_path / "runs" / run["name"] / sweep.TRAINED_FILE).unlink()
    assert sweep.changed_since_trained(run) is None
    assert "config.model.num_heads" in refusal(overrides={"model.num_heads": 2})


def test_a_runs_cached_evaluation_is_redone_for_other_study_settings_or_another_checkpoint(corpus, tmp_path,
                                                                                            monkeypatch):
    """Each alone: the eval texts unchanged, only a study setting or only the checkpoint (the run continued)."""
    plan = ablation.get_config("smoke")
    for name in ("brown/valid.txt", "wikitext-2/test.txt"):
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(corpus / "valid.txt", tmp_path / "data" / name)
    plan.data_dir = str(tmp_path / "data")
    config = micro_variant_config(plan.variants[0], corpus)
    workdir = str(tmp_path / "run")
    train.train_and_evaluate(config, workdir)
    evaluated = []
    monkeypatch.setattr(sweep.length_study, "load_workdir_model", lambda workdir: workdir)
    monkeypatch.setattr(sweep.length_study, "run_study",
                        lambda models, *args, **options: evaluated.append(models) or ([], []))

    def score(num_steps: int) -> int:
        sweep.score_run(dict(workdir=workdir, num_steps=num_steps), *sweep.evaluation_inputs(plan), {})
        return len(evaluated)

    assert score(3) == 1 and score(3) == 1
    plan.eval.multiples = [1, 2, 4]
    assert score(3) == 2
    plan.eval.max_eval_tokens += 1
    assert score(3) == 3 and score(3) == 3
    config.train.num_steps = config.train.checkpoint_every = 6
    train.train_and_evaluate(config, workdir)
    assert score(6) == 4


def test_the_report_states_what_each_run_trained_from_its_own_config(tmp_path):
    """Not the sweep's config now: each run's training text and the fields that differ between runs, the model's
    and a training recipe's alike; not the seed."""
    runs = []
    for seed, (name, hidden, train_files, long_steps) in enumerate(
            (("a-L16-s0", 32, "old/train.txt", 0), ("b-L16-s0", 48, "new/train.txt", 20))):
        config = variant_config(ablation.get_config("smoke").variants[0], "micro")
        config.update_from_flattened_dict({"model.hidden_size": hidden, "data.train_files": train_files, "seed": seed,
                                           "train.long_steps": long_steps})
        checkpoint.write_config(tmp_path / name, config)
        runs.append(dict(name=name, workdir=str(tmp_path / name)))
    table = sweep.trained_table(runs).splitlines()
    assert table[0] == "| run | data.train_files | data.seq_len | model.hidden_size | train.long_steps |"
    assert table[2:] == [f"| a-L16-s0 | old/train.txt | {config.data.seq_len} | 32 | 0 |",
                         f"| b-L16-s0 | new/train.txt | {config.data.seq_len} | 48 | 20 |"]


@pytest.mark.long
def test_report_evaluates_each_run_once_and_adds_the_unigram_floor(corpus, tmp_path, monkeypatch):
    plan = ablation.get_config("smoke")
    plan.workdir_root, plan.report_dir = str(tmp_path / "runs"), str(tmp_path / "report")
    # Absolute: the test changes directory below, which a sweep process never does.
    plan.config_path = f"{REPO}/configs/sweeps/ablation.py:smoke"
    for name in ("brown/valid.txt", "wikitext-2/test.txt"):  # the eval files under the sweep's data_dir
        (tmp_path / "data" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / name).symlink_to(corpus / "valid.txt")
    plan.data_dir = str(tmp_path / "data")
    assert plan.eval.data_files["brown/valid"] == str(tmp_path / "data" / "brown/valid.txt")
    runs = sweep.planned_runs(plan)
    for variant, run in zip(plan.variants, runs):
        config = micro_variant_config(variant, corpus)
        config.train.num_steps = run["num_steps"]
        train.train_and_evaluate(config, run["workdir"])
    # Trained at micro size, not the smoke config's: what is tested here is the scoring.
    monkeypatch.setattr(sweep, "changed_since_trained", lambda run: None)
    # One run scored on its own (as a second process would, side by side): the report scores only the other.
    sweep.score_named(plan, runs, [runs[1]["name"]])
    scored, run_study = [], sweep.length_study.run_study
    monkeypatch.setattr(sweep.length_study, "run_study",
                        lambda models, *args, **options: (scored.append(models[0].label)
                                                          or run_study(models, *args, **options)))
    report_path = sweep.evaluate_and_report(plan, runs, "run")
    assert "bert-L16" in scored and "deberta-L16" not in scored
    # A run another process is scoring (it holds the workdir's lock) is not scored twice: the report says who has it.
    with workdir_lock.hold(runs[1]["workdir"], what="another scoring process"):
        with pytest.raises(workdir_lock.WorkdirBusyError, match="another scoring process"):
            sweep.evaluate_and_report(plan, runs, "report")
    text = open(report_path).read()
    assert "by `--mode run`" in text and "configs/sweeps/ablation.py:smoke" in text
    # Each run's command as a user would type it: the interpreter named, not this machine's path to it.
    assert f"    python train.py --config {plan.variants[0].config} --workdir {runs[0]['workdir']}" in text
    for label in ("bert-L16", "deberta-L16", "unigram"):
        assert f"| {label} |" in text
    # The table's columns are the multiples the sweep scored, up to its largest.
    assert f"| loss {plan.eval.multiples[-1]}x - 1x |" in text and "loss 8x" not in text
    assert (tmp_path / "report" / "loss_vs_length_brown_valid.png").is_file()

    # A second report reads every run's cached evaluation; changed eval settings invalidate it.
    def fail(*args, **kwargs):
        raise AssertionError("evaluated again")

    monkeypatch.setattr(sweep.length_study, "run_study", fail)
    again = open(sweep.evaluate_and_report(plan, runs, "report")).read()
    assert again.split("## Sweep")[0].count("| unigram |") == 2 and "by `--mode report`" in again
    # The same files spelled another way are the same evaluation ...
    monkeypatch.chdir(tmp_path / "runs")
    plan.data_dir = "../data"
    sweep.evaluate_and_report(plan, runs, "report")
    # ... and so is a fresh copy of the same text (another file, another modification time) ...
    wikitext = tmp_path / "data" / "wikitext-2" / "test.txt"
    wikitext.unlink()
    wikitext.write_text((corpus / "valid.txt").read_text())
    sweep.evaluate_and_report(plan, runs, "report")
    # ... but another text of the same size, or changed eval settings, are not.
    wikitext.write_text((corpus / "valid.txt").read_text().replace("a", "b"))
    assert wikitext.stat().st_size == (corpus / "valid.txt").stat().st_size
    with pytest.raises(AssertionError, match="evaluated again"):
        sweep.evaluate_and_report(plan, runs, "report")
    plan.data_dir = str(tmp_path / "data")
    plan.eval.num_spans += 1
    with pytest.raises(AssertionError, match="evaluated again"):
        sweep.evaluate_and_report(plan, runs, "report")


def test_a_sigterm_while_scoring_raises_nothing_where_it_lands_and_stops_before_the_next_unit():
    """Library code may catch what a signal handler raises where the signal lands (jax's compilation cache turns any
    error while it reads an entry into a warning), so the handler only takes note, and the study asks before each
    unit (`length_study.run_study`'s `before_each_unit`)."""
    with pytest.raises(sweep.ScoringStopped, match="every run scored before it keeps its evaluation"):
        with sweep.stopping_scoring_on_sigterm():
            try:
                signal.raise_signal(signal.SIGTERM)
            except Exception as landed:
                raise AssertionError("raised where the signal landed") from landed
            sweep.stop_if_sigterm_noticed()
            raise AssertionError("scored on past the notice")
    with pytest.raises(sweep.ScoringStopped):  # noticed after the last unit: the block's end stops
        with sweep.stopping_scoring_on_sigterm():
            signal.raise_signal(signal.SIGTERM)
    with sweep.stopping_scoring_on_sigterm():  # a later block starts without the old notice
        sweep.stop_if_sigterm_noticed()


def test_scoring_named_runs_refuses_unknown_or_unfinished_ones_naming_the_sweeps_runs(tmp_path):
    plan = ablation.get_config("smoke")
    plan.workdir_root = str(tmp_path / "runs")
    runs = sweep.planned_runs(plan)
    with pytest.raises(ValueError, match="needs the runs to evaluate: --runs=bert-L16-s0"):
        sweep.score_named(plan, runs, [])
    with pytest.raises(ValueError, match="no run named bert-L99-s0 in this sweep; its runs: bert-L16-s0, deberta"):
        sweep.score_named(plan, runs, ["bert-L16-s0", "bert-L99-s0"])
    with pytest.raises(FileNotFoundError, match="deberta-L16-s0 not finished .* train it first"):
        sweep.score_named(plan, runs, ["deberta-L16-s0"])
    result = subprocess.run([sys.executable, "-m", "deberta_jax.study.sweep", "--sweep",
                             "configs/sweeps/ablation.py:smoke", "--mode", "report", "--runs=bert-L16-s0"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "--runs applies to --mode score only" in result.stderr
    assert "Traceback" not in result.stderr


def test_flatten_builds_override_names():
    tree = config_dict.ConfigDict(dict(model=dict(use_emd=True, pos_att_type="c2p"), seed=3)).to_dict()
    assert sweep.flatten(tree) == {"model.use_emd": True, "model.pos_att_type": "c2p", "seed": 3}


def test_the_report_names_the_commit_wherever_it_is_written(tmp_path):
    """A report outside the checkout (a scratch folder, a bucket) is marked with the commit as one inside it is."""
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    for where in (str(tmp_path / "report"), "results/some-report", "gs://bucket/report"):
        assert sweep.code_version(where).startswith(rev), where


def test_a_sigint_to_the_sweep_alone_stops_its_training_child(tmp_path):
    """kill -INT of the sweep's process (not its group, as Ctrl-C would): the train.py it runs gets the SIGINT too
    and has stopped before the sweep ends, instead of training on as an orphan."""
    child = ("import os, signal, sys, time\n"
             "signal.signal(signal.SIGINT, lambda *_: (open(sys.argv[2], 'w').write('stopped'), sys.exit(130)))\n"
             "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
             "time.sleep(120)\n")
    parent = ("import sys\nfrom deberta_jax.study import sweep\n"
              "try:\n    sweep.train_run([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]])\n"
              "except KeyboardInterrupt:\n    print('interrupted')\n")
    started, stopped = tmp_path / "pid", tmp_path / "stopped"
    process = subprocess.Popen([sys.executable, "-c", parent, child, str(started), str(stopped)],
                               cwd=REPO,
                               stdout=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    os.kill(process.pid, signal.SIGINT)
    out, _ = process.communicate(timeout=60)
    assert out.strip() == "interrupted" and stopped.read_text() == "stopped"
    with pytest.raises(ProcessLookupError):
        os.kill(int(started.read_text()), 0)
