"""Checkpoints in a store orbax cannot write to (s3://): orbax saves to a local stage, and each step is published.

orbax gives tensorstore a bucket spec for gs:// only (`storage.orbax_writes`), so for a workdir in another store the
checkpoint manager is orbax's own over a local temporary folder, and `StagedCheckpointManager` keeps the bucket in
step with it under the rule the gs:// workdir keeps:

  * a step exists only when complete: `publish` uploads every file of a saved step (its digest included), then
    `commit_success.txt` last; a step folder without that marker (a save torn by a crash or a dead store) is never
    read, and the next writer deletes it;
  * retention follows orbax's: a step orbax dropped from the stage is dropped from the bucket, marker first, so a
    half-deleted step is never listed;
  * the bucket is the only state: on opening, the committed steps are listed there and their small files (orbax's
    metadata, metrics, log window, digest) fetched, which is all orbax needs to list and rank them; the arrays of a
    step (`lazy`) are fetched the first time the step is read (`step_dir`), so listing or loading one step of a run
    does not download all of them. The digest check then reads the downloaded bytes: what a restore uses is what
    was saved. The stage is removed on close, or, after a kill, by the next manager opened on the same host.

In a run of several processes each has a stage of its own (hosts share nothing but the bucket), while orbax saves as
if they shared one folder: each process writes its shards to `<item>/ocdbt.process_<i>/`, and process 0 alone writes
the metadata and merges the processes' shard indexes into the item's root index. So after orbax's save every other
process uploads its `ocdbt.process_<i>` folders; process 0, once they all have (a barrier), downloads them, merges
again with orbax's own merge (the root index then covers every shard, as on a shared filesystem), writes the digest
and publishes; the others then read the committed step back from the bucket. What lands in the bucket is what a
gs:// workdir holds. Every process fetches a whole step to restore it.
"""

from __future__ import annotations

import asyncio
import pathlib
import shutil
import tempfile

import jax
import orbax.checkpoint as ocp

from deberta_jax import storage
from deberta_jax.storage import atomic
from deberta_jax.train.sharding import sync_processes

COMMIT_MARKER = "commit_success.txt"  # the name orbax gives the marker of a committed step in gs://
SHARDS_PREFIX = "ocdbt.process_"  # orbax's folder of one process's shards within an item


def _shards_of_another_process(relative: str) -> bool:
    """Whether a file of a step (`<item>/ocdbt.process_<i>/...`) holds shards written by a process other than 0."""
    parts = relative.split("/")
    return len(parts) > 2 and parts[1].startswith(SHARDS_PREFIX) and parts[1] != f"{SHARDS_PREFIX}0"


class StagedCheckpointManager:
    """An orbax `CheckpointManager` over a local stage, mirrored to `remote` (a workdir's checkpoints folder); the
    methods are those of orbax's manager that the project calls, plus `publish` and `step_dir`."""

    def __init__(self, remote: storage.AnyPath, options: ocp.CheckpointManagerOptions, read_only: bool,
                 lazy: tuple[str, ...]):
        self.remote = remote
        self._read_only = read_only
        self._lazy = lazy
        if jax.process_count() > 1:
            # orbax's default jax.Array handler records per-host array metadata in a folder process 0 creates and the
            # others wait to see, which on stages of their own they never do; the record only feeds a cross-host
            # check, so it is left out.
            ocp.type_handlers.register_type_handler(
                jax.Array, ocp.type_handlers.ArrayHandler(array_metadata_store=None), override=True)
        # In the temporary folder, named after this process: the stages that killed processes left are removed here.
        base = pathlib.Path(tempfile.gettempdir()) / "deberta-jax-checkpoint-stage"
        atomic.remove_abandoned(base)
        self._stage = atomic.temporary(base)
        self._stage.mkdir()
        self._published: set[int] = set()  # committed in the bucket
        self._complete: set[int] = set()  # every file in the stage
        self._sync()
        self._orbax = ocp.CheckpointManager(self._stage, options=options)

    @property
    def directory(self) -> pathlib.Path:
        """The local folder orbax reads and writes."""
        return self._stage

    def _sync(self) -> None:
        """Makes the stage hold the bucket's committed steps (their small files); deletes torn saves unless
        read-only."""
        found = []
        with storage.reporting(self.remote, "list the checkpoints in"):
            if self.remote.is_dir():
                found = sorted(int(p.name) for p in self.remote.iterdir() if p.name.isdigit())
            committed = {step for step in found if (self.remote / str(step) / COMMIT_MARKER).exists()}
        for step in sorted(set(found) - committed):
            if not self._read_only and jax.process_index() == 0:
                storage.remove_tree(self.remote / str(step))
        for step in sorted(committed - self._published):
            storage.download_tree(self.remote / str(step), self._stage / str(step), skip=self._is_lazy)
        for gone in self._published - committed:
            shutil.rmtree(self._stage / str(gone), ignore_errors=True)
            self._complete.discard(gone)
        self._published = committed

    def _is_lazy(self, relative: str) -> bool:
        return relative.split("/", 1)[0] in self._lazy

    def step_dir(self, step: int) -> pathlib.Path:
        """The local folder of `step`, every file of it fetched from the bucket first."""
        local = self._stage / str(step)
        if step in self._published and step not in self._complete:
            for item in self._lazy:
                storage.download_tree(self.remote / str(step) / item, local / item)
            self._complete.add(step)
        return local

    def publish(self, step: int) -> None:
        """Uploads the saved `step` whole (process 0; the others' shards are there already), commits it with the
        marker, then drops from the bucket the steps orbax's retention dropped from the stage. Every process calls
        it; the others then read the committed step back."""
        if jax.process_index() != 0:
            sync_processes(f"checkpoint {step} published")
            self.reload()
            return
        local, target = self._stage / str(step), self.remote / str(step)
        storage.upload_tree(local, target,
                            skip=lambda relative: relative == COMMIT_MARKER or _shards_of_another_process(relative))
        # orbax's own marker where it wrote one, so the step's digest (which may list it) holds in the bucket
        marker = local / COMMIT_MARKER
        storage.write_bytes(target / COMMIT_MARKER, marker.read_bytes() if marker.exists() else b"committed\n")
        self._published.add(step)
        for old in sorted(self._published - set(self._orbax.all_steps())):
            storage.remove_tree(self.remote / str(old) / COMMIT_MARKER)
            storage.remove_tree(self.remote / str(old))
            self._published.discard(old)
        sync_processes(f"checkpoint {step} published")

    def save(self, step: int, args, metrics=None) -> bool:
        """orbax's save to the stage; in a run of several processes, then gathers every process's shards of `step`
        into process 0's stage (see the module's docstring)."""
        saved = self._orbax.save(step, args=args, metrics=metrics)
        if jax.process_count() > 1:
            self._gather(step)
        if jax.process_index() == 0:  # the others hold their own shards only
            self._complete.add(step)
        return saved

    def _gather(self, step: int) -> None:
        target = self.remote / str(step)
        if jax.process_index() != 0:
            # orbax leaves this process's part of the step in its temporary folder: process 0 alone renames it.
            own = f"{SHARDS_PREFIX}{jax.process_index()}"
            parts = [p for p in self._stage.iterdir() if p.name.split(".", 1)[0] == str(step)]
            for shards in sorted(folder for part in parts for folder in part.glob(f"*/{own}")):
                storage.upload_tree(shards, target / shards.parent.name.split(".", 1)[0] / own)
            for part in parts:
                shutil.rmtree(part)
        sync_processes(f"checkpoint {step}: every process's shards uploaded")
        if jax.process_index() == 0:
            local = self._stage / str(step)
            if storage.download_tree(target, local, skip=lambda relative: not _shards_of_another_process(relative)):
                context = ocp.type_handlers.get_ts_context(use_ocdbt=True)
                for item in sorted({p.parent for p in local.glob(f"*/{SHARDS_PREFIX}*")}):
                    asyncio.run(ocp.type_handlers.merge_ocdbt_per_process_files(item, ts_context=context,
                                                                                use_zarr3=False))

    def restore(self, step: int, args):
        self.step_dir(step)
        return self._orbax.restore(step, args=args)

    def wait_until_finished(self) -> None:
        self._orbax.wait_until_finished()

    def all_steps(self):
        return self._orbax.all_steps()

    def latest_step(self) -> int | None:
        return self._orbax.latest_step()

    def best_step(self) -> int | None:
        return self._orbax.best_step()

    def reload(self) -> None:
        """Reads the bucket again (after a step was moved away, or written by another run)."""
        self._sync()
        self._orbax.reload()

    def close(self) -> None:
        self._orbax.close()
        shutil.rmtree(self._stage, ignore_errors=True)
