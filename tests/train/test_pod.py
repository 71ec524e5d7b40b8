"""Runs that live on a pod: hosts that share nothing but a bucket, preemption, and faults of the store.

The bucket is a real GCS API server (`tests.gcs_server`, started by the suite), and for the tests that take
`store` also moto's S3 server (`tests.s3_server`), where checkpoints are staged on each host's disk and published.
Each "host" is a `train.py` process with a folder of its own as cwd, HOME, TMPDIR, data cache and compilation
cache: nothing one writes locally is visible to another, as on a pod's VMs. The corpus and the workdir are in the
bucket. What must hold: killed, preempted or resumed on another process count, the run logs exactly what one
uninterrupted process logs.
"""

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import train
from configs import deberta
from deberta_jax import storage
from deberta_jax.train import checkpoint, metrics_io, workdir_lock
from tests.helpers import REPO, overrides, run_with_store_paused, write_brown_slices

pytestmark = [pytest.mark.slow, pytest.mark.long]

STEPS = 40
# Float reduction order differs between 1 and 2 processes; everything else must not.
ATOL = 1e-5


def fields(data: str, cache_dir) -> dict:
    """The micro preset (dropout on) with its own 400-token tokenizer, every step logged, a checkpoint every 2."""
    return {"data.train_files": f"{data}/train.txt", "data.eval_files": f"{data}/valid.txt", "model.vocab_size": 400,
            "data.cache_dir": str(cache_dir), "train.num_steps": STEPS, "train.warmup_steps": 2,
            "train.log_every": 1, "train.eval_every": 20, "train.checkpoint_every": 4}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_brown_slices(tmp_path_factory.mktemp("corpus"), 150_000, 20_000, vocab_size=400)


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory):
    """The run uninterrupted, in this one process, on a local disk."""
    root = tmp_path_factory.mktemp("reference")
    config = deberta.get_config("micro")
    config.update_from_flattened_dict(fields(str(corpus), root / "cache"))
    train.train_and_evaluate(config, root / "run")
    return logged(root / "run")


def upload_corpus(corpus, bucket: str) -> str:
    """The corpus copied into `bucket`; returns its folder there."""
    for name in ("train.txt", "valid.txt"):
        storage.write_bytes(f"{bucket}/corpus/{name}", (corpus / name).read_bytes())
    return f"{bucket}/corpus"


@pytest.fixture
def data(corpus, bucket):
    """The corpus uploaded to the test's GCS bucket."""
    return upload_corpus(corpus, bucket)


def logged(workdir) -> dict[int, dict]:
    """Every logged value but the wall-clock rate, by step; each step logged once."""
    records = metrics_io.read_metrics(workdir)
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: {k: v for k, v in r.items() if k != "tokens_per_s"} for r in records}


def assert_same_run(workdir, reference):
    got = logged(workdir)
    assert sorted(got) == list(range(1, STEPS + 1))
    for step, values in reference.items():
        assert got[step].keys() == values.keys()
        for name, value in values.items():
            np.testing.assert_allclose(got[step][name], value, atol=ATOL, err_msg=f"step {step} {name}")


class Hosts:
    """`train.py` processes, each in a folder of its own, joined by `jax.distributed` when there are several."""

    def __init__(self, root, data: str, workdir: str, count: int, extra: list[str] = ()):
        """Several hosts also get a compilation cache each; one shares the suite's (its compiles are the same)."""
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
        if count > 1:
            from tests.gcs_server import free_port
            env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES=str(count))
        self.processes, self.logs = [], []
        for i in range(count):
            home = root / f"host{i}"
            home.mkdir(parents=True, exist_ok=True)
            (home / "tmp").mkdir(exist_ok=True)
            host_env = dict(env, JAX_PROCESS_ID=str(i), HOME=str(home), TMPDIR=str(home / "tmp"))
            if count > 1:
                host_env["JAX_COMPILATION_CACHE_DIR"] = str(home / "jax-cache")
            args = [f"--config.{k}={v}" for k, v in fields(data, ".cache/packed").items()]  # cwd-relative: local
            log = home / f"train-{time.monotonic_ns()}.log"
            with open(log, "w") as f:
                self.processes.append(subprocess.Popen(
                    [sys.executable, str(REPO / "train.py"), "--config", f"{REPO}/configs/deberta.py:micro",
                     "--workdir", workdir, *args, *extra], cwd=home, stdout=f, stderr=f, env=host_env))
            self.logs.append(log)

    def wait(self, timeout=300) -> list[int]:
        try:
            return [p.wait(timeout=timeout) for p in self.processes]
        finally:
            self.kill()

    def kill(self):
        for p in self.processes:
            if p.poll() is None:
                p.kill()
                p.wait()

    def texts(self) -> list[str]:
        return [log.read_text() for log in self.logs]

    def failure(self) -> str:
        return "\n\n".join(text[-3000:] for text in self.texts())


def last_logged_step(workdir: str) -> int:
    try:
        return max((r["step"] for r in metrics_io.read_metrics(workdir)), default=0)
    except (OSError, ValueError):  # not written yet, or being replaced
        return 0


def last_step_in_log(text: str) -> int:
    """The newest step a host has logged to its own log: immediate, where the metrics file in the bucket is
    replaced only now and then, so a run waited on through the bucket may already have finished."""
    return max((int(m) for m in re.findall(r"\] step (\d+): ", text)), default=0)


def wait_until(condition, hosts: Hosts, timeout=240):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, hosts.failure()
        assert all(p.poll() is None for p in hosts.processes), "a host ended early:\n" + hosts.failure()
        time.sleep(0.1)


def committed(workdir: str, step: int) -> bool:
    return storage.path(f"{workdir}/{checkpoint.CHECKPOINT_DIR}/{step}/commit_success.txt").exists()


def resumed_step(text: str) -> int | None:
    marker = "resuming from the checkpoint at step "
    return int(text.split(marker)[1].split()[0]) if marker in text else None


def committed_steps(workdir: str) -> list[int]:
    manager = checkpoint.checkpoint_manager(workdir, read_only=True)
    try:
        return sorted(manager.all_steps())
    finally:
        manager.close()


def test_hosts_sharing_only_a_bucket_survive_sigkill_preemption_and_a_change_of_process_count(
        corpus, store, reference, tmp_path):
    """Two hosts: one SIGKILLed mid-run (the other, left waiting at its next collective, is killed too, as a pod's
    restart does); both restarted, then preempted by SIGTERM to one of them, which makes both save the same step
    and exit 143; the last steps on one host from the checkpoint two wrote. In s3:// each host stages its shards on
    its own disk, and the step in the bucket must still hold both hosts' halves: one host alone resumes from it."""
    bucket = store[1]
    data, workdir = upload_corpus(corpus, bucket), f"{bucket}/run"
    fsdp = ["--config.mesh.fsdp=2"]  # parameters split between the hosts: each writes shards the other lacks
    hosts = Hosts(tmp_path, data, workdir, 2, fsdp)
    wait_until(lambda: committed(workdir, 4), hosts)
    hosts.processes[1].send_signal(signal.SIGKILL)
    hosts.processes[1].wait()
    hosts.kill()
    texts = hosts.texts()
    assert "training a 400-token tokenizer" in texts[0] and "training a" not in texts[1]
    killed_at = last_logged_step(workdir)
    assert killed_at < STEPS, "the run ended before a host was killed"

    hosts = Hosts(tmp_path, data, workdir, 2, fsdp)
    wait_until(lambda: resumed_step(hosts.texts()[0]) is not None, hosts)
    resumed = resumed_step(hosts.texts()[0])
    assert 4 <= resumed <= killed_at
    wait_until(lambda: last_step_in_log(hosts.texts()[0]) > resumed, hosts)
    hosts.processes[1].send_signal(signal.SIGTERM)
    codes, texts = hosts.wait(), hosts.texts()
    assert codes == [143] * 2, hosts.failure()  # 128 + SIGTERM, what schedulers read as a termination
    saved = {int(text.split("saved the checkpoint at step ")[1].split()[0]) for text in texts}
    assert len(saved) == 1, texts  # both processes stopped at the same step
    (step,) = saved
    assert step < STEPS and max(committed_steps(workdir)) == step
    assert not storage.path(f"{workdir}/{workdir_lock.LOCK_FILE}").exists()  # released on the way out

    one = Hosts(tmp_path, data, workdir, 1)
    assert one.wait() == [0], one.failure()
    assert f"resuming from the checkpoint at step {step}" in one.texts()[0]
    assert_same_run(workdir, reference)


def preempt_then_finish(host: Hosts, root, data: str, workdir: str, resumed_from: int, reference):
    """SIGTERM to a running host resumed from `resumed_from`: it saves the step it is at, exits 143 with one line;
    the rerun resumes from that step and the run then logs what the uninterrupted `reference` logs."""
    host.processes[0].send_signal(signal.SIGTERM)
    assert host.wait() == [143], host.failure()
    lines = [line for line in host.texts()[0].splitlines() if line.startswith("train.py:")]
    assert len(lines) == 1 and "preempted (SIGTERM): saved the checkpoint at step" in lines[0], lines
    step = int(lines[0].split("at step ")[1].split()[0])
    assert resumed_from < step < STEPS and max(committed_steps(workdir)) == step

    rerun = Hosts(root, data, workdir, 1)
    assert rerun.wait() == [0], rerun.failure()
    assert resumed_step(rerun.texts()[0]) == step
    assert_same_run(workdir, reference)


def test_one_host_waits_out_an_outage_loses_only_a_torn_save_and_stops_at_a_checkpoint_on_sigterm(
        data, bucket, reference, gcs, tmp_path):
    """One run through the faults a single host meets, then the rerun that must equal the uninterrupted run:
    1. the store stops answering for 4 s (SIGSTOP: every request hangs): the run waits and goes on;
    2. the store is killed inside a save (the run saves at every step here), and the trainer with it (its VM goes
       away while its writes hang); the store comes back over the same objects: the torn step is not listed, and
       the rerun resumes from the newest committed one;
    3. SIGTERM: the run saves the step it is at and exits 143 with one line;
    4. the rerun finishes, logging what an uninterrupted run logs."""
    workdir = f"{bucket}/run"
    host = Hosts(tmp_path, data, workdir, 1, ["--config.train.checkpoint_every=1"])
    wait_until(lambda: last_logged_step(workdir) >= 3, host)
    gcs.pause()
    time.sleep(4)
    gcs.resume()

    def save_in_flight() -> int | None:
        """A step after the outage whose folder has objects but no commit marker yet."""
        steps = storage.path(f"{workdir}/{checkpoint.CHECKPOINT_DIR}")
        found = [int(p.name) for p in steps.iterdir() if p.name.isdigit()] if steps.exists() else []
        return next((step for step in sorted(found) if step > 5 and not committed(workdir, step)), None)

    wait_until(lambda: save_in_flight() is not None, host)
    gcs.kill()
    host.kill()
    gcs.start()
    torn, before = save_in_flight(), committed_steps(workdir)
    assert torn is not None and torn not in before and max(before) < torn, (torn, before)

    host = Hosts(tmp_path, data, workdir, 1)
    wait_until(lambda: resumed_step(host.texts()[0]) is not None, host)
    assert resumed_step(host.texts()[0]) == max(before)
    wait_until(lambda: last_step_in_log(host.texts()[0]) > max(before), host)
    preempt_then_finish(host, tmp_path, data, workdir, max(before), reference)


def test_an_s3_workdir_loses_only_a_torn_save_keeps_its_lock_stops_on_sigterm_and_resumes_exactly(
        corpus, s3, s3_bucket, reference, tmp_path):
    """A workdir in s3://, whose checkpoints orbax saves on a local stage and the run publishes (every file, then the
    commit marker), through the faults a single host meets:
    1. the store stops answering (SIGSTOP) while a step is being published, and the trainer dies with it: the store
       comes back holding part of that step, which is never listed, and the rerun resumes from the newest committed
       step and deletes the torn one;
    2. a second launch on the same workdir while the rerun holds the lock is refused in one line;
    3. SIGTERM: the rerun saves the step it is at and exits 143 with one line;
    4. the next rerun finishes, logging what an uninterrupted run on a local disk logs."""
    data, workdir = upload_corpus(corpus, s3_bucket), f"{s3_bucket}/run"
    host = Hosts(tmp_path, data, workdir, 1, ["--config.train.checkpoint_every=1"])

    def publishing() -> int | None:
        """A step past 3 whose folder has objects but no commit marker yet."""
        steps = storage.path(f"{workdir}/{checkpoint.CHECKPOINT_DIR}")
        found = [int(p.name) for p in steps.iterdir() if p.name.isdigit()] if steps.exists() else []
        return next((step for step in sorted(found) if step > 3 and not committed(workdir, step)), None)

    wait_until(lambda: publishing() is not None, host)
    s3.pause()
    time.sleep(0.5)
    host.kill()
    s3.resume()
    torn, before = publishing(), committed_steps(workdir)
    assert torn is not None and torn not in before and max(before) < torn, (torn, before)

    host = Hosts(tmp_path, data, workdir, 1)
    wait_until(lambda: last_step_in_log(host.texts()[0]) > max(before), host)
    assert resumed_step(host.texts()[0]) == max(before)
    assert not storage.path(f"{workdir}/{checkpoint.CHECKPOINT_DIR}/{torn}").exists()
    second = Hosts(tmp_path / "second", data, workdir, 1)
    assert second.wait() == [1], second.failure()
    refusal = [line for line in second.texts()[0].splitlines() if line.startswith("train.py:")]
    assert len(refusal) == 1 and refusal[0].startswith(f"train.py: {workdir} is in use by PID "), refusal
    preempt_then_finish(host, tmp_path, data, workdir, max(before), reference)


def test_a_missing_bucket_is_one_line_before_anything_is_compiled(tmp_path, gcs):
    result = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", "gs://no-such-bucket/run",
         "--config.data.train_files=synthetic:markov:train", f"--config.data.cache_dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "model:" not in result.stderr, result.stderr[-2000:]
    assert "gs://no-such-bucket: no such bucket" in result.stderr.splitlines()[-2], result.stderr[-2000:]


def test_an_altered_object_in_the_bucket_is_named_by_the_digest_check(corpus, store, tmp_path):
    """In s3:// the check reads the downloaded copy of the step, in gs:// the listing's MD5s: either names the file."""
    bucket = store[1]
    data = upload_corpus(corpus, bucket)
    config = deberta.get_config("micro")
    config.update_from_flattened_dict(dict(fields(data, tmp_path / "cache"), **{"train.num_steps": 4}))
    workdir = f"{bucket}/run"
    train.train_and_evaluate(config, workdir)
    params = storage.path(f"{workdir}/{checkpoint.CHECKPOINT_DIR}/4/params")
    target = max(storage.fingerprints(params))  # a data file of the parameters
    raw = bytearray(storage.read_bytes(params / target))
    raw[len(raw) // 2] ^= 0xFF
    storage.write_bytes(params / target, bytes(raw))
    with pytest.raises(checkpoint.DamagedCheckpointError, match=rf"files changed since the save \['params/{target}'"):
        checkpoint.load_workdir(workdir, step=4)


def test_the_bucket_lock_refuses_a_second_run_and_is_taken_over_when_its_holder_is_gone(bucket, caplog):
    workdir = f"{bucket}/run"
    with workdir_lock.hold(workdir, what="the first run"):
        with pytest.raises(workdir_lock.WorkdirBusyError, match="in use by PID .* the first run"):
            with workdir_lock.hold(workdir):
                pass
    assert not storage.path(f"{workdir}/{workdir_lock.LOCK_FILE}").exists()
    # A holder on another host that stopped renewing: refused while fresh, taken over once silent long enough.
    other = dict(pid=1, host="another-vm", since=time.time(), what="train.py")
    assert storage.create_new(f"{workdir}/{workdir_lock.LOCK_FILE}", json.dumps(other).encode())
    with pytest.raises(workdir_lock.WorkdirBusyError, match="PID 1 on another-vm"):
        with workdir_lock.hold(workdir, stale_after_s=60):
            pass
    # Its PID means nothing here: one that runs no process on this machine is no sign the holder is gone.
    ended = subprocess.Popen(["true"])
    ended.wait()
    lock = f"{workdir}/{workdir_lock.LOCK_FILE}"
    assert storage.delete_version(lock, storage.read_version(lock).generation)
    assert storage.create_new(lock, json.dumps(dict(other, pid=ended.pid)).encode())
    with pytest.raises(workdir_lock.WorkdirBusyError, match=f"PID {ended.pid} on another-vm"):
        with workdir_lock.hold(workdir, stale_after_s=60):
            pass
    time.sleep(1.5)
    with workdir_lock.hold(workdir, stale_after_s=1):
        holder = json.loads(storage.read_text(f"{workdir}/{workdir_lock.LOCK_FILE}"))
        assert holder["pid"] == os.getpid()
    assert "another-vm" in caplog.text and "taking it over" in caplog.text
    # A holder whose lock another run took over (it stalled past the staleness limit) stops before its next save.
    with workdir_lock.hold(workdir, renew_every_s=0.2) as holding:
        current = storage.read_version(lock)
        assert storage.delete_version(lock, current.generation)
        assert storage.create_new(lock, json.dumps(other).encode())
        time.sleep(1)
        with pytest.raises(workdir_lock.WorkdirBusyError, match="was taken over by another run"):
            holding.check()
    assert json.loads(storage.read_text(lock))["host"] == "another-vm"  # the new holder's lock is left alone
    # A workdir trained locally and copied up brings its released (empty) lock file: nobody holds it.
    storage.write_text(f"{bucket}/uploaded/{workdir_lock.LOCK_FILE}", "")
    with workdir_lock.hold(f"{bucket}/uploaded", stale_after_s=60):
        assert json.loads(storage.read_text(f"{bucket}/uploaded/{workdir_lock.LOCK_FILE}"))["pid"] == os.getpid()


def test_a_bucket_lock_held_through_renewals_keeps_a_second_run_out_and_stays_its_own(bucket, caplog):
    """0.2 s renewals for 1.5 s, past a staleness limit of 1 s counted from the holder's start: staleness counts from
    the last renewal, so a second run is still refused; each renewal goes on from the generation the one before it
    stored (one that did not would be refused, which is logged), and the last one is the generation released."""
    workdir, lock = f"{bucket}/run", f"{bucket}/run/{workdir_lock.LOCK_FILE}"
    with caplog.at_level(logging.WARNING), workdir_lock.hold(workdir, renew_every_s=0.2, stale_after_s=1) as holding:
        generations, deadline = set(), time.monotonic() + 1.5
        while time.monotonic() < deadline:
            generations.add(storage.read_version(lock).generation)
            time.sleep(0.05)
        assert len(generations) >= 3, generations  # taken, then renewed at least twice
        with pytest.raises(workdir_lock.WorkdirBusyError, match=r"last renewed \d s ago"):
            with workdir_lock.hold(workdir, stale_after_s=1):
                pass
        holding.check()
    assert not storage.path(lock).exists()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_renewal_that_landed_late_is_recognised_as_the_runs_own(bucket, caplog):
    """A renewal the client gave up on while the store stalled may land afterwards and move the lock's generation,
    so that the next renewal is refused: the lock still holds this run's nonce (a renewal's copy, not the first
    write's: every renewal carries it), so the run keeps it."""
    workdir, lock = f"{bucket}/run", f"{bucket}/run/{workdir_lock.LOCK_FILE}"
    with workdir_lock.hold(workdir, renew_every_s=0.2, stale_after_s=5) as holding:
        first = storage.read_version(lock).generation
        while storage.read_version(lock).generation == first:  # renewed at least once
            time.sleep(0.05)
        while True:  # the late copy of a renewal, written between two of the holder's own
            current = storage.read_version(lock)
            if storage.replace_version(lock, current.data, current.generation):
                break
        time.sleep(1)
        holding.check()
        storage.write_text(f"{workdir}/metrics.jsonl", "")  # the fence lets the holder write
    assert "landed late" in caplog.text and "taken over" not in caplog.text
    assert not storage.path(lock).exists()


def test_a_holder_whose_renewals_stopped_renews_before_it_writes_and_is_refused_once_taken_over(bucket):
    """Renewals every 60 s against a staleness limit of 4 s: the lock looks dead long before its next renewal, as
    when its holder stalls, and another run takes it over. The holder's next write, 2.5 s on (past half the limit,
    short of all of it), renews the lock first, learns that, and is refused before anything is written."""
    workdir, lock = f"{bucket}/run", f"{bucket}/run/{workdir_lock.LOCK_FILE}"
    metrics = f"{workdir}/{metrics_io.METRICS_FILE}"
    with workdir_lock.hold(workdir, renew_every_s=60, stale_after_s=4):
        storage.write_text(metrics, "written while held\n")
        time.sleep(2.5)
        assert storage.delete_version(lock, storage.read_version(lock).generation)  # the other run's takeover
        assert storage.create_new(lock, json.dumps(dict(pid=1, host="another-vm", since=time.time())).encode())
        with pytest.raises(workdir_lock.WorkdirBusyError, match="it now names PID 1 on another-vm"):
            storage.write_text(metrics, "written after the takeover\n")
    assert storage.read_text(metrics) == "written while held\n"
    assert json.loads(storage.read_text(lock))["host"] == "another-vm"


@pytest.mark.parametrize("without, reason", [("preconditions", "this store ignores generation preconditions"),
                                             ("generations", "the store reported no generation for")])
def test_a_store_without_generation_preconditions_or_generations_is_refused_in_one_line(
        gcs, bucket, monkeypatch, tmp_path, without, reason):
    """A store that carries out writes conditional on a generation its object does not have would let two runs
    hold one lock; one that reports no generations cannot tell which version a run wrote. train.py on either is
    refused when it takes the lock, before anything is compiled, in one line naming the store and why, and leaves
    no lock behind; `read_version` on a store without generations says so."""
    from deberta_jax.storage import objects
    from tests.store_proxy import StoreProxy

    lock = f"{bucket}/run/{workdir_lock.LOCK_FILE}"
    with StoreProxy(gcs.url, without) as proxy:
        result = subprocess.run(
            [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", f"{bucket}/run",
             "--config.data.train_files=synthetic:markov:train", f"--config.data.cache_dir={tmp_path}"],
            cwd=REPO, capture_output=True, text=True, timeout=120,
            env=dict(os.environ, JAX_PLATFORMS="cpu", STORAGE_EMULATOR_HOST=proxy.url))
        if without == "generations":
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", proxy.url)
            monkeypatch.setattr(objects, "_CLIENT", None)
            storage.write_text(lock, "{}")
            with pytest.raises(storage.StorageError, match=reason):
                storage.read_version(lock)
            storage.path(lock).unlink()
            monkeypatch.undo()
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "model:" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.splitlines()[-2].startswith(f"train.py: {bucket}: {reason}"), result.stderr[-2000:]
    assert storage.read_version(lock) is None


# train.py with a lock renewed every 0.2 s and presumed dead after 2 s of silence.
QUICK_LOCK_TRAIN = ("import runpy, sys\nfrom deberta_jax.train import workdir_lock\n"
                    "workdir_lock.RENEW_EVERY_S, workdir_lock.STALE_AFTER_S = 0.2, 2.0\n"
                    "sys.argv = sys.argv[1:]\nrunpy.run_path(sys.argv[0], run_name='__main__')\n")


def test_a_run_whose_lock_was_taken_over_while_it_stalled_writes_nothing_more(store, cache, tmp_path, caplog):
    """train.py is stopped (SIGSTOP) for 3 s between two records, as a VM stalls; another run takes the workdir over
    and writes its metrics. Resumed, the first run writes nothing more (metrics, TensorBoard events, checkpoints)
    and stops with one line naming the run that holds the workdir now."""
    workdir = f"{store[1]}/run"
    fields = overrides(cache, num_steps=100_000, log_every=20, checkpoint_every=100_000)
    fields["data.eval_files"] = ""
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        trainer = subprocess.Popen(
            [sys.executable, "-c", QUICK_LOCK_TRAIN, "train.py", "--config", "configs/deberta.py:micro",
             "--workdir", workdir, *[f"--config.{k}={v}" for k, v in fields.items()]],
            cwd=REPO, stdout=f, stderr=f, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    try:
        deadline = time.monotonic() + 240
        while last_step_in_log(log.read_text()) < 20:  # logged once its record is written: no write in flight
            assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        trainer.send_signal(signal.SIGSTOP)
        time.sleep(3)
        with workdir_lock.hold(workdir, stale_after_s=2):
            storage.write_text(f"{workdir}/{metrics_io.METRICS_FILE}", "the new holder's\n")
            before = {name: storage.fingerprints(f"{workdir}/{name}") for name in ("tensorboard", "checkpoints")}
            trainer.send_signal(signal.SIGCONT)
            code = trainer.wait(timeout=120)
            assert storage.read_text(f"{workdir}/{metrics_io.METRICS_FILE}") == "the new holder's\n"
            assert {name: storage.fingerprints(f"{workdir}/{name}") for name in before} == before
    finally:
        trainer.kill()
        trainer.wait()
    text = log.read_text()
    assert "taking it over" in caplog.text
    lines = [line for line in text.splitlines() if line.startswith("train.py:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert f"was taken over by another run (it now names PID {os.getpid()} " in lines[0], lines


def test_a_store_that_stops_answering_ends_the_run_in_one_line_and_the_same_command_resumes(store, cache, tmp_path):
    """The store stops answering (SIGSTOP: connections are accepted, nothing comes back) while train.py saves a
    checkpoint at every step. With a 3 s deadline on every call to the store, the run ends within seconds with one
    line naming the call that did not finish, the store, and that the same command resumes, which it then does."""
    server, bucket = store
    workdir = f"{bucket}/run"
    fields = overrides(cache, num_steps=12, log_every=1000, checkpoint_every=1)
    fields["data.eval_files"] = ""
    command = [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", workdir,
               "--storage_deadline_s=3", *[f"--config.{k}={v}" for k, v in fields.items()]]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    log = tmp_path / "train.log"
    with open(log, "w") as f:
        trainer = subprocess.Popen(command, cwd=REPO, stdout=f, stderr=f, env=env)
    try:
        deadline = time.monotonic() + 240
        while not committed(workdir, 2):
            assert trainer.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        server.pause()
        paused = time.monotonic()
        code = trainer.wait(timeout=60)
        stopped_after = time.monotonic() - paused
    finally:
        server.resume()
        trainer.kill()
        trainer.wait()
    text = log.read_text()
    lines = [line for line in text.splitlines() if line.startswith("train.py:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in text, text[-3000:]
    assert re.fullmatch(rf"train\.py: \w.* \w+://\S+ did not finish within 3 s: {bucket} is not answering\. Stopped; "
                        r".* rerun the same command to resume; --storage_deadline_s sets the limit", lines[0]), lines
    assert stopped_after < 10, stopped_after
    rerun = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert resumed_step(rerun.stderr) >= 2 and max(committed_steps(workdir)) == 12


RESTORER = """
import sys
import jax.numpy as jnp
from deberta_jax.storage import deadlines
from deberta_jax.train import checkpoint, steps

manager = checkpoint.checkpoint_manager(sys.argv[1], read_only=True)
target = steps.TrainState(step=jnp.zeros((), jnp.int32), params={"w": jnp.zeros(3)}, opt_state={"m": jnp.zeros(3)})
deadlines.set_limit(2, "restorer", "")
print("ready", flush=True)
sys.stdin.readline()
checkpoint.restore(manager, 1, target)
print("restored", flush=True)
"""


def test_a_restore_from_a_store_that_stops_answering_ends_in_one_line(store, tmp_path):
    """A checkpoint is restored under the storage deadline, its digest check included: the store paused (SIGSTOP)
    just before, the restoring process ends within seconds with the line naming the restore, not the hang."""
    import jax.numpy as jnp

    from deberta_jax.train import steps
    server, bucket = store
    workdir = f"{bucket}/run"
    state = steps.TrainState(step=jnp.asarray(1), params={"w": jnp.ones(3)}, opt_state={"m": jnp.zeros(3)})
    manager = checkpoint.checkpoint_manager(workdir)
    checkpoint.save(manager, state)
    manager.close()
    script = tmp_path / "restorer.py"
    script.write_text(RESTORER)
    restorer = subprocess.Popen([sys.executable, str(script), workdir], cwd=REPO, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO)))
    out, err, ended_after = run_with_store_paused(restorer, server, "ready")
    assert restorer.returncode == 1 and "restored" not in out, err[-3000:]
    assert re.search(rf"restorer: restore the checkpoint {workdir}/checkpoints/1 did not finish within 2 s: {bucket} "
                     "is not answering", err), err[-3000:]
    assert ended_after < 15, ended_after
