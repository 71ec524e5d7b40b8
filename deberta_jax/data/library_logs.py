"""Quiet third-party logging for the entry points (beside `errors`, how they report user errors): the checkpoint
and bucket libraries log every stage of every save and every object read at INFO (about 145 lines to load two
checkpoints), which would bury the program's own log. `quiet()` keeps their warnings and errors."""

from __future__ import annotations

import logging as pylogging

from absl import logging

# Libraries whose INFO records would bury the run's own log.
QUIET_LIBRARIES = ("/orbax/", "/gcsfs/", "/fsspec/", "/google/")


# Warnings of those libraries about what is expected here: a checkpoint saved without eval metrics (only evaluation
# steps carry them), and a checkpoint folder opened read-only (as evaluation and export open it, on purpose).
EXPECTED_WARNINGS = ("did not provide metrics", "Given directory is read only")


def quiet_libraries(record: pylogging.LogRecord) -> bool:
    """Drops the INFO records of `QUIET_LIBRARIES`, and their `EXPECTED_WARNINGS`."""
    if not any(name in record.pathname for name in QUIET_LIBRARIES):
        return True
    return record.levelno >= pylogging.WARNING and not any(w in record.getMessage() for w in EXPECTED_WARNINGS)


def quiet() -> None:
    """Applies `quiet_libraries` to absl's logger, which these libraries log through."""
    logging.get_absl_logger().addFilter(quiet_libraries)
