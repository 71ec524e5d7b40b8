"""One run per workdir: an exclusive lock held while a run (or a sweep) writes there.

Two `train.py` processes on one workdir would interleave their checkpoints and metrics and leave a
config.json that matches neither. The lock is `fcntl.flock` on `<workdir>/.lock`: the kernel drops it
when the holding process exits however it exits (SIGKILL included), so a crashed run never blocks the
next one. The file also records the holder (PID, host, start time) so a refused run can say who holds
the workdir; the holder clears it on a clean exit, so finding it filled while the lock is free means
the previous holder died, which is reported with its PID before the lock is taken over.

flock is per host: on a filesystem shared between machines (NFS) it does not exclude a process on
another machine. Multi-process runs take the lock in process 0 only (all processes are one run).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from absl import logging

LOCK_FILE = ".lock"


class WorkdirBusyError(RuntimeError):
    """Another live process holds the workdir's lock."""


def _holder(fd: int) -> dict | None:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 4096).decode("utf-8", "replace").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"pid": "?", "raw": text[:200]}


def _describe(holder: dict | None) -> str:
    if not holder:
        return "an unknown process"
    since = holder.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
    return f"PID {holder.get('pid')} on {holder.get('host', '?')} (since {when}, {holder.get('what', '?')})"


@contextlib.contextmanager
def hold(workdir: str | Path, what: str = "train.py") -> Iterator[None]:
    """Holds `workdir`'s lock for the `with` block; raises WorkdirBusyError naming the holder if taken."""
    workdir = Path(workdir)
    path = workdir / LOCK_FILE
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as err:
        raise OSError(f"cannot create the workdir lock {path} ({err.strerror}): is {workdir} a writable "
                      "directory? Pass a --workdir you can write to.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise WorkdirBusyError(
            f"{workdir} is in use by {_describe(holder)}: two runs in one workdir would interleave their "
            "checkpoints and metrics. Wait for it to finish (or stop it), or pass another --workdir.") from None
    try:
        stale = _holder(fd)
        if stale:
            logging.warning("%s: the previous run, %s, ended without releasing its lock (killed or crashed); "
                            "taking it over", path, _describe(stale))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        holder = dict(pid=os.getpid(), host=socket.gethostname(), since=time.time(), what=what)
        os.write(fd, json.dumps(holder).encode())
        os.fsync(fd)
        yield
    finally:
        os.ftruncate(fd, 0)  # a clean exit leaves an empty file: nothing stale to report next time
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
