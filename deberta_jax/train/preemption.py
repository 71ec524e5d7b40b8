"""Preemption: SIGTERM to any process of a run makes every process save a checkpoint at the same step and stop.

A spot or preemptible TPU VM, and a Kubernetes or SLURM job being evicted, receives SIGTERM some seconds before it is
taken away. Stopping at once would lose every step since the last checkpoint; stopping each process at its own step
would leave a checkpoint that some processes never wrote. So the train loop asks `Watch.reached(step)` after every
step, and all processes get True at the same step:

  * several processes: jax's preemption sync point (`multihost_utils.reached_preemption_sync_point`). The
    coordination service that `jax.distributed.initialize` starts installs the SIGTERM handler; a notice on any
    process is propagated to all, which agree on the first step every one of them can still reach;
  * one process: a Python SIGTERM handler sets a flag, read after the step in flight.

The loop then saves that step's checkpoint and raises `Preempted`; the entry point exits with `EXIT_CODE` (128 +
SIGTERM, what a process killed by the signal reports, so schedulers treat it as a termination) and one line saying
so (`stop`). A rerun of the same command resumes from that checkpoint exactly. A sweep passes a SIGTERM on to the
train.py it runs and, once that has stopped, ends the same way.
"""

from __future__ import annotations

import signal
import sys
import threading
from typing import NoReturn

import jax

EXIT_CODE = 128 + signal.SIGTERM


class Preempted(Exception):
    """The run saved a checkpoint at `step` after a preemption notice and stopped; rerunning resumes it."""

    def __init__(self, step: int, where: str):
        super().__init__(f"preempted (SIGTERM): saved the checkpoint at step {step} in {where} and stopped; rerun "
                         "the same command to resume from it")
        self.step = step


def stop(program: str, notice: Exception) -> NoReturn:
    """How an entry point a preemption notice stopped ends: `program: notice` on one line, and `EXIT_CODE`."""
    sys.stderr.write(f"{program}: {notice}\n")
    sys.exit(EXIT_CODE)


class Watch:
    """Whether a preemption notice has reached every process, asked once per step. A single process's SIGTERM
    handler is installed from construction until `close` (which restores the previous one)."""

    def __init__(self):
        self.multiprocess = jax.process_count() > 1
        self.noticed = threading.Event()
        self.previous = None
        # Signal handlers can be set only from the main thread; elsewhere (a test calling the loop from a worker
        # thread) the run simply is not preemptible by signal.
        if not self.multiprocess and threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, lambda signum, frame: self.noticed.set())

    def close(self) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)
            self.previous = None

    def reached(self, step: int) -> bool:
        """True at the step every process saves at; False until a notice arrives (and at every earlier step)."""
        if self.multiprocess:
            from jax.experimental import multihost_utils
            return multihost_utils.reached_preemption_sync_point(step)
        return self.noticed.is_set()
