"""Bad input through the real command lines, as a user types them: each row is an argv, the exit status and the pieces
of the one line it must end in. Every row fails at start-up, before any training or compiling, and none needs a trained
model (a hand-made workdir stands in where one is named). Rows run two at a time: each pays Python's and jax's
imports. A refusal that needs a trained run or a second invocation has its own test beside the code it guards."""

import concurrent.futures
import gzip
import json
import os
import re
import subprocess
import sys

from deberta_jax.data import errors
from tests.helpers import REPO

TRAIN = [sys.executable, "train.py"]
EVAL = [sys.executable, "eval.py"]
EXPORT = [sys.executable, "-m", "deberta_jax.export"]
AOT = [sys.executable, "-m", "deberta_jax.aot"]
SWEEP = [sys.executable, "-m", "deberta_jax.study.sweep"]
SEED_RATE = [sys.executable, "-m", "deberta_jax.study.seed_rate"]
CURVES = [sys.executable, "-m", "deberta_jax.study.curves"]
FETCH = [sys.executable, "-m", "deberta_jax.data.fetch"]
# No network: every HTTPS request goes to a proxy port where nothing listens.
OFFLINE = ["env", "https_proxy=http://127.0.0.1:9", "HTTPS_PROXY=http://127.0.0.1:9", "no_proxy=", "NO_PROXY="]
CONFIG = ["--config", "configs/deberta.py:micro"]


# The hints the one line may carry under it: absl's under a flag-parsing error, the project's under a refusal.
HINTS = ("Pass --helpshort or --helpfull to see help on flags.",
         f"({errors.TRACEBACK_VARIABLE}=1 shows where it was raised)")
# A run's progress log before the refusal (absl's `I1202 13:00:39.95 ...` lines) is not part of the message.
LOG_LINE = re.compile(r"[IW]\d{4} \d\d:\d\d:\d\d\.\d+ ")


def rows(tmp) -> list[tuple[list[str], int, str | tuple[str, ...]]]:
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
        (TRAIN + CONFIG + ["--workdir", workdir, "--config.model.nofield=1"], 1,
         ("--config.model.nofield: config.model has no field 'nofield'; its fields are [", "'hidden_size'")),
        (TRAIN + CONFIG + ["--workdir", workdir, "--config.trian.num_steps=1"], 1,
         "--config.trian.num_steps: config has no field 'trian'; its fields are ['data', 'mesh'"),
        (TRAIN + CONFIG + ["--workdir", workdir, "--config.train.batch_size=0"], 1,
         "config.train.batch_size=0 must be an integer >= 1"),
        (TRAIN + CONFIG + ["--workdir", workdir, *data], 1, "is gzip-compressed, not text"),
        (EVAL + ["--workdir", truncated, "--data_files", "synthetic:markov:test", "--out", f"{tmp}/out"], 1,
         "config.json is not valid JSON"),
        (EVAL + ["--workdir", workdir, "--workdir", f"{tmp}/./run/", "--data_files", "synthetic:markov:test", "--out",
                 f"{tmp}/out"], 1, f"eval.py: --workdir {tmp}/./run/ is given twice ({workdir}): one run scored twice "
         "would be averaged as two seeds with a zero-width interval"),
        (EVAL + ["--workdir", workdir, "--data_files", "synthetic:markov:test", "--out", f"{tmp}/a_file/out"], 1,
         "is not writable"),
        (EVAL + ["--workdir", workdir, "--data_files", "synthetic:markov:test", "--out", f"{tmp}/out",
                 "--lengths", "100000"], 1, "--lengths=100000 is out of range"),
        (EVAL + ["--workdir", workdir, "--data_files", "synthetic:markov:test", "--checkpoint", "abc", "--out",
                 f"{tmp}/out"], 1, "--checkpoint='abc'"),
        # Flags whose values would quietly score, train or write something else than asked (each kind once here;
        # every field's refusal: tests/study/test_evaluation.py).
        *[(EVAL + ["--workdir", workdir, "--data_files", "synthetic:markov:test", "--out", f"{tmp}/out", *flags], 1,
           message) for flags, message in [
            (["--methods", "window,window"], "eval.py: methods: 'window' given twice; give each once"),
            (["--policies="], "eval.py: policies: none given"),
            (["--multiples="], "eval.py: multiples: none given, so there is no length to score"),
            (["--max_eval_tokens=-100"], "eval.py: max_eval_tokens=-100: give a number of tokens"),
            (["--bootstrap", "0"], "eval.py: bootstrap=0: the 95% intervals are percentiles"),
            (["--mask_seed", "-1"], "eval.py: mask_seed=-1: the seed of the fixed targets must be an integer from 0 "
             "up"),
            (["--workdir", ""], "eval.py: --workdir is empty: give a folder"),
            (["--hf_checkpoint", "gs:/bucket/hub"], "eval.py: --hf_checkpoint='gs:/bucket/hub' is neither a bucket URL "
             "nor a local path: write gs://bucket/hub (two slashes)")]],
        (EVAL + ["--hf_checkpoint", f"{tmp}/nowhere", "--data_files", "synthetic:markov:test", "--out", f"{tmp}/out"],
         1, f"eval.py: {tmp}/nowhere does not exist or is not a folder: give the folder of a Hugging Face checkpoint"),
        (TRAIN + CONFIG + ["--workdir", "gs:/bucket/run"], 1, "train.py: --workdir='gs:/bucket/run' is neither"),
        (CURVES + ["--workdir", f"bert={workdir}", "--workdir", f"bert={tmp}/other", "--out", f"{tmp}/curves"], 1,
         f"--workdir bert={workdir} and --workdir bert={tmp}/other share the label 'bert'; give each run a label of "
         "its own"),
        (EXPORT + ["--workdir", workdir, "--out", "gs:bucket/hub"], 1, "write gs://bucket/hub"),
        (EXPORT + ["--workdir", workdir], 1, "Flag --out must have a value other than None"),
        (AOT + ["--topology", "v5e:2x2"], 1, "Flag --config must have a value other than None"),
        (AOT + CONFIG + ["--topology", "v5e:2x2", "--out", "/proc/aot.json"], 1, "its folder /proc is not writable"),
        (AOT + CONFIG + ["--topology", "v5e:4x4x4"], 1,
         "error: topology 'v5e:4x4x4': v5e slices are named by a 2-D chip grid"),
        # The ZeroDivisionError of the length forward's batch once; -2, a math domain error.
        (AOT + CONFIG + ["--topology", "v5e:2x2", "--length_multiple=0"], 1,
         "--length_multiple=0: the length forward is compiled at this multiple of config.data.seq_len, so it must be "
         "1 or more"),
        (SWEEP, 1, "Flag --sweep must have a value other than None"),
        (SWEEP + ["--sweep", "configs/sweeps/nope.py"], 1, "configs/sweeps/nope.py does not exist"),
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py", "--mode", "bogus"], 1, "flag --mode=bogus"),
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py:bogus", "--mode", "print"], 1, "unknown sweep arg 'bogus'"),
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py", "--mode", "print", "extra"], 1,
         "unexpected arguments ['extra']"),
        (SWEEP + ["--sweep", "configs/sweeps/natural.py", "--sweep.seeds=[2,3]", "--mode", "print"], 1,
         "--sweep.seeds: a list field cannot be set from the command line (only numbers, strings, booleans and tuples "
         "can); change it in the config file, or in a copy of it"),
        (OFFLINE + FETCH + ["--out", f"{tmp}/data"], 1,
         ("python -m deberta_jax.data.fetch: cannot download https://", "brown.zip (", "the network or the host is "
          "unreachable from here); download it where it can be reached and give the file with --brown_zip=")),
        (FETCH + ["--out", f"{tmp}/data", "--brown_zip", f"{tmp}/a_file"], 1,
         f"--brown_zip={tmp}/a_file is not a zip file: give NLTK's brown.zip"),
        (SEED_RATE + ["--curves", curves, "--out", f"{tmp}/rate", "--margin=-0.5"], 1, "--margin=-0.5"),
        (SEED_RATE + ["--curves", bad_curves, "--out", f"{tmp}/rate"], 1, "bad-curves.json is not valid JSON"),
    ]


def run(argv: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("DEBERTA_JAX_TRACEBACK", None)
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)


def test_bad_input_ends_in_one_line_without_a_traceback(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "a_file").write_text("")
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
        pieces = (message,) if isinstance(message, str) else message
        lines = [line for line in result.stderr.splitlines()
                 if line.strip() and line not in HINTS and not LOG_LINE.match(line)]
        one_line = len(lines) == 1 and all(piece in lines[0] for piece in pieces)
        if result.returncode != status or not one_line:
            failures.append(f"{argv[1:]}: exit {result.returncode}, stderr:\n{result.stderr[-1500:]}")
    assert not failures, "\n\n".join(failures)
