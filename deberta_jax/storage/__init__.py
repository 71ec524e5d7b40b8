"""Every path a user gives, on a local disk or in object storage (`gs://bucket/...`, `s3://bucket/...`).

A TPU pod's hosts share nothing but a bucket, so a run's workdir, its corpora and the outputs of evaluation and
export may all live there. `path` turns what the user typed into the one type the project passes around: a
`pathlib.Path` for a local path (so local behaviour is exactly what it always was) and an `etils.epath.Path` for
a URL, which speaks the same pathlib API through fsspec (gcsfs for `gs://`, s3fs for `s3://`) and which orbax
takes as a checkpoint directory. The few operations where object storage differs from a disk are here, once:

  * no atomic rename: `write_bytes` / `replacing` write a local file under a temporary name and rename it, but
    upload an object in one request, which the store commits whole or not at all (a reader sees the old object
    or the new one, never part of one);
  * no file locks: `create_new` (create only if absent), `replace_version` and `delete_version` (only the version
    one last saw: a GCS generation, an S3 ETag) are what `train.workdir_lock` builds its lock from;
  * no cheap re-reading: `fingerprints` takes the checksums the store computed on upload from one listing
    instead of downloading every file;
  * a writer that can lose its workdir: `fence` makes every write under a folder ask a check first (the bucket
    lock's: a run whose lock another run took over writes nothing more);
  * more ways to fail: `StorageError` names the bucket and the fix in one line, and a store that stops answering
    ends the process with one line once a call has run `deadlines` long (`deadline`, in every call of this
    package; `deadlines.set_limit` sets how long).

Directory listings are never cached (`use_listings_cache=False`): another host may have written since.
"""

from deberta_jax.storage.objects import (
    Version,
    VersionId,
    create_new,
    delete_version,
    other_version,
    read_version,
    replace_version,
)
from deberta_jax.storage.paths import (
    SCHEMES,
    AnyPath,
    PathLike,
    StorageError,
    bucket,
    check_fence,
    check_writable,
    checksum,
    checksum_kind,
    deadline,
    download_tree,
    fence,
    filesystem,
    fingerprints,
    glob,
    identity,
    is_remote,
    local_copy,
    move_tree,
    no_room,
    orbax_writes,
    path,
    read_bytes,
    read_text,
    reader,
    remove_tree,
    replacing,
    reporting,
    staged,
    tree_bytes,
    upload_tree,
    write_bytes,
    write_text,
)

__all__ = ["SCHEMES", "AnyPath", "PathLike", "StorageError", "Version", "VersionId", "bucket", "check_fence",
           "check_writable", "checksum", "checksum_kind", "create_new", "deadline", "delete_version", "download_tree",
           "fence", "filesystem", "fingerprints", "glob", "identity", "is_remote", "local_copy", "move_tree",
           "no_room", "orbax_writes", "other_version", "path", "read_bytes", "read_text", "read_version", "reader",
           "remove_tree", "replace_version", "replacing", "reporting", "staged", "tree_bytes", "upload_tree",
           "write_bytes", "write_text"]
