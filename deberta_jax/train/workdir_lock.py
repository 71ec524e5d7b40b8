"""One run per workdir: an exclusive lock held while a run (or a sweep) writes there.

Two `train.py` processes on one workdir would interleave their checkpoints and metrics and leave a
config.json that matches neither. The lock is `fcntl.flock` on `<workdir>/.lock`: the kernel drops it
when the holding process exits however it exits (SIGKILL included), so a crashed run never blocks the
next one. The file also records the holder (PID, host, start time) so a refused run can say who holds
the workdir; the holder clears it on a clean exit, so finding it filled while the lock is free means
the previous holder died, which is reported with its PID before the lock is taken over.

flock is per host: on a filesystem shared between machines (NFS) it does not exclude a process on
another machine. Multi-process runs take the lock in process 0 only (all processes are one run).

A workdir in object storage (`gs://`, `s3://`) has no file locks; its lock is an object created only if none exists
(a conditional write, so of two launches on any machines exactly one succeeds), holding the same record and a nonce
drawn for this hold; each version of it is told apart by GCS's generation or S3's ETag. The holder renews it every
`RENEW_EVERY_S` by replacing it only if it is still the version it wrote, and deletes it on exit. Nothing tells a
bucket that a process died, so a lock is taken over (with a warning naming the holder) when its last renewal is
`STALE_AFTER_S` old, or at once when the holder ran on this host and its PID no longer runs (a restart on the same
VM). An empty lock object holds nothing: it is a local workdir's released lock file, uploaded with the workdir.

A refused renewal is not yet a lost lock: a write the client gave up on (a stalled store) may land later and move
the generation. So the lock is read first; still holding this hold's nonce, it is this run's, and its generation
is adopted. A store that ignores generation preconditions would let two runs hold one lock: it is refused when the
lock is taken (`_require_preconditions`).

A run that lost its lock (it or its store stalled past `STALE_AFTER_S` and another run took over) writes nothing
more to the workdir: the lock fences it (`storage.fence`), so every write there first asks `Holding.check`, which
renews the lock before the write whenever its last renewal is old enough that a takeover was possible.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from absl import logging

from deberta_jax import storage
from deberta_jax.storage import atomic

LOCK_FILE = ".lock"
# An object lock's renewal period, and the age of its last renewal after which its holder is presumed dead: long
# enough that a slow request or a busy host never loses a live run its lock, short enough that a crashed pod restarts
# soon. Read when a lock is taken, so tests may set them.
RENEW_EVERY_S = 15.0
STALE_AFTER_S = 120.0


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


class Holding:
    """A held lock; `check` raises WorkdirBusyError once it was lost (only an object lock can be)."""

    def __init__(self):
        self.lost: str | None = None

    def check(self) -> None:
        if self.lost:
            raise WorkdirBusyError(self.lost)


def _record(what: str) -> dict:
    return dict(pid=os.getpid(), host=socket.gethostname(), since=time.time(), what=what, nonce=uuid.uuid4().hex)


@contextlib.contextmanager
def hold(workdir: str | Path, what: str = "train.py", *, renew_every_s: float | None = None,
         stale_after_s: float | None = None) -> Iterator[Holding]:
    """Holds `workdir`'s lock for the `with` block; raises WorkdirBusyError naming the holder if taken.
    `renew_every_s` and `stale_after_s` (default `RENEW_EVERY_S`, `STALE_AFTER_S`) apply to a workdir in object
    storage."""
    if storage.is_remote(workdir):
        with _object_lock(storage.path(workdir), what, RENEW_EVERY_S if renew_every_s is None else renew_every_s,
                          STALE_AFTER_S if stale_after_s is None else stale_after_s) as holding:
            yield holding
        return
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
        raise _busy(workdir, holder) from None
    try:
        stale = _holder(fd)
        if stale:
            logging.warning("%s: the previous run, %s, ended without releasing its lock (killed or crashed); "
                            "taking it over", path, _describe(stale))
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, json.dumps(_record(what)).encode())
        os.fsync(fd)
        yield Holding()
    finally:
        os.ftruncate(fd, 0)  # a clean exit leaves an empty file: nothing stale to report next time
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _busy(workdir, holder: dict | None, detail: str = "") -> WorkdirBusyError:
    return WorkdirBusyError(
        f"{workdir} is in use by {_describe(holder)}{detail}: two runs in one workdir would interleave their "
        "checkpoints and metrics. Wait for it to finish (or stop it), or pass another --workdir.")


def _parse(version: storage.Version) -> dict:
    try:
        return json.loads(version.data)
    except json.JSONDecodeError:
        return {"pid": "?", "raw": version.data[:200].decode("utf-8", "replace")}


def _dead_here(holder: dict) -> bool:
    """The holder ran on this host and its process is gone: it will never renew."""
    pid = holder.get("pid")
    return holder.get("host") == socket.gethostname() and isinstance(pid, int) and not atomic.running(pid)


def _acquire(lock, what: str, stale_after_s: float) -> tuple[dict, storage.VersionId, float]:
    """`(record, generation, sent)`: the lock taken, with the monotonic time its creation was sent."""
    record = _record(what)
    data = json.dumps(record).encode()
    for _ in range(3):  # the lock may vanish between a refused create and the read of its holder
        sent = time.monotonic()
        generation = storage.create_new(lock, data)
        current = None if generation is not None else storage.read_version(lock)
        if current is not None and _parse(current).get("nonce") == record["nonce"]:
            generation = current.generation  # this very create, retried by the client after the store applied it
        if generation is not None:
            _require_preconditions(lock, data, generation)
            return record, generation, sent
        if current is None:
            continue
        if not current.data.strip():  # a released local lock (an empty file), copied up with its workdir
            storage.delete_version(lock, current.generation)
            continue
        holder, silent_s = _parse(current), time.time() - current.updated
        dead = _dead_here(holder)
        if not (dead or silent_s > stale_after_s):
            raise _busy(lock.parent, holder, f", last renewed {silent_s:.0f} s ago")
        reason = "whose process no longer runs" if dead else f"silent for {silent_s:.0f} s"
        logging.warning("%s: the previous run, %s, %s, ended without releasing its lock (killed, crashed or its VM "
                        "was taken away); taking it over", lock, _describe(holder), reason)
        storage.delete_version(lock, current.generation)  # if another launch deleted it first, its create wins
    raise _busy(lock.parent, None, " (its lock changed hands while this run tried to take it)")


def _require_preconditions(lock, data: bytes, generation: storage.VersionId) -> None:
    """Refuses a store on which this lock would keep nobody out: one that carries out a write conditional on a
    generation the object does not have. Both kinds the lock uses are tried, each of which must be refused: creating
    the object just created, and replacing it on another generation."""
    elsewhere = storage.other_version(generation)
    if storage.create_new(lock, data) is None and storage.replace_version(lock, data, elsewhere) is None:
        return
    current = storage.read_version(lock)
    if current is not None:
        storage.delete_version(lock, current.generation)
    raise storage.StorageError(
        f"{storage.bucket(lock)}: this store ignores generation preconditions (it carried out a write of {lock} "
        "conditional on a generation the object did not have), so a lock there cannot keep a second run out of the "
        "workdir; keep the workdir on a local disk, or in a store that honours them (Google Cloud Storage and Amazon "
        "S3 do)")


class _ObjectHolding(Holding):
    """An object lock held: renewed by a thread every `renew_every_s`, and by `check` before a write whenever its last
    renewal is half of `stale_after_s` old (this process or the store stalled), so that a run another one took over
    learns it before it writes."""

    def __init__(self, lock, record: dict, generation: storage.VersionId, sent: float, renew_every_s: float,
                 stale_after_s: float):
        super().__init__()
        self.lock, self.record, self.generation = lock, record, generation
        self.renewed = sent  # monotonic time the last write of the lock that the store applied was sent
        self.renew_every_s, self.stale_after_s = renew_every_s, stale_after_s
        self.renewing = threading.Lock()  # the renewal thread's and a writer's

    def check(self) -> None:
        with storage.deadline(self.lock, "renew, before writing, the workdir lock"):
            while not self.lost and time.monotonic() - self.renewed > self.stale_after_s / 2:
                try:
                    self.renew()
                except storage.StorageError as err:  # the write would meet the same store: wait as it would
                    logging.warning("could not renew the workdir lock %s before writing: %s", self.lock, err)
                    time.sleep(self.renew_every_s)
        super().check()

    def renew(self) -> None:
        """Replaces the lock if it is still the version this run wrote last; a refusal reads it before concluding."""
        with self.renewing:
            if self.lost:
                return
            sent = time.monotonic()
            data = json.dumps(dict(self.record, renewed=time.time())).encode()
            renewed = storage.replace_version(self.lock, data, self.generation)
            if renewed is not None:
                self.generation, self.renewed = renewed, sent
                return
            current = storage.read_version(self.lock)
            holder = None if current is None else _parse(current)
            if holder is not None and holder.get("nonce") == self.record["nonce"]:
                logging.warning("%s: an earlier renewal of this run's lock landed late (the store was slow) and moved "
                                "its generation; still held", self.lock)
                self.generation = current.generation  # when that write landed is unknown: `renewed` stays
                return
            now = "it was deleted" if holder is None else f"it now names {_describe(holder)}"
            self.lost = (f"{self.lock} was taken over by another run ({now}) after this run went without renewing it "
                         "long enough to be presumed dead (this process or the store stalled); stopping without "
                         f"writing anything more to {self.lock.parent}, which is that run's now")
            logging.error("%s", self.lost)


@contextlib.contextmanager
def _object_lock(workdir, what: str, renew_every_s: float, stale_after_s: float) -> Iterator[Holding]:
    lock = workdir / LOCK_FILE
    holding = _ObjectHolding(lock, *_acquire(lock, what, stale_after_s), renew_every_s, stale_after_s)
    stop = threading.Event()

    def renew():
        while not stop.wait(renew_every_s) and not holding.lost:
            try:
                holding.renew()
            except storage.StorageError as err:  # the store is briefly unreachable: try again next period
                logging.warning("could not renew the workdir lock %s: %s", lock, err)

    renewer = threading.Thread(target=renew, name="workdir-lock-renewal", daemon=True)
    renewer.start()
    try:
        with storage.fence(workdir, holding.check):
            yield holding
    finally:
        stop.set()
        renewer.join()
        if not holding.lost:
            with contextlib.suppress(storage.StorageError):  # unreleased, it goes stale and is taken over
                storage.delete_version(lock, holding.generation)
