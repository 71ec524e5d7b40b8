"""Outputs written whole or not at all, and what killed writers leave behind.

A file or directory is first written under a temporary name beside it, `<name>.tmp-<host>-<pid>-<random>`, and
renamed into place once complete: a kill or a full disk leaves the previous version as it was. The name says which
process of which host wrote it, so a later writer removes the temporaries of processes on its host that no longer
run (`remove_abandoned`) and leaves alone those of live processes and of other hosts, whose processes it cannot see.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import uuid
from pathlib import Path

logger = logging.getLogger(__name__)

TEMP_MARK = ".tmp-"


def temporary(path: str | os.PathLike) -> Path:
    """A fresh temporary name beside `path`, naming this host and process."""
    path = Path(path)
    return path.with_name(f"{path.name}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def remove_abandoned(path: str | os.PathLike) -> list[Path]:
    """Deletes the temporaries of `path` (files or directories) left by processes of this host that no longer run;
    returns them."""
    path = Path(path)
    prefix = f"{path.name}{TEMP_MARK}{socket.gethostname()}-"
    removed = []
    for temp in path.parent.glob(f"{prefix}*"):
        pid = temp.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not running(int(pid)):
            logger.info("removing %s, left by process %s, which no longer runs", temp, pid)
            if temp.is_dir():
                shutil.rmtree(temp, ignore_errors=True)
            else:
                temp.unlink(missing_ok=True)
            removed.append(temp)
    return removed


@contextlib.contextmanager
def replacing(path: str | os.PathLike):
    """Yields a temporary path to write `path`'s new content to; renames it over `path` when the block completes,
    and removes it when the block fails. Abandoned temporaries of `path` are removed first."""
    remove_abandoned(path)
    tmp = temporary(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    """`path` holds `text` in full, or its previous content: never a half-written file."""
    with replacing(path) as tmp:
        Path(tmp).write_text(text)


def running(pid: int) -> bool:
    """Whether process `pid` of this host runs (as any user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True
