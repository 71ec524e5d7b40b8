"""Multi-process runs with real processes: two `train.py` / `eval.py` processes joined by `jax.distributed` on the
CPU (collectives over gloo), against the same run in one process.

What must hold across topologies: the same config gives the same run on 1 process or 2 (row order, masks and
dropout are functions of (seed, step, global row)); a checkpoint saved by 2 processes resumes on 1 and one
saved by 1 resumes on 2, with parameters replicated or split (FSDP); only process 0 writes metrics; both processes
use the tokenizer process 0 trained; both processes preparing one data cache at once leave one intact cache;
`eval.py` over 2 processes gives the single-process records. A process that dies or hangs ends the other within a
bounded time in one line (process 0's death: jax's own ending, see `peers`), and the same command resumes;
`--multiprocess` without a cluster to join is one line naming what to set.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from flax import nnx

import train
from configs import deberta
from deberta_jax.study import report
from deberta_jax.train import checkpoint, metrics_io, sharding
from tests.helpers import REPO, write_brown_slices

pytestmark = [pytest.mark.slow, pytest.mark.long]

STEPS = 8
# Float reduction order differs between 1 and 2 processes (and with FSDP); everything else must not.
ATOL = 1e-5


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_brown_slices(tmp_path_factory.mktemp("corpus"), 150_000, 20_000, vocab_size=400)


def overrides(corpus, cache_dir, **fields) -> dict:
    """The micro preset (dropout on) with 8 steps and evaluations at steps 4 and 8, training its own
    400-token tokenizer; `fields` are flattened keys."""
    values = {"data.train_files": str(corpus / "train.txt"), "data.eval_files": str(corpus / "valid.txt"),
              "model.vocab_size": 400, "data.cache_dir": str(cache_dir),
              "train.num_steps": STEPS, "train.warmup_steps": 2, "train.log_every": 1, "train.eval_every": 4,
              "train.checkpoint_every": 4}
    values.update(fields)
    return values


def micro_config(corpus, cache_dir, **fields):
    config = deberta.get_config("micro")
    config.update_from_flattened_dict(overrides(corpus, cache_dir, **fields))
    return config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(script: str, args: list[str], log_dir, num_processes: int = 2) -> tuple[list[subprocess.Popen], list]:
    """Starts `script` as `num_processes` processes of one `jax.distributed` job (a plain process for 1); returns
    them and their log files.

    Logs go to files, not pipes: a process blocked on a full pipe would stall the other at the next barrier.
    """
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))  # a script outside the checkout imports it too
    if num_processes > 1:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES=str(num_processes))
    launched = time.monotonic_ns()
    logs = [log_dir / f"{os.path.basename(script)}-{num_processes}-{i}-{launched}.log" for i in range(num_processes)]
    processes = []
    for i, log in enumerate(logs):
        with open(log, "w") as f:
            processes.append(subprocess.Popen([sys.executable, script, *args], cwd=REPO, stdout=f, stderr=f,
                                              env=dict(env, JAX_PROCESS_ID=str(i))))
    return processes, logs


def launch(script: str, args: list[str], log_dir, num_processes: int = 2) -> list[str]:
    """Runs `script` as `num_processes` processes (`start`) to their end; returns their logs."""
    processes, logs = start(script, args, log_dir, num_processes)
    try:
        codes = [p.wait(timeout=300) for p in processes]
    finally:
        for p in processes:
            p.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0] * num_processes, "\n\n".join(t[-3000:] for t in texts)
    return texts


def train_flags(corpus, workdir, cache_dir, **fields) -> list[str]:
    return (["--config", "configs/deberta.py:micro", "--workdir", str(workdir)]
            + [f"--config.{k}={v}" for k, v in overrides(corpus, cache_dir, **fields).items()])


def logged(workdir) -> dict[int, dict]:
    """Every logged value but the wall-clock rate, by step."""
    return {r["step"]: {k: v for k, v in r.items() if k != "tokens_per_s"} for r in metrics_io.read_metrics(workdir)}


def assert_same_run(workdir, reference):
    """Same steps logged once each, same metrics and final parameters to float-reduction tolerance."""
    lines = (workdir / metrics_io.METRICS_FILE).read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert steps == list(range(1, STEPS + 1)), steps  # a second writer would log every step twice
    got, want = logged(workdir), logged(reference)
    for step in want:
        assert got[step].keys() == want[step].keys()
        for name in want[step]:
            np.testing.assert_allclose(got[step][name], want[step][name], atol=ATOL, err_msg=f"step {step} {name}")
    params = lambda w: nnx.to_pure_dict(nnx.state(checkpoint.load_workdir(w)[1]))  # noqa: E731
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=ATOL), params(workdir), params(reference))


@pytest.fixture(scope="module")
def single_process_run(corpus, tmp_path_factory):
    """The reference: the whole run in this (single) process."""
    root = tmp_path_factory.mktemp("single")
    train.train_and_evaluate(micro_config(corpus, root / "cache"), root / "run")
    return root / "run"


def test_two_process_run_equals_one_and_resumes_on_one_process(corpus, single_process_run, tmp_path):
    """Steps 1-4 on two processes (data parallel, a fresh tokenizer and data cache), 5-8 resumed on one."""
    cache, workdir = tmp_path / "cache", tmp_path / "run"
    logs = launch("train.py", train_flags(corpus, workdir, cache) + ["--stop_at_step=4"],
                  tmp_path)
    assert "2 devices over 2 processes" in logs[0]
    assert "training a 400-token tokenizer" in logs[0] and "training a" not in logs[1]
    # Both processes prepared the train and eval caches at once: one entry each, no temporary leftovers.
    entries = sorted(p.name for p in cache.iterdir())
    assert len(entries) == 2 and not any("tmp" in name for name in entries), entries
    assert checkpoint.checkpoint_manager(workdir, read_only=True).latest_step() == 4
    train.train_and_evaluate(micro_config(corpus, cache), workdir)
    assert_same_run(workdir, single_process_run)


def test_checkpoints_move_between_one_process_and_two_with_fsdp(corpus, single_process_run, tmp_path):
    """Steps 1-4 on one process (parameters replicated), 5-6 on two with parameters split over them, 7-8 on
    one again."""
    cache, workdir = tmp_path / "cache", tmp_path / "run"
    train.train_and_evaluate(micro_config(corpus, cache), workdir, stop_at_step=4)
    logs = launch("train.py", train_flags(corpus, workdir, cache, **{"mesh.fsdp": 2}) + ["--stop_at_step=6"], tmp_path)
    assert all("resuming from the checkpoint at step 4" in log for log in logs)
    train.train_and_evaluate(micro_config(corpus, cache), workdir)
    assert_same_run(workdir, single_process_run)


def test_length_evaluation_on_two_processes_equals_one(corpus, single_process_run, tmp_path):
    """Small batches, so each process scores several of them; every record must match (to float64 rounding:
    the two processes' sums are added in another order)."""
    args = ["--workdir", str(single_process_run), "--data_files", str(corpus / "valid.txt"), "--multiples", "1,2",
            "--extra=", "--tokens_per_batch", "256", "--bootstrap", "100"]
    launch("eval.py", args + ["--out", str(tmp_path / "two")], tmp_path)
    launch("eval.py", args + ["--out", str(tmp_path / "one")], tmp_path, num_processes=1)
    one, two = (report.read_results_file(tmp_path / name)["records"] for name in ("one", "two"))
    assert len(one) == len(two) > 0
    for a, b in zip(one, two):
        assert {k: v for k, v in a.items() if k not in ("value", "ci_low", "ci_high")} == \
               {k: v for k, v in b.items() if k not in ("value", "ci_low", "ci_high")}
        for key in ("value", "ci_low", "ci_high"):
            assert (a[key] is None) == (b[key] is None)
            if a[key] is not None:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-12, atol=1e-12, err_msg=str(a))


def committed_steps(workdir) -> list[int]:
    """The steps checkpointed in a local workdir: orbax renames a step's folder into place when it commits."""
    root = workdir / checkpoint.CHECKPOINT_DIR
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.is_dir() else []


def wait_for(condition, processes, logs, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        texts = "\n\n".join(log.read_text()[-3000:] for log in logs)
        assert all(p.poll() is None for p in processes), "a process ended early:\n" + texts
        assert time.monotonic() < deadline, texts
        time.sleep(0.1)


def fault(signum, victim: int, processes, logs, workdir, after_step: int) -> tuple[int, float, str]:
    """Sends `signum` to process `victim` once a checkpoint past `after_step` is committed, while the run goes on;
    returns the other's exit status, the seconds from the signal to its end, and its log. The victim is then killed."""
    wait_for(lambda: any(step > after_step for step in committed_steps(workdir)), processes, logs)
    processes[victim].send_signal(signum)
    sent = time.monotonic()
    survivor = processes[1 - victim]
    try:
        status = survivor.wait(timeout=120)
    finally:
        elapsed = time.monotonic() - sent
        for p in processes:
            p.kill()
            p.wait()
    return status, elapsed, logs[1 - victim].read_text()


def resumed_step(text: str) -> int:
    return int(re.search(r"resuming from the checkpoint at step (\d+)", text)[1])


# The survivor's line when the other process stops responding.
STOPPED = re.compile(r"^train\.py: process 1 stopped responding at step (\d+), so this one stopped too; the last good "
                     r"checkpoint is step (\d+) in (\S+): rerun the same command on every host to resume from it$",
                     re.MULTILINE)


def test_a_process_that_dies_or_hangs_ends_the_other_in_one_line_and_the_same_command_resumes(corpus, tmp_path):
    """Two processes, each fault once a checkpoint is committed mid-run, then the same command again:
    1. process 1 stopped (SIGSTOP: hung, its connections open): process 0 ends on its silence, within
       `peers.PEER_TIMEOUT_S` and a beat or two, with one line and status 75;
    2. process 1 killed: the same way, usually within `peers.CONFIRM_S` and a beat or two (its next collective fails at
       once; `benchmarks/process_death.py` measures it), at worst on its silence as in 1: on a machine loaded with
       other processes the collective's error can come late (seen here: 19.7 s), so the bound asserted is the silence's;
    3. process 0 killed: jax's client ends process 1 within a second (SIGABRT, jax's own message: jax 0.10.2 lets no
       Python code replace it, see `peers`);
    after each, both processes rerun resume from the last committed checkpoint, the one the line names; the last rerun
    finishes, logging every step once."""
    cache, workdir = tmp_path / "cache", tmp_path / "run"
    steps = 48
    args = train_flags(corpus, workdir, cache, **{"train.num_steps": steps, "train.eval_every": steps})
    last_good = None
    for signum, victim, within_s in [(signal.SIGSTOP, 1, 30), (signal.SIGKILL, 1, 30), (signal.SIGKILL, 0, 5)]:
        processes, logs = start("train.py", args, tmp_path)
        status, elapsed, text = fault(signum, victim, processes, logs, workdir, after_step=last_good or 4)
        if last_good is not None:
            assert [resumed_step(log.read_text()) for log in logs] == [last_good] * 2
        last_good = max(committed_steps(workdir))
        if victim == 1:
            assert status == 75, text[-3000:]
            assert len(STOPPED.findall(text)) == 1, text[-3000:]
            at_step, named, where = STOPPED.search(text).groups()
            # Nothing is saved after the fault: the checkpoint the line names is the newest, committed before it.
            assert int(named) == last_good <= int(at_step) < steps, text[-3000:]
            assert where == str(workdir / checkpoint.CHECKPOINT_DIR)
            assert "Traceback" not in text and "Fatal Python error" not in text, text[-3000:]
        else:
            assert status == -signal.SIGABRT, text[-3000:]
            assert "Terminating process because the JAX distributed service detected fatal errors" in text
        assert elapsed < within_s, (elapsed, text[-3000:])

    texts = launch("train.py", args, tmp_path)
    assert resumed_step(texts[0]) == last_good
    assert not any("damaged" in text for text in texts)
    assert [r["step"] for r in metrics_io.read_metrics(workdir)] == list(range(1, steps + 1))
    assert max(committed_steps(workdir)) == steps


@pytest.mark.parametrize("environment, message", [
    ({}, "train.py: --multiprocess found no cluster to join: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
         "JAX_PROCESS_ID are not set and no Cloud TPU pod, SLURM (srun), Open MPI (mpirun) or Kubernetes indexed Job "
         "was detected; set JAX_COORDINATOR_ADDRESS=host:port (process 0's), JAX_NUM_PROCESSES and JAX_PROCESS_ID on "
         "every process"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_PROCESS_ID": "0"},
     "train.py: --multiprocess found no cluster to join: JAX_NUM_PROCESSES is not set"),
    ({"JAX_NUM_PROCESSES": "two"}, "train.py: JAX_NUM_PROCESSES='two' is not a whole number; set "
                                   "JAX_COORDINATOR_ADDRESS=host:port"),
], ids=["nothing set", "no process count", "not a number"])
def test_multiprocess_without_the_runs_processes_is_one_line(environment, message, tmp_path):
    env = {name: value for name, value in os.environ.items() if name not in sharding.LAUNCH_VARIABLES}
    result = subprocess.run([sys.executable, "train.py", "--multiprocess", "--config", "configs/deberta.py:micro",
                             "--workdir", str(tmp_path / "run")], cwd=REPO, capture_output=True, text=True,
                            env=dict(env, JAX_PLATFORMS="cpu", **environment), timeout=240)
    lines = [line for line in result.stderr.splitlines() if line.strip() and "shows where it was raised" not in line]
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith(message), result.stderr


PEER_THAT_ENDED = """
import sys, time
import jax
from deberta_jax import storage
from deberta_jax.train import peers, sharding

sharding.initialize_distributed(True)
workdir = storage.path(sys.argv[1])
if jax.process_index() == 1:
    with peers.Watch("peer", workdir):
        pass  # ends through Python at once: records ended/1, then its heartbeat stops
    print("ended", flush=True)
    time.sleep(peers.PEER_TIMEOUT_S + 8 * peers.BEAT_S)  # silent, and still in the job
else:
    with peers.Watch("peer", workdir):
        time.sleep(peers.PEER_TIMEOUT_S + 5 * peers.BEAT_S)  # watching it past the limit of silence
    print("survived", flush=True)
"""


def test_a_peer_that_recorded_its_end_and_went_silent_does_not_end_the_run(tmp_path):
    """Process 1 leaves its watch through Python (done, or stopped by an error of its own) and stays silent for
    longer than `peers.PEER_TIMEOUT_S`: that silence is no death, so process 0 keeps watching to its own end."""
    script = tmp_path / "peer.py"
    script.write_text(PEER_THAT_ENDED)
    texts = launch(str(script), [str(tmp_path / "run")], tmp_path)
    assert "ended" in texts[1] and "survived" in texts[0], texts
    assert "stopped responding" not in texts[0] and "Traceback" not in texts[0], texts[0][-3000:]
