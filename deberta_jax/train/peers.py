"""A process of a multi-process run that dies takes the others down within a bounded time, each with one line:
which process stopped responding, at which step, the last good checkpoint, and that the same command on every
host resumes. Left to jax, a survivor raises the collective's error with a traceback, waits in jax's shutdown
barrier until jax's heartbeat timeout (100 s by default) declares the dead process, and dies with `Fatal Python error:
Aborted`.

Every process of a run holds a `Watch`: a thread that counts a heartbeat in jax's key-value store (the
coordination service, in process 0) every `BEAT_S` and reads everyone's. A peer whose count has not moved for
`PEER_TIMEOUT_S` has stopped responding (killed, hung, or cut off); so has one whose count has not moved for
`CONFIRM_S` once this process saw an error, which is how a death usually shows first: its connections close, so
the next collective fails at once. The process that concludes first records whom in the store, so every survivor
names the same processes; each writes its line and ends with `EXIT_CODE` at once, skipping the interpreter's
teardown, where jax's shutdown barrier would wait for the dead. Process 0 ends last (its end takes the store down,
and jax ends a process that loses the store with its own message). Nothing is saved on the way out: a step whose
collective failed never reaches a save, and a save cut short is never committed, so the rerun resumes from the last
checkpoint committed before the death.

jax's own heartbeat (`sharding.JAX_HEARTBEAT_TIMEOUT_S`, passed to `jax.distributed.initialize`) is longer than
ours, so a dead peer is named by this line first. What jax 0.10.2 does not let this module word: the death of
process 0. Its coordination service dies with it, and jax's client in every other process ends that process (exit
status 134, SIGABRT) as soon as it sees the service gone, with `Terminating process because the JAX distributed
service detected fatal errors` and a stack dump; the hook that would replace that ending, the client's
`missed_heartbeat_callback`, cannot be given a Python function (jax passes it an absl::Status, which has no Python
type, so the call ends in std::bad_cast). It is bounded all the same: under a second when process 0's connections
close (the process died, its host is up), `sharding.JAX_HEARTBEAT_TIMEOUT_S` when its host vanishes silently.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax

from deberta_jax import storage
from deberta_jax.train import checkpoint, preemption

# sysexits' EX_TEMPFAIL: a temporary failure, which the same command retried gets past.
EXIT_CODE = 75
BEAT_S = 1.0
# A live process beats every BEAT_S from a thread of its own, whatever its main thread does (a compilation, a
# checkpoint save), so a count still for this long is a dead, stopped or cut-off process, not a busy one.
PEER_TIMEOUT_S = 20.0
# After an error of its own (a collective whose peer is gone), a process concludes on a shorter silence.
CONFIRM_S = 5.0
# How long the line may wait for storage to say whether a save under way had committed (`Watch._resume`).
COMMIT_CHECK_S = 5.0

_KEYS = "deberta_jax/peers/"


def _client():
    from jax._src import distributed  # the key-value store's client; orbax and multihost_utils use it the same way
    return distributed.global_state.client


class Watch:
    """Watches the other processes of a run in `workdir` from `__enter__` to `__exit__` (nothing in a single-process
    run).

    The train loop keeps `step` (the step in flight) current, and says which checkpoint it resumed from or saved
    (`saved`) and which save is under way (`saving`), for the line. An exception leaving the block gives the thread
    `CONFIRM_S` to find a process that stopped (a collective's error is how a death shows); the process then ends
    with the line instead of the exception."""

    def __init__(self, program: str, workdir: storage.AnyPath):
        self.program, self.workdir = program, workdir
        self.step: int | None = None
        self._saved: int | None = None
        self._saving: int | None = None
        self._failed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def saving(self, step: int) -> None:
        self._saving = step

    def saved(self, step: int) -> None:
        self._saved, self._saving = step, None

    def __enter__(self) -> Watch:
        if jax.process_count() > 1:
            self._thread = threading.Thread(target=self._watch, name="peers", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._thread is None:
            return
        if isinstance(exc, Exception) and not isinstance(exc, preemption.Preempted):
            self._failed.set()
            time.sleep(CONFIRM_S + 2 * BEAT_S)  # the thread ends the process meanwhile if a peer has stopped
        # Ended through Python (done, preempted, or an error of its own): its silence from now on is no death.
        self._stop.set()
        self._thread.join()
        try:
            _client().key_value_set(f"{_KEYS}ended/{jax.process_index()}", "1", allow_overwrite=True)
        except jax.errors.JaxRuntimeError:
            pass  # the store is gone with process 0, whose watch no longer reads it

    def _watch(self) -> None:
        client, me = _client(), jax.process_index()
        peers = [i for i in range(jax.process_count()) if i != me]
        counts: dict[int, str | None] = {}
        moved = dict.fromkeys(peers, time.monotonic())
        beat = 0
        while not self._stop.wait(BEAT_S):
            beat += 1
            try:
                client.key_value_set(f"{_KEYS}beat/{me}", str(beat), allow_overwrite=True)
                entries = dict(client.key_value_dir_get(_KEYS))
            except jax.errors.JaxRuntimeError:
                entries = None
            now = time.monotonic()
            if entries and f"{_KEYS}lost" in entries:  # another survivor concluded first: name the same
                self._end(client, me, [int(i) for i in entries[f"{_KEYS}lost"].split(",")], reachable=True)
            for peer in peers:
                if entries is None:
                    if peer != 0:  # nothing is known of the others without the store; process 0, its host, is silent
                        moved[peer] = now
                elif entries.get(f"{_KEYS}beat/{peer}") != counts.get(peer):
                    counts[peer], moved[peer] = entries.get(f"{_KEYS}beat/{peer}"), now
            limit = CONFIRM_S if self._failed.is_set() else PEER_TIMEOUT_S
            ended = entries or {}
            lost = [peer for peer in peers if now - moved[peer] > limit and f"{_KEYS}ended/{peer}" not in ended]
            if lost:
                self._end(client, me, lost, reachable=entries is not None)

    def _end(self, client, me: int, lost: list[int], reachable: bool) -> None:
        """Writes the line, lets the others know, and ends the process with `EXIT_CODE`."""
        at = "during start-up" if self.step is None else f"at step {self.step}"
        if me in lost:  # its own heartbeat stalled past the limit (its thread starved): the others have gone
            what = f"the other processes took this one ({me}) for stopped {at} and stopped"
        else:
            names = f"process {lost[0]}" if len(lost) == 1 else "processes " + ", ".join(map(str, lost))
            what = f"{names} stopped responding {at}, so this one stopped too"
        # On a line of its own: a progress bar may be drawn on the current one.
        sys.stderr.write(f"\n{self.program}: {what}; {self._resume()}\n")
        sys.stderr.flush()
        if reachable:
            try:
                client.key_value_set(f"{_KEYS}lost", ",".join(map(str, lost)), allow_overwrite=True)
                client.key_value_set(f"{_KEYS}ended/{me}", "1", allow_overwrite=True)
                if me == 0:  # the others learn whom from the store: keep it up until they have
                    survivors = [i for i in range(1, jax.process_count()) if i not in lost]
                    deadline = time.monotonic() + 3 * BEAT_S
                    while time.monotonic() < deadline and not all(
                            f"{_KEYS}ended/{i}" in dict(client.key_value_dir_get(_KEYS)) for i in survivors):
                        time.sleep(BEAT_S / 10)
            except jax.errors.JaxRuntimeError:
                pass
        os._exit(EXIT_CODE)

    def _resume(self) -> str:
        """Where the rerun resumes from. A save under way may have committed before the death showed (its last
        barrier failed, after orbax's commit), which only storage tells: asked for at most `COMMIT_CHECK_S`."""
        where, newest, saving = self.workdir / checkpoint.CHECKPOINT_DIR, self._saved, self._saving
        rerun = "rerun the same command on every host to"
        if saving is not None:
            answer = []
            check = threading.Thread(target=lambda: answer.append(checkpoint.is_committed(self.workdir, saving)),
                                     daemon=True)
            check.start()
            check.join(COMMIT_CHECK_S)
            if not answer:
                return (f"the last good checkpoint is step {saving} in {where} if its save, under way, committed, else "
                        f"{'none' if newest is None else f'step {newest}'}: {rerun} resume from the newest")
            newest = saving if answer[0] else newest
        if newest is None:
            return f"no checkpoint was saved: {rerun} start again"
        return f"the last good checkpoint is step {newest} in {where}: {rerun} resume from it"
