"""The on-disk token store: one token stream, memory-mapped, written once and atomically.

A store is a directory holding
  tokens.npy     the stream, 1-D, uint16 when every id fits (else int32), in the standard `.npy` format
                 (`np.load(path, mmap_mode="r")` reads it without loading it);
  manifest.json  its token count, dtype and content digest plus what the caller recorded (written last).
It is built in a temporary directory beside it and renamed into place only when complete and flushed to
disk, so a crash leaves a temporary directory (never read; deleted by the next build on the same host once
the process that made it is gone) and never a partial store. Several processes may build the same store at
once (every host of a multi-host job): the first rename wins and the others delete their copy and read the
winner's. Opening checks the token file against the manifest (size, shape, and a digest of every byte), so a
store damaged or altered afterwards (truncated, overwritten, edited) is set aside and rebuilt rather than read.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from deberta_jax.storage import atomic

logger = logging.getLogger(__name__)

TOKENS_FILE = "tokens.npy"
MANIFEST_FILE = "manifest.json"
# The manifest's record of the tokens' content, checked at every opening: a store of the right size holding other
# ids (copied over, edited) would otherwise be trained on silently. A store written without it is rebuilt.
DIGEST_KEY = "tokens_blake2b"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype for ids below `vocab_size`: half the disk and page cache of int32 for vocabularies
    up to 65,536 tokens."""
    return np.dtype(np.uint16 if vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32)


def _npy_header(dtype: np.dtype, num_tokens: int) -> bytes:
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (num_tokens,)})
    return header.getvalue()


def load(path: Path) -> np.memmap | None:
    """The store's token stream, memory-mapped read-only; None if there is no store at `path` or it is damaged
    (then it has been set aside, with a warning, for the caller to rebuild)."""
    if not path.exists():
        return None
    try:
        return _open(path)
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.warning("token store %s is damaged (%s); discarding it so that it is built again", path, err)
        _discard(path)
        return None


def _open(path: Path) -> np.memmap:
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    num_tokens, dtype = int(manifest["num_tokens"]), np.dtype(manifest["dtype"])
    tokens_path = path / TOKENS_FILE
    expected = len(_npy_header(dtype, num_tokens)) + num_tokens * dtype.itemsize
    size = tokens_path.stat().st_size
    if size != expected:
        raise ValueError(f"{tokens_path} has {size} bytes; its manifest's {num_tokens} {dtype} tokens need {expected}")
    tokens = np.load(tokens_path, mmap_mode="r")
    if tokens.shape != (num_tokens,) or tokens.dtype != dtype:
        raise ValueError(f"{tokens_path} holds {tokens.dtype}{list(tokens.shape)}, its manifest says "
                         f"{dtype}[{num_tokens}]")
    digest = _digest_of_file(tokens_path, len(_npy_header(dtype, num_tokens)))
    if digest != manifest[DIGEST_KEY]:
        raise ValueError(f"{tokens_path} does not hold the tokens its manifest records (BLAKE2b {digest[:16]}..., "
                         f"recorded {manifest[DIGEST_KEY][:16]}...): it was altered after it was written")
    return tokens


def _digest_of_file(path: Path, offset: int) -> str:
    """BLAKE2b of `path`'s bytes from `offset` on, read in blocks (about 1 GB/s: a second per gigabyte of tokens)."""
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "rb") as f:
        f.seek(offset)
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def build(path: Path, pieces: Iterable[np.ndarray], dtype: np.dtype, info: dict) -> np.memmap:
    """Writes the concatenation of `pieces` (consumed one at a time) as the store at `path` and opens it.

    `info` (JSON-serializable) goes into the manifest. If another process completed the same store meanwhile,
    that one is kept and returned.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_abandoned(path)
    temp = atomic.temporary(path)
    temp.mkdir()
    try:
        num_tokens, digest = _write_tokens(temp / TOKENS_FILE, pieces, np.dtype(dtype))
        manifest = {**info, "num_tokens": num_tokens, "dtype": np.dtype(dtype).name, DIGEST_KEY: digest}
        _write_synced(temp / MANIFEST_FILE, json.dumps(manifest, indent=1).encode())
        _sync_directory(temp)
        try:
            os.rename(temp, path)
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            logger.info("token store %s was completed by another process meanwhile; using that one", path)
            shutil.rmtree(temp)
        else:
            _sync_directory(path.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return _open(path)


def _write_tokens(path: Path, pieces: Iterable[np.ndarray], dtype: np.dtype) -> tuple[int, str]:
    """Streams the pieces after a placeholder header, then writes the real header (same size) in its place;
    returns the token count and the BLAKE2b of the tokens' bytes (`_digest_of_file` from the header on)."""
    placeholder = _npy_header(dtype, 0)
    num_tokens = 0
    digest = hashlib.blake2b(digest_size=32)
    with open(path, "wb") as f:
        f.write(placeholder)
        for piece in pieces:
            data = np.ascontiguousarray(piece, dtype).data
            f.write(data)
            digest.update(data)
            num_tokens += len(piece)
        header = _npy_header(dtype, num_tokens)
        if len(header) != len(placeholder):  # numpy pads every 1-D header to 128 bytes; a change must not go unseen
            raise RuntimeError(f"the .npy header of {num_tokens} tokens has {len(header)} bytes, not "
                               f"{len(placeholder)}: this numpy lays headers out differently; update store.py")
        f.seek(0)
        f.write(header)
        f.flush()
        os.fsync(f.fileno())
    return num_tokens, digest.hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_directory(path: Path) -> None:
    """Makes the directory's entries (a rename into it) durable, so a power cut cannot undo a commit."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(path: Path) -> None:
    """Renames a damaged store out of the way (atomically, so no reader sees it half-deleted), then deletes it."""
    doomed = atomic.temporary(path)
    with contextlib.suppress(FileNotFoundError):  # another process discarded it first
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
