"""Conditional writes to objects in a bucket: what a lock in object storage is built from.

fsspec has no notion of an object's version, so these go through each store's own client, which finds the store
and the credentials the standard way:
  * `gs://`: google-cloud-storage (which gcsfs itself depends on, and which honours STORAGE_EMULATOR_HOST like
    gcsfs does); a version is the object's generation, and a write is conditional on it (`ifGenerationMatch`,
    0 for "no object");
  * `s3://`: boto3 (which s3fs's aiobotocore depends on; AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ... or the machine's
    role); a version is the object's ETag, and a write is conditional on it (`If-Match`) or on there being no
    object (`If-None-Match: *`), as S3 has honoured since 2024. Every write of the lock holds a new nonce or time,
    so two versions never share an ETag (which is a checksum of the content).
"""

from __future__ import annotations

import dataclasses
import functools
import os

from deberta_jax.storage.paths import PathLike, StorageError, bucket, reporting

VersionId = int | str  # a GCS generation or an S3 ETag


@dataclasses.dataclass(frozen=True)
class Version:
    """One version of an object: its content and the store's name for that version."""

    data: bytes
    generation: VersionId
    updated: float  # the store's clock, seconds since the epoch


def other_version(version: VersionId) -> VersionId:
    """A version of the same kind as `version` that the object does not have now (to check that a write conditional
    on it is refused): GCS generations only grow, an ETag of 32 zeros is no content's."""
    return version + 1 if isinstance(version, int) else '"' + "0" * 32 + '"'


def _scheme(target: PathLike) -> str:
    scheme = os.fspath(target).split("://", 1)[0] if "://" in os.fspath(target) else ""
    if scheme not in ("gs", "s3"):
        raise StorageError(f"{os.fspath(target)}: a lock in object storage needs gs:// or s3:// (conditional "
                           "writes); keep the workdir on a local disk or in a gs:// or s3:// bucket")
    return scheme


def _split(target: PathLike) -> tuple[str, str]:
    bucket_name, name = os.fspath(target).split("://", 1)[1].split("/", 1)
    return bucket_name, name


# ---------------------------------------------------------------------------------------------- gs://

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


def _blob(target: PathLike):
    bucket_name, name = _split(target)
    return _gcs_client().bucket(bucket_name).blob(name)


def _generation(blob, target: PathLike) -> int:
    if blob.generation is None:
        raise _unsupported(target, "no generation")
    return int(blob.generation)


def _unsupported(target: PathLike, missing: str) -> StorageError:
    """A store that speaks a bucket API without versions of objects, which the lock needs to tell them apart."""
    return StorageError(f"{bucket(target)}: the store reported {missing} for {os.fspath(target)}: it does not keep "
                        "object versions, which a lock in object storage is built from; keep the workdir on a local "
                        "disk or in a store that keeps them (Google Cloud Storage and Amazon S3 do)")


def _gcs_refusals():
    from google.api_core import exceptions
    return exceptions.PreconditionFailed, exceptions.NotFound


# ---------------------------------------------------------------------------------------------- s3://

@functools.cache
def _s3_client():
    import boto3
    return boto3.client("s3")


def _s3_refused(err) -> bool:
    """A write refused for its condition (412), a conflicting concurrent conditional write (409), or no object."""
    return err.response.get("Error", {}).get("Code") in (
        "PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "404")


def _s3_call(target: PathLike, doing: str, call, **kwargs):
    """`call(Bucket=..., Key=..., **kwargs)`'s response, or None when the store refused it for its condition."""
    from botocore.exceptions import ClientError

    bucket_name, name = _split(target)
    with reporting(target, doing):
        try:
            return call(Bucket=bucket_name, Key=name, **kwargs)
        except ClientError as err:
            if _s3_refused(err):
                return None
            raise


def _etag(response: dict, target: PathLike) -> str:
    if not response.get("ETag"):
        raise _unsupported(target, "no ETag")
    return response["ETag"]


# ---------------------------------------------------------------------------------------------- either

def create_new(target: PathLike, data: bytes) -> VersionId | None:
    """Creates object `target` holding `data` only if no object of that name exists; its version, or None
    when one exists (another writer got there first)."""
    if _scheme(target) == "s3":
        response = _s3_call(target, "create", _s3_client().put_object, Body=data, IfNoneMatch="*")
        return None if response is None else _etag(response, target)
    failed, _ = _gcs_refusals()
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
    """The object's current content and version; None if there is none."""
    if _scheme(target) == "s3":
        response = _s3_call(target, "read", _s3_client().get_object)  # content, ETag and time of one version
        if response is None:
            return None
        with reporting(target, "read"):
            data = response["Body"].read()
        return Version(data, _etag(response, target), response["LastModified"].timestamp())
    failed, missing = _gcs_refusals()
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


def replace_version(target: PathLike, data: bytes, generation: VersionId) -> VersionId | None:
    """Replaces the object with `data` only if its version is still `generation`; the new version, or None if
    another writer replaced or deleted it since."""
    if _scheme(target) == "s3":
        response = _s3_call(target, "write", _s3_client().put_object, Body=data, IfMatch=generation)
        return None if response is None else _etag(response, target)
    failed, missing = _gcs_refusals()
    blob = _blob(target)
    with reporting(target, "write"):
        try:
            blob.upload_from_string(data, if_generation_match=generation)
        except (failed, missing):
            return None
    return _generation(blob, target)


def delete_version(target: PathLike, generation: VersionId) -> bool:
    """Deletes the object only if its version is still `generation`; whether it did."""
    if _scheme(target) == "s3":
        return _s3_call(target, "delete", _s3_client().delete_object, IfMatch=generation) is not None
    failed, missing = _gcs_refusals()
    with reporting(target, "delete"):
        try:
            _blob(target).delete(if_generation_match=generation)
        except (failed, missing):
            return False
    return True
