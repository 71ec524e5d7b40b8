"""Reliability: the workdir lock, checkpoints that prove themselves (digests, finite values, fallback to the
newest intact one) and resume after SIGKILL at any moment. Clear errors for bad input: tests/test_user_errors.py.

Training runs here are `micro` DeBERTa runs on small synthetic data (no files), a few seconds each.
"""

import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

import train
from deberta_jax.train import checkpoint, config_checks, metrics_io, workdir_lock
from tests.helpers import MICRO_STEPS, REPO, micro_config, overrides

STEPS = MICRO_STEPS


def params_of(workdir, step=None):
    return nnx.to_pure_dict(nnx.state(checkpoint.load_workdir(workdir, step)[1]))


def logged(workdir):
    """Every logged value but the wall-clock rate, by step."""
    return {r["step"]: {k: v for k, v in r.items() if k != "tokens_per_s"} for r in metrics_io.read_metrics(workdir)}


@pytest.fixture(scope="module")
def straight_run(cache, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    train.train_and_evaluate(micro_config(cache), workdir)
    return workdir


def step_dir(workdir, step):
    return workdir / checkpoint.CHECKPOINT_DIR / str(step)


def largest_file(directory):
    return max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


# ---------------------------------------------------------------------------------------------- the lock
HOLDER = ("import sys, time\nfrom deberta_jax.train import workdir_lock\n"
          "with workdir_lock.hold(sys.argv[1], what='test holder'):\n"
          "    print('held', flush=True)\n    time.sleep(120)\n")


def test_a_held_workdir_is_refused_naming_the_holder_and_freed_when_it_is_killed(tmp_path, caplog):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(workdir_lock.WorkdirBusyError,
                           match=rf"in use by PID {holder.pid} .*test holder.*another --workdir"):
            with workdir_lock.hold(tmp_path):
                pass
    finally:
        holder.kill()
        holder.wait()
    # SIGKILL released the lock; its record stays behind and is reported as stale, with the dead PID.
    with caplog.at_level(logging.WARNING), workdir_lock.hold(tmp_path):
        assert json.loads((tmp_path / workdir_lock.LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"PID {holder.pid}" in caplog.text and "without releasing its lock" in caplog.text
    assert (tmp_path / workdir_lock.LOCK_FILE).read_text() == ""  # a clean exit leaves nothing stale


@pytest.mark.slow
def test_a_second_training_run_on_a_busy_workdir_is_refused_before_it_writes(cache, tmp_path):
    with workdir_lock.hold(tmp_path, what="the first run"):
        with pytest.raises(workdir_lock.WorkdirBusyError, match="the first run"):
            train.train_and_evaluate(micro_config(cache), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [workdir_lock.LOCK_FILE]


# ------------------------------------------------------------------------------ checkpoints prove themselves
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flipped_bit", "truncated_file", "deleted_manifest", "nan_values"])
def test_a_damaged_latest_checkpoint_is_set_aside_and_the_run_resumes_from_the_one_before(
        damage, cache, straight_run, tmp_path, caplog):
    """Resume from the newest intact checkpoint, retrain the lost steps: the result equals the straight run."""
    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    target = step_dir(run, STEPS)
    if damage == "flipped_bit":
        data = largest_file(target / "params")
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    elif damage == "truncated_file":
        data = largest_file(target / "opt_state")
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        (target / checkpoint.DIGEST_FILE).unlink()  # no digest: the read itself must fail and be caught
    elif damage == "deleted_manifest":
        next(p for p in (target / "params").rglob("manifest.ocdbt")).unlink()
    else:  # values that were NaN when saved: digests match, so only the finite check can catch them
        state = jax.jit(train_state_fn(run))()
        nan = jax.tree.map(lambda x: x * np.nan, state.params)
        shutil.rmtree(target)
        manager = checkpoint.checkpoint_manager(run, keep=5)
        checkpoint.save(manager, state.replace(step=np.int32(STEPS), params=nan))
        manager.close()
    with caplog.at_level(logging.WARNING):
        train.train_and_evaluate(micro_config(cache), run)
    assert f"checkpoint {STEPS} in" in caplog.text and "is damaged" in caplog.text
    assert f"resumed from step {STEPS - 2}" in caplog.text
    assert (run / checkpoint.DAMAGED_DIR / str(STEPS)).is_dir()  # kept for inspection
    jax.tree.map(np.testing.assert_array_equal, params_of(run), params_of(straight_run))
    assert logged(run) == logged(straight_run)


def train_state_fn(workdir):
    """The init function of the run in `workdir` (for abstract shapes)."""
    from deberta_jax.model.config import ModelConfig
    from deberta_jax.train import optim, steps

    config = checkpoint.read_config(workdir)
    model = ModelConfig.from_dict(config.model.to_dict())
    t = config.train
    schedule = optim.learning_rate_schedule(t.learning_rate, t.warmup_steps, t.num_steps, t.schedule)
    return steps.make_init_fn(model, optim.make_optimizer(t, schedule, model), config.seed)


@pytest.mark.slow
def test_every_checkpoint_damaged_is_an_error_not_a_silent_restart(cache, straight_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    for step in checkpoint.checkpoint_manager(run, read_only=True).all_steps():
        data = largest_file(step_dir(run, step) / "params")
        data.write_bytes(data.read_bytes()[::-1])
    with pytest.raises(checkpoint.DamagedCheckpointError, match="every checkpoint in .* was damaged"):
        train.train_and_evaluate(micro_config(cache), run)
    # The same command again: the damaged checkpoints are set aside, and still no silent restart from step 0.
    with pytest.raises(checkpoint.DamagedCheckpointError, match="has no intact checkpoint; .* move .* out of the"):
        train.train_and_evaluate(micro_config(cache), run)
    assert not any(checkpoint.checkpoint_manager(run, read_only=True).all_steps())
    shutil.move(run / checkpoint.DAMAGED_DIR, tmp_path / "set-aside")  # the user's word: start over
    train.train_and_evaluate(micro_config(cache), run)
    assert checkpoint.checkpoint_manager(run, read_only=True).latest_step() == micro_config(cache).train.num_steps


@pytest.mark.slow
def test_load_workdir_names_a_damaged_checkpoint_and_the_intact_ones(straight_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight_run, run)
    data = largest_file(step_dir(run, STEPS) / "params")
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 1  # a byte always changed (writing a zero was no change when the last byte was zero already)
    data.write_bytes(bytes(raw))
    with pytest.raises(checkpoint.DamagedCheckpointError, match=rf"checkpoint {STEPS} is damaged.*available: \[4, 6\]"):
        checkpoint.load_workdir(run)
    params_of(run, STEPS - 2)  # the others load


def test_a_checkpoints_content_fingerprint_follows_its_files_not_its_path(straight_run, tmp_path):
    """What keys cached evaluations: a moved copy is the same run, a changed parameter file is not."""
    moved = tmp_path / "moved"
    shutil.copytree(straight_run, moved)
    original = checkpoint.content_fingerprint(straight_run, STEPS)
    assert checkpoint.content_fingerprint(moved, STEPS) == original
    assert checkpoint.content_fingerprint(moved, STEPS - 2) != original
    data = largest_file(step_dir(moved, STEPS) / "params")
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    assert checkpoint.content_fingerprint(moved, STEPS) != original
    with pytest.raises(FileNotFoundError, match=f"no checkpoint for step {STEPS + 1}"):
        checkpoint.content_fingerprint(moved, STEPS + 1)


@pytest.mark.slow
def test_resuming_with_another_vocab_size_is_refused_and_older_workdirs_still_resume(cache, tmp_path):
    """config.model.vocab_size changes the tokenizer a run trains, which a resumed run does not retrain."""
    config = micro_config(cache, num_steps=4)
    config.data.train_files = config.data.eval_files = str(tmp_path / "text.txt")
    (tmp_path / "text.txt").write_text(
        "\n\n".join(f"document {i} says words and more words {i % 7}" for i in range(300)))
    config.model.vocab_size = 120
    train.train_and_evaluate(config, tmp_path / "run", stop_at_step=2)
    config.model.vocab_size = 150
    with pytest.raises(config_checks.ConfigError, match=r"tokenizer_trained_for_vocab_size 120 -> 150"):
        train.train_and_evaluate(config, tmp_path / "run")
    # A workdir written before layer_norm_placement (and the vocabulary record) existed resumes as it was.
    saved = json.loads((tmp_path / "run" / checkpoint.CONFIG_FILE).read_text())
    del saved["model"]["layer_norm_placement"], saved["data"][train.VOCAB_REQUEST]
    (tmp_path / "run" / checkpoint.CONFIG_FILE).write_text(json.dumps(saved))
    config.model.vocab_size = 120
    train.train_and_evaluate(config, tmp_path / "run")
    assert checkpoint.checkpoint_manager(tmp_path / "run", read_only=True).latest_step() == 4


# ---------------------------------------------------------------------------------- SIGKILL at any moment
KILLS = 8


@pytest.mark.slow
@pytest.mark.long
def test_sigkill_at_random_moments_never_stops_the_next_restart(straight_run, cache, tmp_path):
    """train.py killed (SIGKILL) 8 times at random moments, then run to the end: every logged value and the final
    parameters equal an uninterrupted run's.

    A kill lands either during start-up (a random delay of up to START_UP_S) or a random 0-0.3 s after the k-th
    change of metrics.jsonl since launch (k in 1..4: the start-up rewrite, then one line per step), so kills walk
    through start-up, steps, checkpoint saves and evaluations without waiting for whole runs."""
    def command(workdir):
        return [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", str(workdir),
                *[f"--config.{k}={v}" for k, v in overrides(cache).items()]]
    # JAX's persistent compilation cache, filled by a first uninterrupted run, makes each restart cost its
    # start-up, not a compilation.
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jit-cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    subprocess.run(command(tmp_path / "warm-up"), cwd=REPO, env=env, check=True, capture_output=True, timeout=300)
    metrics = tmp_path / "run" / metrics_io.METRICS_FILE
    rng = random.Random(0)
    kills = 0
    while kills < KILLS:
        process = subprocess.Popen(command(tmp_path / "run"), cwd=REPO, env=env,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if rng.random() < 0.3:
            deadline = time.monotonic() + rng.uniform(0.0, START_UP_S)
        else:
            deadline = _after_changes(metrics, rng.randint(1, 4), process) + rng.uniform(0.0, 0.3)
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait()
            kills += 1
            continue
        assert process.returncode == 0, f"a restart after {kills} kills failed (exit {process.returncode})"
        shutil.rmtree(tmp_path / "run")  # finished before the kill: start over and keep killing
    result = subprocess.run(command(tmp_path / "run"), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert logged(tmp_path / "run") == logged(straight_run)
    jax.tree.map(np.testing.assert_array_equal, params_of(tmp_path / "run"), params_of(straight_run))


START_UP_S = 3.0


def _after_changes(path, count: int, process) -> float:
    """The monotonic time at which `path` has changed `count` times since now (or `process` has exited)."""
    def stamp():
        try:
            info = path.stat()
            return info.st_mtime_ns, info.st_size, info.st_ino
        except FileNotFoundError:
            return None
    last, seen = stamp(), 0
    while seen < count and process.poll() is None:
        time.sleep(0.005)
        now = stamp()
        if now != last:
            last, seen = now, seen + 1
    return time.monotonic()


# ------------------------------------------------------------------------------------ preemption between records
@pytest.mark.slow
def test_a_run_stopped_and_preempted_between_records_logs_what_an_uninterrupted_run_logs(cache, tmp_path):
    """Records every 7 steps: train.py stopped at step 3 (--stop_at_step), resumed and preempted by SIGTERM a few
    steps later, then run to the end. No record is written at either stop, and the record at step 7 averages steps
    1-7 (the windows ride in the checkpoints), so every logged value equals the uninterrupted run's."""
    fields = overrides(cache, log_every=7)
    straight = tmp_path / "straight"
    train.train_and_evaluate(micro_config(cache, log_every=7), straight)
    command = [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", str(tmp_path / "run"),
               *[f"--config.{k}={v}" for k, v in fields.items()]]
    subprocess.run(command + ["--stop_at_step=3"], cwd=REPO, check=True, capture_output=True, timeout=300)
    assert sorted(logged(tmp_path / "run")) == []
    log = tmp_path / "resumed.log"
    with open(log, "w") as f:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=f)
    deadline = time.monotonic() + 240
    # The loop's first line comes once SIGTERM is handled, and the first step then takes a second or so (data,
    # compiled programs), so the signal lands well before step 7.
    while "training steps 4 to 8 of 8" not in log.read_text() and process.poll() is None:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=240) == 143, log.read_text()[-3000:]
    stopped = int(log.read_text().split("saved the checkpoint at step ")[1].split()[0])
    assert 3 < stopped < 7
    assert sorted(logged(straight)) == [4, 7, 8]  # the evaluation at step 4 is a record of its own
    assert logged(tmp_path / "run") == {step: values for step, values in logged(straight).items() if step <= stopped}
    subprocess.run(command, cwd=REPO, check=True, capture_output=True, timeout=300)
    assert logged(tmp_path / "run") == logged(straight)
