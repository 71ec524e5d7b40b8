"""Bad input through the real command lines, as a user types them: each row is an argv, the exit status and a piece
of the one-line message. Every row fails at start-up, before any training or compiling, and none needs a trained
model (a hand-made workdir stands in where one is named). Rows run two at a time: each pays Python's and jax's
imports."""

import concurrent.futures
import gzip
import json
import os
import subprocess
import sys

from tests.helpers import REPO

TRAIN = [sys.executable, "train.py"]
EVAL = [sys.executable, "eval.py"]
EXPORT = [sys.executable, "-m", "deberta_jax.export"]
AOT = [sys.executable, "-m", "deberta_jax.aot"]
SWEEP = [sys.executable, "-m", "deberta_jax.study.sweep"]
SEED_RATE = [sys.executable, "-m", "deberta_jax.study.seed_rate"]
CONFIG = ["--config", "configs/deberta.py:micro"]


def rows(tmp) -> list[tuple[list[str], int, str]]:
    workdir = f"{tmp}/run"
    truncated = f"{tmp}/truncated"
    gz, curves, bad_curves = f"{tmp}/train.txt.gz", f"{tmp}/curves.json", f"{tmp}/bad-curves.json"
    data = [f"--config.data.train_files={gz}", "--config.data.eval_files="]
    return [
        (TRAIN + ["--config", "configs/nope.py:tiny", "--workdir", workdir], 1, "configs/nope.py does not exist"),
        (TRAIN + ["--config", "configs/deberta.py:huge", "--workdir", workdir], 1, "unknown config size 'huge'"),
        (TRAIN + CONFIG, 1, "Flag --workdir must have a value other than None"),
        (TRAIN + CONFIG + ["--workdir", workdir, "--config.train.num_steps=abc"], 1,
         "flag --config.train.num_steps=abc: invalid literal for int()"),
        (TRAIN + CONFIG + ["--workdir", workdir, "--config.model.nofield=1"], 1, "config.model has no field 'nofield'"),
        (TRAIN + CONFIG + ["--workdir", workdir, "--config.train.batch_size=0"], 1,
         "config.train.batch_size=0 must be an integer >= 1"),
        (TRAIN + CONFIG + ["--workdir", workdir, *data], 1, "is gzip-compressed, not text"),
        (EVAL + ["--workdir", truncated, "--data_files", "synthetic:markov:test", "--out", f"{tmp}/out"], 1,
         "config.json is not valid JSON"),
        (EVAL + ["--workdir", workdir, "--workdir", f"{workdir}/", "--data_files", "synthetic:markov:test", "--out",
                 f"{tmp}/out"], 1, "is given twice"),
        (EVAL + ["--workdir", workdir, "--data_files", "synthetic:markov:test", "--checkpoint", "abc", "--out",
                 f"{tmp}/out"], 1, "--checkpoint='abc'"),
        (EXPORT + ["--workdir", workdir], 1, "Flag --out must have a value other than None"),
        (AOT + ["--topology", "v5e:2x2"], 1, "Flag --config must have a value other than None"),
        (AOT + CONFIG + ["--topology", "v5e:2x2", "--out", "/proc/aot.json"], 1, "its folder /proc is not writable"),
        (AOT + CONFIG + ["--topology", "v5e:4x4x4"], 1, "v5e slices are named by a 2-D chip grid"),
        (AOT + CONFIG + ["--topology", "v5e:2x2", "--length_multiple=0"], 1, "--length_multiple=0"),
        (SWEEP, 1, "Flag --sweep must have a value other than None"),
        (SWEEP + ["--sweep", "configs/sweeps/nope.py"], 1, "configs/sweeps/nope.py does not exist"),
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py", "--mode", "bogus"], 1, "flag --mode=bogus"),
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py:bogus", "--mode", "print"], 1, "unknown sweep arg 'bogus'"),
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py", "--mode", "print", "extra"], 1,
         "unexpected arguments ['extra']"),
        (SEED_RATE + ["--curves", curves, "--out", f"{tmp}/rate", "--margin=-0.5"], 1, "--margin=-0.5"),
        (SEED_RATE + ["--curves", bad_curves, "--out", f"{tmp}/rate"], 1, "bad-curves.json is not valid JSON"),
    ]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("DEBERTA_JAX_TRACEBACK", None)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_bad_input_ends_in_one_line_without_a_traceback(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "config.json").write_text('{"model": {"hidden_size": 3')
    (tmp_path / "train.txt.gz").write_bytes(gzip.compress(b"some words\n" * 100))
    (tmp_path / "curves.json").write_text(json.dumps({"curves": {}, "workdirs": {}}))
    (tmp_path / "bad-curves.json").write_text('{"curves": {"bert": {"1": 2.')
    table = rows(tmp_path)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, [argv for argv, _, _ in table]))
    failures = []
    for (argv, status, message), result in zip(table, results):
        line = next((line for line in result.stderr.splitlines() if message in line), None)
        if result.returncode != status or "Traceback" in result.stderr or line is None:
            failures.append(f"{argv[1:]}: exit {result.returncode}, stderr:\n{result.stderr[-1500:]}")
    assert not failures, "\n\n".join(failures)
