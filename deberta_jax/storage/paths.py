"""Paths on a disk or in object storage, and the operations whose meaning differs between them (see the package
docstring)."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import importlib.util
import io
import os
import pathlib
import shutil
import socket
import tempfile
import uuid
from collections.abc import Callable, Iterator

import fsspec
from etils import epath

from deberta_jax.storage import atomic, deadlines

# Object stores the project knows how to address, each with the library fsspec serves it through.
_LIBRARIES = {"gs": "gcsfs", "s3": "s3fs"}
SCHEMES = tuple(_LIBRARIES)
# Stores orbax writes checkpoints to by itself: orbax 0.12 gives tensorstore (which writes the arrays) a bucket spec
# for gs:// only, and takes any other URL for a local path ("Checkpoint path should be absolute. Got s3:/bucket/...").
# Checkpoints for the other stores are written on a local disk and published (`deberta_jax.train.staged_checkpoints`).
_ORBAX_SCHEMES = ("gs",)
# Listings cached by gcsfs / s3fs would hide what other hosts wrote since; every listing asks the store.
for _protocol in ("gs", "gcs", "s3"):
    fsspec.config.conf.setdefault(_protocol, {}).setdefault("use_listings_cache", False)

PathLike = str | os.PathLike
AnyPath = pathlib.Path | epath.Path


class StorageError(OSError):
    """Object storage cannot be reached, or refuses what the run must do there; the message names the bucket."""


def is_remote(path: PathLike) -> bool:
    """Whether `path` names object storage (`gs://...`, `s3://...`) rather than a local file."""
    text = os.fspath(path)
    return "://" in text and text.split("://", 1)[0] in SCHEMES


def path(value: PathLike) -> AnyPath:
    """The path a user gave, as the type it travels as: `pathlib.Path` locally, `epath.Path` for a URL.

    A URL given with an unknown scheme (`gcs://`, `http://`) is refused rather than taken for a local folder of
    that name, which is what a plain `Path("gs://b/run")` silently makes.
    """
    if isinstance(value, epath.Path) and is_remote(value):
        return value
    text = os.fspath(value)
    if is_remote(text):
        scheme = text.split("://", 1)[0]
        if not _installed(_LIBRARIES[scheme]):  # else fsspec's ImportError surfaces inside the first call's error
            raise StorageError(f"{text}: {scheme}:// paths need {_LIBRARIES[scheme]}, which is not installed here: "
                               f"pip install {_LIBRARIES[scheme]}")
        return epath.Path(text)
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(f"{text}: unknown storage scheme {scheme}://; use a local path or "
                         + " or ".join(f"{s}://bucket/..." for s in SCHEMES))
    return pathlib.Path(text)


@functools.cache
def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def orbax_writes(folder: PathLike) -> bool:
    """Whether orbax can write checkpoints into `folder` itself (a local disk, gs://), rather than through a local
    stage that is then published there (s3://)."""
    text = os.fspath(folder)
    return not is_remote(text) or text.split("://", 1)[0] in _ORBAX_SCHEMES


def bucket(value: PathLike) -> str:
    """`gs://bucket` for a path in object storage (for messages), the path itself otherwise."""
    text = os.fspath(value)
    if not is_remote(text):
        return text
    scheme, rest = text.split("://", 1)
    return f"{scheme}://{rest.split('/', 1)[0]}"


def filesystem(value: PathLike) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem serving a remote path (the one `epath` uses for it)."""
    return fsspec.core.url_to_fs(os.fspath(value))[0]


def _key(value: PathLike) -> str:
    """`bucket/object` as fsspec filesystems name a remote path."""
    return os.fspath(value).split("://", 1)[1]


@contextlib.contextmanager
def deadline(value: PathLike, doing: str) -> Iterator[None]:
    """Runs the block as one call to the store holding `value`, `doing` it ("save the checkpoint of step 4 to"): the
    process ends with one line if it runs past the limit (`deadlines`). Local paths have none."""
    if not is_remote(value):
        yield
        return
    with deadlines.watched(f"{doing} {os.fspath(value)}", bucket(value)):
        yield


@contextlib.contextmanager
def reporting(value: PathLike, doing: str) -> Iterator[None]:
    """Turns what a store's client raises (timeouts, refused connections, HTTP errors, missing buckets) into a
    `StorageError` naming the bucket; local paths' errors pass as they are. The block runs under a `deadline`."""
    try:
        with deadline(value, doing):
            yield
    except StorageError:
        raise
    except (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError):
        raise
    except Exception as err:  # noqa: BLE001 - aiohttp, google-auth and the stores' clients raise many types
        if not is_remote(value):
            raise
        reason = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise StorageError(f"{bucket(value)}: cannot {doing} {os.fspath(value)} ({reason}); check that the bucket "
                           "exists, that these credentials may read and write it, and that the store is reachable"
                           ) from None


# ---------------------------------------------------------------------------------------------- fences

# Folders whose writer can lose the right to write there (a workdir in a bucket whose lock another run took over
# while this one stalled), each with the check that raises once the right is gone.
_FENCES: dict[str, Callable[[], None]] = {}


@contextlib.contextmanager
def fence(folder: PathLike, check: Callable[[], None]) -> Iterator[None]:
    """Within the block every write under `folder` calls `check` first, which raises to stop it: the writes of this
    module, and those of libraries that write by themselves (orbax) once their caller asks `check_fence`."""
    key = os.fspath(folder).rstrip("/") + "/"
    _FENCES[key] = check
    try:
        yield
    finally:
        del _FENCES[key]


def check_fence(target: PathLike) -> None:
    """Raises what the check of a `fence` around `target` raises (nothing when no fence is up around it)."""
    text = os.fspath(target) + "/"
    for folder, check in list(_FENCES.items()):
        if text.startswith(folder):
            check()


# ---------------------------------------------------------------------------------------------- whole files

def write_bytes(target: PathLike, data: bytes) -> None:
    """`target` holds `data` in full, or what it held before: never part of it (parent folders are created)."""
    with replacing(target) as tmp, open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_text(target: PathLike, text: str) -> None:
    write_bytes(target, text.encode())


def read_bytes(source: PathLike) -> bytes:
    source = path(source)
    with reporting(source, "read"):
        return source.read_bytes()


def read_text(source: PathLike) -> str:
    return read_bytes(source).decode()


@contextlib.contextmanager
def replacing(target: PathLike) -> Iterator[pathlib.Path]:
    """Yields a local path to write `target`'s new content to (with any library that writes files); it becomes
    `target` whole when the block completes: renamed over a local file, or uploaded as one object."""
    target = path(target)
    check_fence(target)
    if not is_remote(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic.replacing(target) as tmp:
            yield pathlib.Path(tmp)
        return
    with tempfile.TemporaryDirectory(prefix="deberta-jax-upload-") as staging:
        local = pathlib.Path(staging) / target.name
        yield local
        with reporting(target, "upload"):
            filesystem(target).put_file(os.fspath(local), _key(target))


# How a write that found no room reads in tensorstore's errors (ENOSPC, EFBIG, EDQUOT), in safetensors' and in
# Python's.
NO_ROOM = ("os_error_code='28'", "os_error_code='27'", "os_error_code='122'", "No space left on device",
           "File too large", "Disk quota exceeded")


def no_room(err: BaseException) -> bool:
    """Whether `err` is a write that found no room: a full disk, or a file-size or quota limit reached."""
    return any(code in str(err) for code in NO_ROOM)


STAGED = ".staged"  # the name of `staged`'s folder, as a temporary of it (`atomic.temporary`)


@contextlib.contextmanager
def staged(folder: PathLike, what: str, fix: str) -> Iterator[str]:
    """Yields a folder to write a set of files into; they then replace their namesakes in `folder` together: all of
    them, or, when a write fails, none (a full disk leaves the previous set whole, not some files of each). Local: a
    hidden folder inside `folder`, on its disk, from which renames need no room; a write that found no room is one
    line naming `folder`, `what` was written and the `fix`. In a bucket: a local folder, uploaded file by file once
    complete (objects are replaced one at a time)."""
    folder = path(folder)
    if is_remote(folder):
        with tempfile.TemporaryDirectory(prefix="deberta-jax-staged-") as staging:
            yield staging
            upload_tree(staging, folder)
        return
    folder.mkdir(parents=True, exist_ok=True)
    atomic.remove_abandoned(folder / STAGED)
    staging = atomic.temporary(folder / STAGED)
    staging.mkdir()
    try:
        try:
            yield os.fspath(staging)
        except Exception as err:  # noqa: BLE001 - kept as it was unless it says there was no room
            if not no_room(err):
                raise
            raise OSError(f"{folder}: no room to write {what} (the disk is full, or a file-size or quota limit was "
                          f"reached); nothing there was replaced. Free space on its disk, or {fix}") from None
        for file in sorted(staging.iterdir()):
            atomic.remove_abandoned(folder / file.name)  # what killed writers of these files left
            os.replace(file, folder / file.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def upload_tree(local: PathLike, target: PathLike, skip: Callable[[str], bool] = lambda relative: False) -> None:
    """Copies the files under local folder `local` to folder `target` (any storage), each written whole, in the order
    of their relative POSIX paths, all but those `skip` names."""
    local = pathlib.Path(local)
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        relative = file.relative_to(local).as_posix()
        if not skip(relative):
            write_bytes(path(target) / relative, file.read_bytes())


def remove_tree(target: PathLike) -> None:
    """Deletes a folder and everything under it; a missing one is no error."""
    target = path(target)
    check_fence(target)
    if not is_remote(target):
        shutil.rmtree(target, ignore_errors=True)
        return
    with reporting(target, "delete"), contextlib.suppress(FileNotFoundError):
        filesystem(target).rm(_key(target), recursive=True)


def move_tree(source: PathLike, target: PathLike) -> None:
    """Moves a folder (locally a rename; in object storage a copy of every object, then their deletion)."""
    source, target = path(source), path(target)
    check_fence(source)
    check_fence(target)
    if not is_remote(source):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(os.fspath(source), os.fspath(target))
        return
    fs, prefix, into = filesystem(source), _key(source).rstrip("/") + "/", _key(target).rstrip("/") + "/"
    with reporting(source, "move"):
        # Object by object: s3fs's recursive `mv` also copies and deletes the folder itself, which no object names.
        keys = [key for key in fs.find(prefix) if key.startswith(prefix)]
        for key in keys:
            fs.copy(key, into + key[len(prefix):])
        fs.rm(keys)


def glob(pattern: str) -> list[str]:
    """Files matching a glob, as the strings a user would write (URLs keep their scheme), sorted."""
    if not is_remote(pattern):
        import glob as globbing
        return sorted(p for p in globbing.glob(pattern, recursive=True) if os.path.isfile(p))
    scheme = pattern.split("://", 1)[0]
    fs = filesystem(pattern)
    with reporting(pattern, "list"):
        return sorted(f"{scheme}://{p}" for p in fs.glob(_key(pattern)) if fs.isfile(p))


def identity(file: PathLike) -> tuple:
    """What changes when a file's content is replaced: (absolute path, size, mtime) locally; in object storage
    (URL, size, generation or ETag), which the store sets anew at every write."""
    file = path(file)
    if not is_remote(file):
        stat = file.stat()
        return str(file.resolve()), stat.st_size, stat.st_mtime_ns
    with reporting(file, "read"):
        info = filesystem(file).info(_key(file))
    return os.fspath(file), info.get("size"), str(info.get("generation") or info.get("ETag") or info.get("etag"))


def check_writable(folder: PathLike, what: str, room: int = 0) -> None:
    """Fails now, naming `folder` and `what` it is for, when a file cannot be written there: a bucket that does
    not exist or these credentials may not write is found before any compilation, not at the first save; with
    `room` (bytes), a local disk without that much room too (a full disk takes an empty file)."""
    folder = path(folder)
    probe = folder / f".write-probe-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_bytes(probe, bytes(room if not is_remote(folder) else 0))
        if is_remote(probe):
            filesystem(probe).rm_file(_key(probe))
        else:
            probe.unlink()
    except OSError as err:
        if not is_remote(folder):
            with contextlib.suppress(OSError):
                probe.unlink()
            if no_room(err):
                raise OSError(f"{what} {folder} has no room for {room:,} bytes (the disk is full, or a file-size or "
                              "quota limit was reached); free space there, or pass a folder on another disk") from None
            raise OSError(f"{what} {folder} is not writable ({err.strerror or err}); pass a folder you can write "
                          "to") from None
        reason = "no such bucket" if isinstance(err, FileNotFoundError) else str(err).split("; check")[0]
        raise StorageError(f"{what} {os.fspath(folder)} is not writable: {bucket(folder)}: {reason}; check that the "
                           "bucket exists and that these credentials may write to it") from None


# ---------------------------------------------------------------------------------------------- checksums

def fingerprints(root: PathLike, kind: str | None = None, skip: str = "") -> dict[str, str]:
    """A checksum of every file under `root` (relative POSIX path -> checksum), files named `skip*` left out.

    `kind` "sha256" reads every byte (a local disk's default); "md5" takes the checksum that object storage
    computed when each object was uploaded, from one listing (the bucket's default: nothing is downloaded), and
    computes the same from the bytes of a local file. MD5 values are written "md5:<base64>", as GCS reports them.
    """
    root = path(root)
    kind = kind or ("md5" if is_remote(root) else "sha256")
    if not is_remote(root):
        return {p.relative_to(root).as_posix(): _hash_file(p, kind)
                for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(skip or "\0")}
    fs = filesystem(root)
    prefix = _key(root).rstrip("/") + "/"
    with reporting(root, "list"):
        listing = fs.find(prefix, detail=True)
    out = {}
    for key, info in sorted(listing.items()):
        relative = key[len(prefix):] if key.startswith(prefix) else key
        if info.get("type") == "directory" or (skip and relative.rsplit("/", 1)[-1].startswith(skip)):
            continue
        out[relative] = _object_checksum(fs, key, info, kind, root)
    return out


# Checksums of local files already read by this process, by `identity` (path, size, modification time): a corpus
# named by every run of a sweep is read once per process, not once per run.
_LOCAL_CHECKSUMS: dict[tuple, str] = {}


def checksum(file: PathLike, kind: str | None = None) -> str:
    """One file's `fingerprints` checksum: what its bytes are, whatever its path or modification time (a copy of the
    same text, or the same text written again, gives the same value). Reads a local file whole, once per process
    while it is unchanged; an object's stored MD5 comes from its metadata."""
    file = path(file)
    kind = kind or ("md5" if is_remote(file) else "sha256")
    if not is_remote(file):
        key = (*identity(file), kind)
        if key not in _LOCAL_CHECKSUMS:
            _LOCAL_CHECKSUMS[key] = _hash_file(file, kind)
        return _LOCAL_CHECKSUMS[key]
    fs = filesystem(file)
    with reporting(file, "read"):
        info = fs.info(_key(file))
    return _object_checksum(fs, _key(file), info, kind, file)


def _object_checksum(fs, key: str, info: dict, kind: str, where: AnyPath) -> str:
    if kind == "md5" and info.get("md5Hash"):
        return "md5:" + info["md5Hash"]
    with reporting(where, "read"), fs.open(key, "rb") as f:  # no stored checksum of this kind: read the object
        return _hash_stream(f, kind)


def _hash_file(file: pathlib.Path, kind: str) -> str:
    with file.open("rb") as f:
        return _hash_stream(f, kind)


def _hash_stream(f, kind: str) -> str:
    digest = hashlib.new(kind)
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    return "md5:" + base64.b64encode(digest.digest()).decode() if kind == "md5" else digest.hexdigest()


def checksum_kind(recorded: dict[str, str]) -> str:
    """Which `fingerprints` kind a record was made with (records of either kind verify on any storage)."""
    return "md5" if any(value.startswith("md5:") for value in recorded.values()) else "sha256"


# ---------------------------------------------------------------------------------------------- streams, local copies

def reader(source: PathLike) -> io.BufferedReader:
    """`source` opened for reading bytes, with the interface of a local `open(source, "rb")`: a URL's fsspec file
    lacks part of it (`readline(size)`, which bounds how much one line may read), so it is wrapped in the same
    buffered reader. For files read piece by piece, which `read_bytes` would hold whole in memory."""
    source = path(source)
    if not is_remote(source):
        return open(source, "rb")
    with reporting(source, "read"):
        return io.BufferedReader(_WatchedReads(filesystem(source).open(_key(source), "rb"), source))


class _WatchedReads(io.RawIOBase):
    """A remote file whose every read is a call under the storage deadline (`deadline`): a store that stops answering
    in the middle of a corpus ends the program in one line, as one that stops before it does."""

    def __init__(self, raw, source: AnyPath):
        super().__init__()
        self._raw, self._source = raw, source

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        with reporting(self._source, "read"):
            data = self._raw.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


@contextlib.contextmanager
def local_copy(folder: PathLike) -> Iterator[pathlib.Path]:
    """Yields a local folder holding the files of `folder`, for libraries that read only local files: `folder`
    itself on a disk; for a URL, a download of every file under it (`download_tree`), deleted when the block
    ends."""
    folder = path(folder)
    if not is_remote(folder):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="deberta-jax-download-") as staging:
        if not download_tree(folder, staging):
            raise FileNotFoundError(f"{os.fspath(folder)} not found: no file under it in {bucket(folder)}")
        yield pathlib.Path(staging)


def download_tree(folder: PathLike, local: PathLike, skip: Callable[[str], bool] = lambda relative: False) -> int:
    """Copies the files under remote `folder` into local folder `local` (the counterpart of `upload_tree`), all but
    those whose relative POSIX path `skip` names; returns how many it copied (0 for a folder that does not exist).
    Each file is one call to the store, under the deadline."""
    folder = path(folder)
    fs, prefix = filesystem(folder), _key(folder).rstrip("/") + "/"
    with reporting(folder, "list"):
        try:
            keys = [key for key in fs.find(prefix) if key.startswith(prefix)]
        except FileNotFoundError:  # no such bucket
            keys = []
    copied = 0
    for key in keys:
        relative = key[len(prefix):]
        if skip(relative):
            continue
        target = pathlib.Path(local, relative)
        target.parent.mkdir(parents=True, exist_ok=True)
        with reporting(folder / relative, "download"):
            fs.get_file(key, os.fspath(target))
        copied += 1
    return copied


def tree_bytes(root: PathLike) -> int:
    """The bytes of every file under folder `root` (a checkpoint's size, for benchmarks and messages)."""
    root = path(root)
    if not is_remote(root):
        return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    with reporting(root, "list"):
        return int(filesystem(root).du(_key(root), total=True))
