"""What a process of a multi-process run that dies (or hangs) costs the others: how long each takes to end after it,
with which status, and the last line it wrote (`deberta_jax/train/peers.py`).

Starts `--processes` `train.py` processes on this machine, joined by `jax.distributed` over the CPU (the micro preset
on synthetic data, a checkpoint every 4 steps), sends `--signal` to process `--victim` once the checkpoint of step 8 is
committed, and prints one JSON line per other process: `status` (its exit status; negative: the signal that ended it),
`seconds` from the signal to its end, and `last_line`.

    .venv/bin/python benchmarks/process_death.py --victim 1 --signal SIGKILL   # a death: status 75, one line
    .venv/bin/python benchmarks/process_death.py --victim 1 --signal SIGSTOP   # a hang: the same, on its silence
    .venv/bin/python benchmarks/process_death.py --victim 0 --signal SIGKILL   # process 0: jax's own ending
    .venv/bin/python benchmarks/process_death.py --processes 3 --victim 2 --signal SIGKILL
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--victim", type=int, default=1, help="the process that receives the signal")
    parser.add_argument("--signal", default="SIGKILL", help="SIGKILL (a death), SIGSTOP (a hang), SIGTERM, ...")
    return parser.parse_args()


def main():
    args = parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
               JAX_NUM_PROCESSES=str(args.processes))
    with tempfile.TemporaryDirectory() as root:
        workdir = Path(root) / "run"
        command = [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", str(workdir),
                   "--config.data.train_files=synthetic:markov:train:docs=40,doc_len=256", "--config.data.eval_files=",
                   f"--config.data.cache_dir={root}/cache", "--config.train.num_steps=400",
                   f"--config.train.batch_size={8 * args.processes}", "--config.train.checkpoint_every=4"]
        logs = [Path(root) / f"process-{i}.log" for i in range(args.processes)]
        processes = []
        for i, log in enumerate(logs):
            with open(log, "w") as f:
                processes.append(subprocess.Popen(command, cwd=REPO, stdout=f, stderr=f,
                                                  env=dict(env, JAX_PROCESS_ID=str(i))))
        try:
            while not (workdir / "checkpoints" / "8").is_dir():  # orbax renames a step's folder when it commits
                if any(p.poll() is not None for p in processes):
                    sys.exit("a process ended before the fault:\n" + "\n".join(log.read_text()[-2000:] for log in logs))
                time.sleep(0.1)
            processes[args.victim].send_signal(getattr(signal, args.signal))
            sent = time.monotonic()
            for i, process in enumerate(processes):
                if i == args.victim:
                    continue
                status = process.wait(timeout=600)
                lines = [line for line in logs[i].read_text().splitlines() if line.strip()]
                print(json.dumps({"process": i, "status": status, "seconds": round(time.monotonic() - sent, 1),
                                  "last_line": lines[-1]}), flush=True)
        finally:
            for process in processes:
                process.kill()
                process.wait()


if __name__ == "__main__":
    main()
