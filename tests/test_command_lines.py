"""Bad input and faults through the real command lines, as a user types them: each row is an argv, the exit status and
the pieces of the one line it must end in (a warning's line, for a command that goes on), and for a stop, the text of
the log after which it gets SIGTERM. The first table's rows fail at start-up, before any training or compiling, and
need no trained model (a hand-made workdir stands in where one is named); the second's share one run of the smoke
sweep, trained by the command the sweep prints. Rows run two at a time: each pays Python's and jax's imports. A
refusal that needs a second invocation has its own test beside the code it guards."""

import concurrent.futures
import contextlib
import gzip
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

import pytest

from deberta_jax.data import errors
from deberta_jax.train import workdir_lock
from tests.helpers import REPO

TRAIN = [sys.executable, "train.py"]
EVAL = [sys.executable, "eval.py"]
EXPORT = [sys.executable, "-m", "deberta_jax.export"]
AOT = [sys.executable, "-m", "deberta_jax.aot"]
SWEEP = [sys.executable, "-m", "deberta_jax.study.sweep"]
SEED_RATE = [sys.executable, "-m", "deberta_jax.study.seed_rate"]
CURVES = [sys.executable, "-m", "deberta_jax.study.curves"]
FETCH = [sys.executable, "-m", "deberta_jax.data.fetch"]
COMPARE = [sys.executable, "-m", "deberta_jax.study.compare"]
# No network: every HTTPS request goes to a proxy port where nothing listens.
OFFLINE = ["env", "https_proxy=http://127.0.0.1:9", "HTTPS_PROXY=http://127.0.0.1:9", "no_proxy=", "NO_PROXY="]
CONFIG = ["--config", "configs/deberta.py:micro"]


# The hints the one line may carry under it: absl's under a flag-parsing error, the project's under a refusal.
HINTS = ("Pass --helpshort or --helpfull to see help on flags.",
         f"({errors.TRACEBACK_VARIABLE}=1 shows where it was raised)")
# A run's progress log before the refusal (absl's `I1202 13:00:39.95 ...` lines, a progress bar's `train:  40%|`, the
# scorer's `scoring 1/6: ...` off a terminal) is not part of the message; nor, under a sweep, is the last line of the
# train.py it ran.
LOG_LINE = re.compile(r"[IW]\d{4} \d\d:\d\d:\d\d\.\d+ |\w+: +\d+%\||scoring \d+/\d+: ")
CHILD_LINE = "train.py: "


class Row(NamedTuple):
    argv: list[str]
    status: int
    message: str | tuple[str, ...]
    sigterm_after: str | None = None  # stop the command with SIGTERM once its stderr shows this


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
        # Flags whose values would quietly score, train or write something else than asked: one row per check that
        # guards them (every setting's refusal: tests/study/test_evaluation.py, in-process).
        *[(EVAL + ["--workdir", workdir, "--data_files", "synthetic:markov:test", "--out", f"{tmp}/out", *flags], 1,
           message) for flags, message in [
            (["--methods", "window,window"], "eval.py: methods: 'window' given twice; give each once"),
            (["--workdir", ""], "eval.py: --workdir is empty: give a folder"),
            (["--hf_checkpoint", "gs:/bucket/hub"], "eval.py: --hf_checkpoint='gs:/bucket/hub' is neither a bucket URL "
             "nor a local path: write gs://bucket/hub (two slashes)")]],
        (EVAL + ["--hf_checkpoint", f"{tmp}/nowhere", "--data_files", "synthetic:markov:test", "--out", f"{tmp}/out"],
         1, f"eval.py: {tmp}/nowhere does not exist or is not a folder: give the folder of a Hugging Face checkpoint"),
        (TRAIN + CONFIG + ["--workdir", "gs:/bucket/run"], 1, "train.py: --workdir='gs:/bucket/run' is neither"),
        (TRAIN + CONFIG + ["--workdir", f"{tmp}/branch", "--branch_from", "gs:/bucket/run"], 1,
         "train.py: --branch_from='gs:/bucket/run' is neither"),
        (TRAIN + CONFIG + ["--workdir", f"{tmp}/branch", "--branch_from", f"{tmp}/export"], 1,
         f"train.py: {tmp}/export/config.json is a transformers checkpoint's (model_type='deberta-v2': an export, "
         f"which eval.py reads with --hf_checkpoint): {tmp}/export is not a training workdir"),
        (TRAIN + CONFIG + ["--workdir", f"{tmp}/branch", "--branch_from", f"{tmp}/nowhere"], 1,
         f"train.py: --branch_from: {tmp}/nowhere/config.json not found: {tmp}/nowhere is not a training workdir"),
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
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py", "--mode", "report", "--seeds=0"], 1,
         "--seeds applies to --mode train and --mode print only (given with --mode report); --mode score takes --runs"),
        (SWEEP + ["--sweep", "configs/sweeps/natural.py", "--sweep.seeds=[2,3]", "--mode", "print"], 1,
         "--sweep.seeds: a list field cannot be set from the command line (only numbers, strings, booleans and tuples "
         "can); change it in the config file, or in a copy of it"),
        (OFFLINE + FETCH + ["--out", f"{tmp}/data"], 1,
         ("python -m deberta_jax.data.fetch: cannot download https://", "brown.zip (", "the network or the host is "
          "unreachable from here); download it where it can be reached and give the file with --brown_zip=")),
        # A bucket workdir with no network: the bucket, the object and what to check, without the client's traceback.
        (OFFLINE + EVAL + ["--workdir", "gs://no-network-bucket/run", "--data_files", "synthetic:markov:test",
                           "--out", f"{tmp}/offline"], 1,
         ("eval.py: gs://no-network-bucket: cannot read gs://no-network-bucket/run/config.json (",
          "); check that the bucket exists, that these credentials may read and write it, and that the store is "
          "reachable")),
        # Brown from a file, and no network for WikiText-2: said within the Hub probe's seconds, not datasets' retries.
        (OFFLINE + FETCH + ["--out", f"{tmp}/from-zip", "--brown_zip", f"{tmp}/brown.zip"], 1,
         ("python -m deberta_jax.data.fetch: cannot download WikiText-2 (", ") from the Hugging Face hub (HEAD "
          "https://huggingface.co failed within ", "give its original wiki.valid.tokens and wiki.test.tokens as "
          f"valid.txt and test.txt in {tmp}/from-zip/wikitext-2 instead")),
        (FETCH + ["--out", f"{tmp}/data", "--brown_zip", f"{tmp}/a_file"], 1,
         f"--brown_zip={tmp}/a_file is not a zip file: give NLTK's brown.zip"),
        (SEED_RATE + ["--curves", curves, "--out", f"{tmp}/rate", "--margin=-0.5"], 1, "--margin=-0.5"),
        (SEED_RATE + ["--curves", bad_curves, "--out", f"{tmp}/rate"], 1, "bad-curves.json is not valid JSON"),
        (EVAL + ["--workdir", workdir, "--data_files", "synthetic:markov:test", "--out", f"{tmp}/out",
                 "--storage_deadline_s=nan"], 1,
         "eval.py: --storage_deadline_s=nan: give the seconds one storage call"),
        (TRAIN + CONFIG + ["--workdir", workdir, "--stop_at_step=0"], 1,
         "flag --stop_at_step=0: 0 is not a positive integer"),
        # Values that would plan runs, or write, somewhere else than asked.
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py", "--sweep.workdir_root=", "--mode", "print"], 1,
         "--sweep.workdir_root is empty: give a folder"),
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py", "--sweep.report_dir=s3:/bucket/report", "--mode", "print"],
         1, "--sweep.report_dir='s3:/bucket/report' is neither a bucket URL nor a local path: write "
         "s3://bucket/report"),
        (SWEEP + ["--sweep", "configs/sweeps/ablation.py", "--mode", "print", "--seeds=0,"], 1,
         "flag --seeds=['0', '']: an empty item (a trailing or doubled comma?)"),
        (COMPARE + ["--results", f"{tmp}/out", "--models", "a,", "--out", f"{tmp}/compare"], 1,
         "flag --models=['a', '']: an empty item"),
        (COMPARE + ["--results", f"{tmp}/out", "--models", "a", "--out", ""], 1, "--out is empty: give a folder"),
        (COMPARE + ["--results", f"{tmp}/out", "--models", "a", "--flat_within=-1"], 1,
         "flag --flat_within=-1: -1.0 is not a non-negative number"),
    ]


def run(row: Row) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("DEBERTA_JAX_TRACEBACK", None)
    if row.sigterm_after is None:
        return subprocess.run(row.argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    with tempfile.TemporaryFile("w+") as stderr:
        def logged() -> str:
            stderr.seek(0)
            return stderr.read()

        process = subprocess.Popen(row.argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        deadline = time.monotonic() + 240
        while row.sigterm_after not in logged() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=240)
        return subprocess.CompletedProcess(row.argv, process.returncode, "", logged())


def failures(table: list[tuple], results: list[subprocess.CompletedProcess]) -> list[str]:
    """The rows whose command ended otherwise than the row says: another status, a traceback, or not in its one line
    (for a command that succeeds, the warning among its log)."""
    found = []
    for row, result in zip([Row(*row) for row in table], results):
        pieces = (row.message,) if isinstance(row.message, str) else row.message
        lines = [line for line in result.stderr.splitlines()
                 if line.strip() and line not in HINTS and not LOG_LINE.match(line)
                 and not (line.startswith(CHILD_LINE) and row.argv[1] != "train.py")]
        if row.status == 0:
            said = [line for line in result.stderr.splitlines() if all(piece in line for piece in pieces)]
            one_line = len(said) == 1 and "Traceback" not in result.stderr
        else:
            one_line = len(lines) == 1 and all(piece in lines[0] for piece in pieces)
        if result.returncode != row.status or not one_line:
            found.append(f"{row.argv[1:]}: exit {result.returncode}, stderr:\n{result.stderr[-1500:]}")
    return found


def run_table(table: list[tuple]) -> list[subprocess.CompletedProcess]:
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(run, [Row(*row) for row in table]))
    assert not failures(table, results), "\n\n".join(failures(table, results))
    return results


@pytest.mark.long
def test_bad_input_ends_in_one_line_without_a_traceback(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "a_file").write_text("")
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "config.json").write_text('{"model": {"hidden_size": 3')
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text('{"model_type": "deberta-v2", "hidden_size": 32}')
    (tmp_path / "train.txt.gz").write_bytes(gzip.compress(b"some words\n" * 100))
    (tmp_path / "curves.json").write_text(json.dumps({"curves": {}, "workdirs": {}}))
    (tmp_path / "bad-curves.json").write_text('{"curves": {"bert": {"1": 2.')
    with zipfile.ZipFile(tmp_path / "brown.zip", "w") as archive:  # NLTK's layout, one tagged sample
        archive.writestr("brown/ca01", "\n\n\tThe/at jury/nn said/vbd ./.\n\n")
    run_table(rows(tmp_path))


SMOKE_SWEEP = SWEEP + ["--sweep", "configs/sweeps/synthetic.py:markov,smoke"]
# The eval flags of a few seconds' scoring.
SHORT_EVAL = ["--data_files", "synthetic:markov:test:docs=4,doc_len=256", "--multiples", "1", "--extra=",
              "--protocols", "chunked", "--bootstrap", "20", "--nounigram", "--nooracle"]
# Writes past 32 KiB fail (EFBIG), as on a full disk, without root; no compilation cache entry is written under it.
FULL_DISK = ["env", "JAX_ENABLE_COMPILATION_CACHE=false", "bash", "-c", 'ulimit -f 32 && exec "$@"', "bash"]


def smoke_sweep(root) -> list[str]:
    """The smoke sweep (two micro models, 4 steps) with its runs and report under `root`; its runs train without
    evaluation, which is quicker and a nested field for the report's command to carry."""
    return SMOKE_SWEEP + [f"--sweep.workdir_root={root}/runs", f"--sweep.report_dir={root}/report",
                          "--sweep.common_overrides.data.eval_files="]


def trained_rows(tmp, run: str) -> list[tuple]:
    """Rows about `run`, a finished run of `smoke_sweep(tmp)`, and copies of it with one thing wrong
    (`tmp/<what is wrong>`)."""
    restore = "were trained with its token ids. Restore tokenizer.json from a copy of the workdir or an export of it"
    return [
        (EVAL + ["--workdir", f"{tmp}/tokenizer-cut", "--out", f"{tmp}/out", *SHORT_EVAL], 1,
         (f"eval.py: tokenizer file {tmp}/tokenizer-cut/tokenizer.json cannot be read (", restore)),
        (EVAL + ["--workdir", f"{tmp}/tokenizer-lost", "--out", f"{tmp}/out", *SHORT_EVAL], 1,
         f"eval.py: tokenizer file {tmp}/tokenizer-lost/tokenizer.json not found; the checkpoints in "
         f"{tmp}/tokenizer-lost {restore}"),
        (EVAL + ["--workdir", f"{tmp}/no-digest", "--out", f"{tmp}/out", *SHORT_EVAL], 0,
         f"checkpoint {tmp}/no-digest/checkpoints/4 has no sha256.json (saved before checkpoints carried a digest, or "
         "its process died before writing one): its files are not checked against what was saved, only its values "
         "for NaN and inf"),
        (FULL_DISK + EXPORT + ["--workdir", run, "--out", f"{tmp}/export"], 1,
         f"python -m deberta_jax.export: {tmp}/export: no room to write the export (the disk is full, or a file-size "
         "or quota limit was reached); nothing was written there"),
        # Found before any scoring, not after it.
        (FULL_DISK + EVAL + ["--workdir", run, "--out", f"{tmp}/full", *SHORT_EVAL], 1,
         f"eval.py: --out {tmp}/full has no room for 4,194,304 bytes (the disk is full, or a file-size or quota limit "
         "was reached)"),
        # Its cached evaluation cut short: evaluated again. The report names the roots in its command.
        (smoke_sweep(tmp) + ["--mode", "report"], 0,
         (f"{run}/length_eval.json is not valid JSON (", "a cached length evaluation, damaged; evaluating the run "
          "again, which replaces it")),
        # Stopped while scoring a copy of the run: one line, and its lock given back (the rerun below scores it).
        (smoke_sweep(f"{tmp}/copy") + ["--mode", "score", f"--runs={Path(run).name}"], 143,
         "python -m deberta_jax.study.sweep: preempted (SIGTERM) while scoring: every run scored before it keeps its "
         "evaluation in its workdir (length_eval.json); rerun the same command to score the rest", "scoring 1/"),
        # One seed's runs, trained beside a sweep that holds the root (`tmp/stopped/runs`): stopped the same way.
        (smoke_sweep(f"{tmp}/stopped") + ["--sweep.common_overrides.train.num_steps=100000", "--mode", "train",
                                          "--seeds=0"], 143,
         ("python -m deberta_jax.study.sweep: preempted (SIGTERM): passed on to run ", ", which stopped at its "
          "checkpoint of step ", f" in {tmp}/stopped/", "; rerun the same sweep command to resume it"),
         "] step 2: "),
    ]


@pytest.mark.slow  # trains a run of 4 steps, then scores, exports and stops one
@pytest.mark.long
def test_faults_around_a_trained_run_end_in_one_line(tmp_path):
    sweep = smoke_sweep(tmp_path)
    command = shlex.split(run(Row(sweep + ["--mode", "print"], 0, "")).stdout.splitlines()[0])
    trained = run(Row(command, 0, ""))
    assert trained.returncode == 0, trained.stderr[-2000:]
    workdir = Path(command[command.index("--workdir") + 1])
    for name in ("tokenizer-cut", "tokenizer-lost", "no-digest", f"copy/runs/{workdir.name}"):
        shutil.copytree(workdir, tmp_path / name)
    tokenizer = tmp_path / "tokenizer-cut" / "tokenizer.json"
    tokenizer.write_text(tokenizer.read_text()[:200])
    (tmp_path / "tokenizer-lost" / "tokenizer.json").unlink()
    for digest in (tmp_path / "no-digest" / "checkpoints").glob("*/sha256.json"):
        digest.unlink()
    (workdir / "length_eval.json").write_text('{"fingerprint": {"sett')
    with workdir_lock.hold(tmp_path / "stopped" / "runs", what="a sweep of every seed"):
        results = run_table(trained_rows(tmp_path, str(workdir)))
    # Loading a checkpoint logs some 70 INFO lines of orbax's in each of these programs unless they quiet them.
    assert not [r.args for r in results if "CheckpointManager created" in r.stderr]

    assert not (tmp_path / "export").exists()  # nothing half-written left as if complete
    # The report's command to go on carries the sweep's roots and overrides.
    report = (tmp_path / "report" / "REPORT.md").read_text()
    rerun = re.search(r"to train what is missing and report: `([^`]+)`", report)
    assert set(sweep[1:]) <= set(shlex.split(rerun[1])), rerun[1]
    rescored = run(Row(smoke_sweep(f"{tmp_path}/copy") + ["--mode", "score", f"--runs={workdir.name}"], 0, ""))
    assert rescored.returncode == 0, rescored.stderr[-2000:]
    # The stopped sweep's train.py is gone, and the checkpoint its line names is there.
    stopped = re.search(r"checkpoint of step (\d+) in (\S+);", results[-1].stderr)
    assert (Path(stopped[2]) / stopped[1]).is_dir()
    marker = f"{tmp_path}/stopped".encode()
    running = {p.name: _cmdline(p) for p in Path("/proc").glob("[0-9]*") if marker in _cmdline(p)}
    for pid in running:  # left training (for hours) by a sweep that did not stop it: ended here, then reported
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    assert not running, running


def _cmdline(process: Path) -> bytes:
    try:
        return (process / "cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return b""
