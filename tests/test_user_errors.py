"""Clear errors for bad input at every entry point (train.py, eval.py, the sweep, the data and model loaders): one
line naming the field, the file and the fix, no traceback, and nothing written before the refusal."""

import importlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from flax import nnx

import train
from configs import deberta
from deberta_jax.data import errors, packing, text
from deberta_jax.data import tokenizer as tokenizer_lib
from deberta_jax.study import length_study, report, scoring
from deberta_jax.train import checkpoint, config_checks, metrics_io, workdir_lock
from tests.helpers import MICRO_TRAIN, REPO, micro_config


@pytest.mark.slow
def test_ctrl_c_while_compiling_stops_cleanly(tmp_path):
    """SIGINT in a run's first seconds (tokenizer, XLA compiling): exit 130 with one line, never a crash of the
    interpreter's teardown; the same command then trains."""
    command = [sys.executable, "train.py", "--config", "configs/deberta.py:micro",
               "--config.data.train_files=synthetic:markov:train", "--config.data.eval_files=",
               "--config.train.num_steps=2"]
    log = tmp_path / "train.log"
    # After start-up's imports, whose length depends on the machine's load; each time a new run, never a finished one.
    for i, delay in enumerate((0.0, 0.5)):
        run = command + ["--workdir", str(tmp_path / f"run{i}")]
        with open(log, "w") as f:
            process = subprocess.Popen(run, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f, text=True)
        deadline = time.monotonic() + 120
        while "devices over" not in log.read_text() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
        stderr = log.read_text()
        assert "Fatal Python error" not in stderr and "Segmentation fault" not in stderr, stderr[-2000:]
        assert process.returncode in (0, 130), stderr[-2000:]  # 0: it finished before the signal
        assert process.returncode == 0 or stderr.rstrip().endswith("train.py: interrupted")
    assert subprocess.run(run, cwd=REPO, capture_output=True, timeout=300).returncode == 0


def test_a_log_off_a_terminal_holds_no_progress_bar_and_no_backend_note(tmp_path):
    """A run whose output goes to a file: no carriage-return bar updates in its log, and jax's INFO note that an
    installed backend (libtpu, off a TPU) could not start is dropped, while the run's own lines stay."""
    run = subprocess.run([sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir",
                          str(tmp_path / "run"), f"--config.data.train_files={MICRO_TRAIN}",
                          "--config.data.eval_files=", "--config.train.num_steps=3"],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "\r" not in run.stderr and not re.search(r"train: +\d+%", run.stderr)
    assert "devices over" in run.stderr
    import logging

    from deberta_jax.data import library_logs

    note = logging.LogRecord("jax._src.xla_bridge", logging.INFO, "/x/jax/_src/xla_bridge.py", 1,
                             "Unable to initialize backend 'tpu': no TPU", None, None)
    assert not library_logs.quiet_libraries(note)
    note.levelno = logging.WARNING
    assert library_logs.quiet_libraries(note)


def test_user_errors_are_one_line_and_their_traceback_is_one_variable_away(tmp_path):
    command = [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", str(tmp_path),
               "--config.model.num_heads=3"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-2] == (
        "train.py: config.model.num_heads=3 is invalid: must divide hidden_size=32; pick a divisor such as "
        "[1, 2, 4, 8, 16]")
    env = {**os.environ, errors.TRACEBACK_VARIABLE: "1"}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" in result.stderr and "ConfigError" in result.stderr


def test_a_literal_path_wins_over_a_glob_and_binary_text_is_named(tmp_path):
    (tmp_path / "train[1].txt").write_text("the literal file\n")
    (tmp_path / "train1.txt").write_text("what the glob would match\n")
    assert text.resolve_files(str(tmp_path / "train[1].txt")) == [tmp_path / "train[1].txt"]
    assert text.resolve_files(str(tmp_path / "train[0-9].txt")) == [tmp_path / "train1.txt"]
    (tmp_path / "zeros.txt").write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match=r"zeros.txt contains NUL bytes"):
        text.load_documents(str(tmp_path / "zeros.txt"))


def test_text_that_tokenizes_to_nothing_names_the_data_spec(tmp_path):
    tokenizer = tokenizer_lib.train_tokenizer(["some words to learn a vocabulary from"] * 20, 100)
    (tmp_path / "controls.txt").write_text("\x01\x02\x03\n")
    with pytest.raises(packing.NoTokensError, match=r"controls.txt.*contain no tokens"):
        packing.load_or_pack(str(tmp_path / "controls.txt"), tokenizer, 16, tmp_path / "cache")


def test_a_truncated_tokenizer_file_is_named(tmp_path):
    tokenizer = tokenizer_lib.train_tokenizer(["some words to learn a vocabulary from"] * 20, 100)
    tokenizer_lib.save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    (tmp_path / "cut.json").write_text((tmp_path / "tokenizer.json").read_text()[:200])
    with pytest.raises(ValueError, match=r"tokenizer file .*cut.json cannot be read"):
        tokenizer_lib.load_tokenizer(tmp_path / "cut.json")


def test_a_missing_tokenizer_names_a_function_that_exists(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"train one with ([\w.]+) ") as info:
        tokenizer_lib.load_tokenizer(tmp_path / "none.json")
    module, _, function = re.search(r"train one with ([\w.]+) ", str(info.value))[1].rpartition(".")
    assert callable(getattr(importlib.import_module(module), function))


def test_a_workdir_with_checkpoints_but_no_tokenizer_is_not_given_another(tmp_path):
    """Other training files given: training a tokenizer on them would give the checkpoints' ids other pieces."""
    (tmp_path / "train.txt").write_text("the quick brown fox jumps over the lazy dog\n")
    (tmp_path / "run" / checkpoint.CHECKPOINT_DIR / "10").mkdir(parents=True)
    config = deberta.get_config("micro")
    config.data.train_files = str(tmp_path / "train.txt")
    with pytest.raises(FileNotFoundError, match=r"run/tokenizer.json is missing, but .* holds checkpoints .*Restore "
                                                r"tokenizer.json from a copy"):
        train.prepare_tokenizer(config, tmp_path / "run")
    assert not (tmp_path / "run" / checkpoint.TOKENIZER_FILE).exists()


def test_a_workdir_without_config_but_with_checkpoints_is_described_truly(tmp_path):
    (tmp_path / checkpoint.CHECKPOINT_DIR / "10").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="is missing, but .* holds checkpoints"):
        checkpoint.read_config(tmp_path)


def test_one_document_gives_no_interval_rather_than_a_zero_width_one():
    resamples = scoring.document_resamples(1, 50)
    assert scoring.bootstrap_ratio_ci(np.array([6.0]), np.array([1.0]), resamples) == (None, None)
    resamples = scoring.document_resamples(3, 200)
    lo, hi = scoring.bootstrap_ratio_ci(np.array([6.0, 3.0, 9.0]), np.array([1.0, 1.0, 1.0]), resamples)
    assert lo < 6.0 < hi


def test_models_with_different_tokenizers_get_a_warning_in_the_summary(tmp_path):
    note = length_study.unpaired_note([("a", "tok1"), ("b", "tok1"), ("c", "tok2")])
    assert "2 different tokenizers" in note and "group 1: a, b; group 2: c" in note
    assert length_study.unpaired_note([("a", "tok1"), ("b", "tok1")]) is None
    record = dict(model="a", seed=0, source="a", policy="none", protocol="chunked", dataset="d", train_len=8,
                  eval_len=8, multiple=1.0, offset=None, bucket="all", metric="loss", value=1.0, ci_low=None,
                  ci_high=None, n_tokens=10)
    _, summary, _ = report.write_report([record], [], str(tmp_path), notes=[note])
    assert "**Warning.**" in summary and "group 2: c" in (tmp_path / "summary.md").read_text()


def test_dense_attention_that_cannot_fit_is_refused_before_scoring_with_the_fix():
    from deberta_jax.model.config import ModelConfig
    from deberta_jax.model.encoder import MaskedLM

    model = MaskedLM(ModelConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=4, intermediate_size=32),
                     rngs=nnx.Rngs(0))
    em = length_study.EvalModel("m", 0, "m", model, None, 64)
    settings = length_study.StudySettings(lengths=(65536,))
    with pytest.raises(MemoryError, match=r"needs about 128 GiB .*--attention_kernel blockwise"):
        length_study.check_dense_memory([em], settings, available=24 * 2**30)
    length_study.check_dense_memory([em], length_study.StudySettings(lengths=(4096,)), available=24 * 2**30)


def test_metrics_survive_a_torn_last_line_and_a_hung_tensorboard_close(tmp_path, monkeypatch):
    writer = metrics_io.MetricsWriter(tmp_path, resume_step=0)
    writer.write(1, {"loss": 2.0})
    monkeypatch.setattr(writer.tensorboard, "close", lambda: time.sleep(60))
    start = time.perf_counter()
    writer.close(timeout_s=0.5)
    assert time.perf_counter() - start < 5
    with (tmp_path / metrics_io.METRICS_FILE).open("a") as f:
        f.write('{"step": 2, "lo')  # killed mid-line
    assert metrics_io.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}]


def test_a_damaged_metrics_line_names_the_way_to_resume(tmp_path):
    """A damaged line before the last blocks resuming (what came after it cannot be trusted), but the refusal gives
    the command that deletes it, and after it the log reads and the writer resumes."""
    path = tmp_path / metrics_io.METRICS_FILE
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo\x00ss": \n{"step": 3, "loss": 1.5}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON") as refused:
        metrics_io.MetricsWriter(tmp_path, resume_step=3)
    command = re.search(r"\((sed -i '2d' \S+) deletes it\)", str(refused.value))[1]
    subprocess.run(command, shell=True, check=True)
    writer = metrics_io.MetricsWriter(tmp_path, resume_step=3)
    writer.close()
    assert metrics_io.read_metrics(tmp_path) == [{"step": 1, "loss": 2.0}, {"step": 3, "loss": 1.5}]


class _Payload:
    """Unpickling this runs `open(path, "w")`: a stand-in for malicious code in a pickled checkpoint."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_hf_load_never_unpickles(tmp_path):
    import pickle

    from deberta_jax.model import hf

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deberta-v2"}))
    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(_Payload(str(tmp_path / "pwned"))))
    with pytest.raises(FileNotFoundError, match="only safetensors checkpoints are read"):
        hf.load(tmp_path)
    assert not (tmp_path / "pwned").exists()


def test_an_unwritable_workdir_is_named(tmp_path):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError, match=r"cannot create the workdir lock .*a_file/run/.lock .*writable directory"):
        with workdir_lock.hold(tmp_path / "a_file" / "run"):
            pass


def test_evaluation_text_without_targets_is_refused_at_start_up(cache, tmp_path):
    """One token gets no masked target: the eval loss would be 0/0 (it used to be logged as 0.0, then "best")."""
    (tmp_path / "one_word.txt").write_text("a\n")
    config = micro_config(cache)
    config.data.eval_files = str(tmp_path / "one_word.txt")
    with pytest.raises(config_checks.ConfigError, match=r"one_word.txt.* yields no masked targets .*eval_files=''"):
        train.train_and_evaluate(config, tmp_path / "run")
    assert not (tmp_path / "run" / checkpoint.CHECKPOINT_DIR).exists()


def test_compressed_training_text_is_named_as_such(tmp_path):
    """Not as old Mac line endings or bad UTF-8, which is what a gzip file's bytes happen to look like."""
    import gzip

    path = tmp_path / "train.txt.gz"
    path.write_bytes(gzip.compress(("some words\r" * 50 + "\n").encode() * 20))
    with pytest.raises(ValueError, match=r"train.txt.gz is gzip-compressed, not text.*`gunzip -k "):
        list(text.read_lines(path))


def test_a_truncated_config_json_is_named_with_the_fix(tmp_path):
    (tmp_path / checkpoint.CONFIG_FILE).write_text('{"model": {"hidden_size": 3')
    with pytest.raises(ValueError, match=f"{tmp_path / checkpoint.CONFIG_FILE} is not valid JSON .*Restore"):
        checkpoint.read_config(tmp_path)


def test_a_missing_hf_checkpoint_folder_is_said_not_to_exist(tmp_path):
    from deberta_jax.model import hf

    with pytest.raises(FileNotFoundError, match="nowhere does not exist or is not a folder"):
        hf.load_tokenizer(tmp_path / "nowhere")


def test_curves_refuse_a_margin_that_is_not_positive(tmp_path):
    from deberta_jax.study import curves

    with pytest.raises(ValueError, match="--margin=-0.5: a run leaves the plateau only by going below"):
        curves.write_curves_report({"a": str(tmp_path)}, str(tmp_path / "out"), margin=-0.5)


def test_a_full_disk_during_a_save_is_one_line_naming_the_workdir(tmp_path):
    """tensorstore reports the failed write as a ValueError with the errno in its text (seen with a file-size
    limit in a real run); the save names the workdir and the fix instead."""
    class FullDisk:
        directory = tmp_path / checkpoint.CHECKPOINT_DIR

        def save(self, *args, **kwargs):
            raise ValueError("OUT_OF_RANGE: Error writing local file: Failed to write 4649 bytes to file 16: No space "
                             "left on device [os_error_code='28']")

    state = type("State", (), dict(step=3, params={}, opt_state={}))()
    with pytest.raises(OSError, match=f"^{tmp_path}: no room to save the checkpoint of step 3 .*rerun the same"):
        checkpoint.save(FullDisk(), state)


@pytest.mark.slow
def test_a_checkpoint_that_hits_a_file_size_limit_ends_train_py_in_one_line_without_tracebacks(tmp_path):
    """A real save cut short (a 32 KiB file-size limit: a full disk's error, cheaply), through train.py: the
    libraries' tracebacks from the abandoned writes (orbax's writer thread, tensorstore's late completions, asyncio's
    unretrieved futures: some 500 lines) are dropped; what remains is the run's log and one line."""
    # The limit is set by the shell that then becomes train.py: no Python code between fork and exec in this
    # (threaded) test process.
    result = subprocess.run(
        ["bash", "-c", 'ulimit -f 32 && exec "$@"', "bash", sys.executable, "train.py", "--config",
         "configs/deberta.py:micro", "--workdir", str(tmp_path / "run"), f"--config.data.train_files={MICRO_TRAIN}",
         "--config.data.eval_files=", "--config.train.num_steps=2", f"--config.data.cache_dir={tmp_path / 'cache'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax-cache")))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.splitlines()[-2].startswith(f"train.py: {tmp_path / 'run'}: no room to save the checkpoint")


def test_libtpu_held_by_another_process_is_not_answered_with_deleting_its_lock(monkeypatch):
    from jax.experimental import topologies

    from deberta_jax.aot import chips

    def refuse(**kwargs):
        raise RuntimeError('ABORTED: Internal error when accessing libtpu multi-process lockfile. Run "$ sudo rm '
                           '/tmp/libtpu_lockfile".')
    monkeypatch.setattr(topologies, "get_topology_desc", refuse)
    with pytest.raises(RuntimeError, match="another process has libtpu loaded") as err:
        chips.tpu_slice("v5e:2x2")
    assert "ALLOW_MULTIPLE_LIBTPU_LOAD=1" in str(err.value) and "rm " not in str(err.value)
