"""Quiet third-party logging for the entry points (beside `errors`, how they report user errors): the checkpoint
and bucket libraries log every stage of every save and every object read at INFO (about 145 lines to load two
checkpoints), which would bury the program's own log. `quiet()` keeps their warnings and errors."""

from __future__ import annotations

import logging as pylogging
import sys

from absl import logging

# Libraries whose INFO records would bury the run's own log (asyncio logs for orbax's and gcsfs's event loops).
QUIET_LIBRARIES = ("/orbax/", "/gcsfs/", "/fsspec/", "/google/", "/asyncio/")


# Warnings and errors of those libraries that say nothing new here: a checkpoint saved without eval metrics (only
# evaluation steps carry them), a checkpoint folder opened read-only (as evaluation and export open it, on purpose),
# and what a failed save leaves behind, which `checkpoint.save` raises as one line naming the workdir and the fix (a
# full disk printed some 700 lines of it first): the traceback orbax logs from its writer thread, and the writes it
# abandoned, which asyncio reports when their futures are collected.
EXPECTED_RECORDS = ("did not provide metrics", "Given directory is read only",
                    "_SignalingThread.run() raised an exception", "exception was never retrieved",
                    # gcsfs logs, with its traceback, the error it then raises, which the program reports in one line
                    # (an unreachable store, refused credentials): the traceback would bury that line.
                    "out of retries on exception", "non-retriable exception")

LOOP_CLOSED = "Event loop is closed"


# jax's note, at INFO, that a backend it found installed could not start: libtpu (jax[tpu]) on a machine without a
# TPU, every run. A backend the run asked for that fails is an error of its own.
BACKEND_NOTE = "Unable to initialize backend"


def quiet_libraries(record: pylogging.LogRecord) -> bool:
    """Drops the INFO records of `QUIET_LIBRARIES`, and their `EXPECTED_RECORDS`, and jax's `BACKEND_NOTE`."""
    if record.levelno < pylogging.WARNING and record.getMessage().startswith(BACKEND_NOTE):
        return False
    if not any(name in record.pathname for name in QUIET_LIBRARIES):
        return True
    return record.levelno >= pylogging.WARNING and not any(w in record.getMessage() for w in EXPECTED_RECORDS)


def quiet() -> None:
    """Applies `quiet_libraries` to absl's handler, which these libraries' records reach, and drops the tracebacks
    tensorstore reports after a failed save, one per write that completes after orbax closed its event loop."""
    logging.get_absl_handler().addFilter(quiet_libraries)  # the handler: records propagated from std loggers too
    previous = sys.unraisablehook

    def unraisablehook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == LOOP_CLOSED):
            previous(unraisable)

    sys.unraisablehook = unraisablehook
