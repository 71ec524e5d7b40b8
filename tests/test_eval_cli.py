"""eval.py end to end: a run trained on synthetic data is scored with the unigram floor and the task's oracle; what
it refuses about that run and its texts. Bad flags that need no trained run are rows of tests/test_command_lines.py."""

import concurrent.futures
import gzip
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import train
from configs import deberta
from deberta_jax.study import report
from deberta_jax.train import checkpoint
from tests.helpers import files_after_kills

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.slow  # trains a micro run, then starts eval.py twice


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic-run")
    config = deberta.get_config("micro")
    config.data.train_files = "synthetic:markov:train:docs=20,doc_len=256"
    config.data.eval_files = "synthetic:markov:validation:docs=2,doc_len=256"
    config.data.cache_dir = str(root / "cache")
    config.train.update(num_steps=4, warmup_steps=1, log_every=2, eval_every=4, checkpoint_every=2)
    train.train_and_evaluate(config, root / "run")
    return root / "run"


def eval_py(*args):
    return subprocess.run([sys.executable, "eval.py", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_eval_scores_a_synthetic_run_with_the_floor_and_the_oracle(workdir, tmp_path):
    result = eval_py("--workdir", str(workdir), "--data_files", "synthetic:markov:test:docs=3,doc_len=300",
                     "--multiples", "1,2", "--extra", "", "--protocols", "chunked", "--bootstrap", "20",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    records = report.read_results_file(tmp_path)["records"]
    loss = {(r["model"], r["eval_len"]): r["value"] for r in records
            if r["metric"] == "loss" and r["bucket"] == "all" and r["seed"] != "mean"
            and r["policy"] in ("none", "clip")}
    assert {model for model, _ in loss} == {"run", "unigram", "oracle"}
    assert {n for _, n in loss} == {32, 64}
    assert loss["oracle", 32] < loss["unigram", 32] - 1.0
    assert any(r["metric"] == "gap_closed" for r in records)
    # The checkpoint scored is named; progress off a terminal is a line per unit, without the checkpoint
    # library's INFO records.
    assert {r["step"] for r in records if r["model"] == "run" and r["seed"] != "mean"} == {4}
    assert "Checkpoints scored: run (seed 0): step 4." in (tmp_path / "summary.md").read_text()
    assert "scoring 1/6: run on synthetic:markov:test:docs=3,doc_len=300 at N=32" in result.stderr
    assert "CheckpointManager created" not in result.stderr


@pytest.mark.long
def test_a_killed_evaluation_keeps_the_previous_results_and_the_rerun_completes(workdir, tmp_path):
    """SIGKILL at random moments of an evaluation writing over an earlier one, then the same command again: every
    report file is at all times the earlier run's or the new one's, no temporary is left, and the rerun completes."""
    out = tmp_path / "out"
    common = ["--workdir", str(workdir), "--data_files", "synthetic:markov:test:docs=3,doc_len=300", "--extra", "",
              "--protocols", "chunked", "--bootstrap", "20", "--out", str(out)]
    assert eval_py(*common, "--multiples", "1").returncode == 0
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    command = [sys.executable, "eval.py", *common, "--multiples", "1,2"]
    # Start-up and scoring take ~6-12 s here.
    snapshots = files_after_kills(command, np.random.default_rng(1).uniform(3.0, 9.0, size=2), out, cwd=REPO)
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    final = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(final) == set(earlier)  # no temporary of a killed run left beside the reports
    for files in snapshots:
        assert set(files) - set(final) <= {name for name in files if ".tmp-" in name}  # a killed writer's, at most
        assert all(files[name] in (earlier[name], final[name]) for name in files if ".tmp-" not in name)
    assert {r["eval_len"] for r in json.loads(gzip.decompress(final["results.json.gz"]))["records"]} == {32, 64}


def test_two_eval_files_with_one_label_are_refused(workdir, tmp_path):
    """`A/x/valid.txt` and `B/x/valid.txt` would both be `x/valid`: one would silently replace the other."""
    paths = []
    for root in ("A", "B"):
        path = tmp_path / root / "x" / "valid.txt"
        path.parent.mkdir(parents=True)
        path.write_text("some words here\n" * 50)
        paths.append(str(path))
    result = eval_py("--workdir", str(workdir), "--data_files", paths[0], "--data_files", paths[1],
                     "--out", str(tmp_path / "out"))
    assert result.returncode == 1, result.stderr[-2000:]
    assert f"--data_files '{paths[0]}' and '{paths[1]}' would both be reported as 'x/valid'" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out" / "results.json.gz").exists()


def test_eval_text_without_targets_is_refused_naming_it(workdir, tmp_path):
    """Targets are drawn for 15% of positions; one short word draws none, and a loss over 0 tokens is no result."""
    text = tmp_path / "tiny" / "valid.txt"
    text.parent.mkdir()
    text.write_text("a\n")
    result = eval_py("--workdir", str(workdir), "--data_files", str(text), "--lengths", "16", "--protocols",
                     "chunked", "--nounigram", "--nooracle", "--out", str(tmp_path / "out"))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "tiny/valid: the text yields no masked targets" in result.stderr and "Traceback" not in result.stderr


def test_curves_report_finds_where_runs_leave_the_plateau(workdir, tmp_path):
    from deberta_jax.study import curves

    markdown = curves.write_curves_report({"a": str(workdir), "b": str(workdir)}, str(tmp_path), margin=0.05)
    saved = json.loads((tmp_path / "curves.json").read_text())
    assert 2.0 < saved["unigram_floor"] < 4.0  # markov's 32 symbols: below log(32) = 3.47
    exit_step = curves.plateau_exit(curves.eval_curve(str(workdir)), saved["unigram_floor"], 0.05)
    assert saved["exits"] == {"a": exit_step, "b": exit_step} and saved["margin"] == 0.05
    shown = exit_step if exit_step is not None else "not within the run"
    assert f"| a | {shown} |" in markdown and (tmp_path / "eval_loss_vs_step.png").stat().st_size > 0
    assert curves.plateau_exit({10: 6.7, 20: 6.55, 30: 6.4}, floor=6.66, margin=0.1) == 20
    assert curves.plateau_exit({10: 6.7}, floor=6.66, margin=0.1) is None


@pytest.fixture(scope="module")
def lookalikes(workdir, tmp_path_factory):
    """Copies of the run that must not be averaged with it as seeds, and the run exported for transformers."""
    from deberta_jax.export import writer

    root = tmp_path_factory.mktemp("lookalikes")

    def copy(name, seed=0, steps=(2, 4), evaluated=True):
        folder = root / name
        shutil.copytree(workdir, folder)
        config = json.loads((folder / checkpoint.CONFIG_FILE).read_text())
        (folder / checkpoint.CONFIG_FILE).write_text(json.dumps(dict(config, seed=seed)))
        for step_dir in (folder / checkpoint.CHECKPOINT_DIR).iterdir():
            if int(step_dir.name) not in steps:
                shutil.rmtree(step_dir)
            elif not evaluated:
                shutil.rmtree(step_dir / "metrics", ignore_errors=True)  # only evaluation steps have one
        return str(folder)

    hub = root / "hub"
    writer.export_workdir(workdir, hub)
    return dict(window=copy("run+window"), again=copy("run-s0"), earlier=copy("run-s1", seed=1, steps=(2,)),
                unevaluated=copy("unevaluated", evaluated=False), hub=str(hub))


def test_runs_that_are_not_seeds_of_one_model_are_refused_in_one_line(workdir, lookalikes, tmp_path):
    """Each row is refused before anything is scored, naming both runs and the fix."""
    run, data = str(workdir), ["--data_files", "synthetic:markov:test:docs=3,doc_len=300", "--out", str(tmp_path)]
    rows = [
        # A folder named like the run under a length method: two models under one label.
        (["--workdir", run, "--workdir", lookalikes["window"], "--methods", "window"],
         f"{lookalikes['window']} and {run} under the length method 'window' would both be reported as 'run+window', "
         "averaged as two seeds of one model, but they are scored under different length methods"),
        # Seeds of one config at different checkpoint steps (the second's training stopped at step 2).
        (["--workdir", run, "--workdir", lookalikes["earlier"]],
         f"{run} and {lookalikes['earlier']} would both be reported as 'run', averaged as two seeds of one model, but "
         "they are at different checkpoint steps (4 vs 2); score both at one step (eval.py --checkpoint N)"),
        # A copy of the run is not another seed.
        (["--workdir", run, "--workdir", lookalikes["again"]], "but both have seed 0: one run given twice, or a "
         "repeated run, is not another seed; give only one of them"),
        (["--workdir", lookalikes["unevaluated"], "--checkpoint", "best"],
         f"no best checkpoint in {lookalikes['unevaluated']}: no eval loss was logged (config.data.eval_files was "
         "empty, or the run stopped before its first evaluation); pass --checkpoint latest, or one of its steps "
         "[2, 4]"),
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda row: eval_py(*row[0], *data), rows))
    for (args, message), result in zip(rows, results):
        lines = [line for line in result.stderr.splitlines() if line.startswith("eval.py:")]
        assert result.returncode == 1 and len(lines) == 1 and message in lines[0], (args, result.stderr[-2000:])
        assert "Traceback" not in result.stderr and "scoring 1/" not in result.stderr
    assert not (tmp_path / report.RESULTS_FILE).exists()


def test_a_transformers_checkpoint_is_scored(lookalikes, tmp_path):
    """The README's command for a transformers checkpoint (it once failed on the seed such a folder does not have)."""
    result = eval_py("--hf_checkpoint", lookalikes["hub"], "--data_files", "synthetic:markov:test:docs=3,doc_len=300",
                     "--multiples", "1", "--extra", "", "--protocols", "chunked", "--bootstrap", "20", "--nooracle",
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    runs = [r for r in report.read_results_file(tmp_path)["records"] if r["seed"] != "mean"]
    assert {(r["model"], r["seed"], r["source"], r["method"]) for r in runs} == {
        ("hub", "published", lookalikes["hub"], "none")}
