"""A deadline on every call to object storage: a store that accepts connections and never answers must stop a run
with one line, not hang it (tensorstore's writes under orbax wait for as long as the store does, and the other
clients' retries add up to many minutes).

Each call runs under `watched` (`storage.deadline` for a path). A watchdog thread ends the process once a call has
run for the limit, with one line naming the call, the store and how to go on: ending the process is the one way out
of a call blocked inside a C++ client, which Python cannot interrupt. What was committed before it stays
(checkpoints, whole-file writes), so the same command resumes.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import threading
import time
from collections.abc import Iterator

# How long one call may run: a checkpoint save of a large model over a slow link takes minutes, a store that has
# stopped answering for this long is not coming back soon.
DEFAULT_LIMIT_S = 600.0

_settings = {"limit_s": DEFAULT_LIMIT_S, "program": os.path.basename(sys.argv[0]) or "python", "setting": ""}
_calls: dict[int, tuple[float, str, str]] = {}  # key -> (monotonic start, the call, its store)
_ids = itertools.count()
_guard = threading.Lock()
_watchdog: list[threading.Thread] = []


FLAG = "storage_deadline_s"


def define_flag() -> None:
    """The entry points' `--storage_deadline_s` (absl), defined once here: train.py's and eval.py's."""
    from absl import flags

    flags.DEFINE_float(FLAG, DEFAULT_LIMIT_S, "How long one call to object storage (a checkpoint save or restore, an "
                       "upload, a read of a corpus or a results file, a lock renewal) may run before the program stops "
                       "with one line naming it: a store that accepts connections and never answers would otherwise "
                       "hang it.")


def set_limit(limit_s: float, program: str, setting: str) -> None:
    """Every later call may run `limit_s`; the line that ends an overdue one starts with `program` and names
    `setting`, where the user changes the limit (e.g. a flag). A limit that is not a number of seconds of at least 1
    (NaN would switch the deadline off, as no time exceeds it) is refused naming `setting`."""
    limit_s = float(limit_s)
    if not (math.isfinite(limit_s) and limit_s >= 1):
        raise ValueError(f"{setting}={limit_s:g}: give the seconds one storage call may run, at least 1 (a store that "
                         "stops answering is found after that long)")
    _settings.update(limit_s=limit_s, program=program, setting=setting)


@contextlib.contextmanager
def watched(call: str, store: str) -> Iterator[None]:
    """Runs the block as one `call` to `store` ("save the checkpoint of step 4 to gs://b/run/checkpoints",
    "gs://b"): the process ends with one line if the block runs past the limit."""
    key = next(_ids)
    with _guard:
        _calls[key] = (time.monotonic(), call, store)
        if not _watchdog:
            _watchdog.append(threading.Thread(target=_watch, name="storage-deadlines", daemon=True))
            _watchdog[0].start()
    try:
        yield
    finally:
        with _guard:
            del _calls[key]


def _watch() -> None:
    while True:
        limit_s = _settings["limit_s"]
        time.sleep(min(1.0, limit_s / 4))
        now = time.monotonic()
        with _guard:
            overdue = sorted(call for call in _calls.values() if now - call[0] > limit_s)
        if overdue:
            _, call, store = overdue[0]  # the oldest: later calls may only be waiting behind it
            setting = f"; {_settings['setting']} sets the limit" if _settings["setting"] else ""
            # On a line of its own: a progress bar may be drawn on the current one.
            sys.stderr.write(f"\n{_settings['program']}: {call} did not finish within {limit_s:g} s: {store} is not "
                             "answering. Stopped; what was saved before it is intact, so rerun the same command to "
                             f"resume{setting}\n")
            sys.stderr.flush()
            os._exit(1)
