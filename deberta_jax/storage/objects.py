"""Conditional writes to `gs://` objects (generation preconditions): what a lock in a bucket is built from.

fsspec has no notion of an object's generation, so these go through google-cloud-storage (which gcsfs itself
depends on, and which honours STORAGE_EMULATOR_HOST like gcsfs does).
"""

from __future__ import annotations

import dataclasses
import os

from deberta_jax.storage.paths import PathLike, StorageError, bucket, reporting


@dataclasses.dataclass(frozen=True)
class Version:
    """One version of an object: its content and the generation the store gave it."""

    data: bytes
    generation: int
    updated: float  # the store's clock, seconds since the epoch


def _blob(target: PathLike):
    """A google-cloud-storage handle on a `gs://` object: the client that exposes generation preconditions."""
    if not os.fspath(target).startswith("gs://"):
        raise StorageError(f"{os.fspath(target)}: a lock in object storage needs gs:// (generation preconditions); "
                           f"keep the workdir on a local disk or in a gs:// bucket")
    bucket_name, name = os.fspath(target).split("://", 1)[1].split("/", 1)
    return _gcs_client().bucket(bucket_name).blob(name)


_CLIENT = None


def _gcs_client():
    global _CLIENT
    if _CLIENT is None:
        from google.auth.exceptions import DefaultCredentialsError
        from google.cloud import storage as gcs

        try:
            _CLIENT = gcs.Client()
        except (DefaultCredentialsError, OSError):  # no credentials here: public buckets and emulators
            _CLIENT = gcs.Client.create_anonymous_client()
    return _CLIENT


def _generation(blob, target: PathLike) -> int:
    if blob.generation is None:
        raise _unsupported(target, "no generation")
    return int(blob.generation)


def _unsupported(target: PathLike, missing: str) -> StorageError:
    """A store that speaks the GCS API without object generations, which the lock needs to tell versions apart."""
    return StorageError(f"{bucket(target)}: the store reported {missing} for {os.fspath(target)}: it does not keep "
                        "object generations, which a lock in object storage is built from; keep the workdir on a local "
                        "disk or in a store that keeps them (Google Cloud Storage does)")


def _preconditions():
    from google.api_core import exceptions
    return exceptions.PreconditionFailed, exceptions.NotFound


def create_new(target: PathLike, data: bytes) -> int | None:
    """Creates object `target` holding `data` only if no object of that name exists; its generation, or None
    when one exists (another writer got there first)."""
    failed, _ = _preconditions()
    blob = _blob(target)
    with reporting(target, "create"):
        try:
            blob.upload_from_string(data, if_generation_match=0)
        except failed:
            return None
        if blob.generation is None:  # an object no later write can be told apart from: not left behind
            blob.delete()
    return _generation(blob, target)


def read_version(target: PathLike) -> Version | None:
    """The object's current content and generation; None if there is none."""
    failed, missing = _preconditions()
    blob = _blob(target)
    with reporting(target, "read"):
        try:
            blob.reload()  # generation and update time; the content of exactly that generation follows
            data = blob.download_as_bytes(if_generation_match=blob.generation)
        except (failed, missing):  # gone, or replaced between the two requests: the caller looks again
            return None
    generation = _generation(blob, target)
    if blob.updated is None:
        raise _unsupported(target, "no update time")
    return Version(data, generation, blob.updated.timestamp())


def replace_version(target: PathLike, data: bytes, generation: int) -> int | None:
    """Replaces the object with `data` only if its generation is still `generation`; the new generation, or
    None if another writer replaced or deleted it since."""
    failed, missing = _preconditions()
    blob = _blob(target)
    with reporting(target, "write"):
        try:
            blob.upload_from_string(data, if_generation_match=generation)
        except (failed, missing):
            return None
    return _generation(blob, target)


def delete_version(target: PathLike, generation: int) -> bool:
    """Deletes the object only if its generation is still `generation`; whether it did."""
    failed, missing = _preconditions()
    with reporting(target, "delete"):
        try:
            _blob(target).delete(if_generation_match=generation)
        except (failed, missing):
            return False
    return True
