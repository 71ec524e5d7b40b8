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

One process writes the stage, so a run of several processes (which orbax saves shard by shard into one shared
folder) is refused with a workdir here; it needs a shared filesystem or gs://.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile

import orbax.checkpoint as ocp

from deberta_jax import storage
from deberta_jax.storage import atomic

COMMIT_MARKER = "commit_success.txt"  # the name orbax gives the marker of a committed step in gs://


class StagedCheckpointManager:
    """An orbax `CheckpointManager` over a local stage, mirrored to `remote` (a workdir's checkpoints folder); the
    methods are those of orbax's manager that the project calls, plus `publish` and `step_dir`."""

    def __init__(self, remote: storage.AnyPath, options: ocp.CheckpointManagerOptions, read_only: bool,
                 lazy: tuple[str, ...]):
        self.remote = remote
        self._read_only = read_only
        self._lazy = lazy
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
            if not self._read_only:
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
        """Uploads the saved `step` whole, commits it with the marker, then drops from the bucket the steps orbax's
        retention dropped from the stage."""
        local, target = self._stage / str(step), self.remote / str(step)
        storage.upload_tree(local, target, skip=lambda relative: relative == COMMIT_MARKER)
        # orbax's own marker where it wrote one, so the step's digest (which may list it) holds in the bucket
        marker = local / COMMIT_MARKER
        storage.write_bytes(target / COMMIT_MARKER, marker.read_bytes() if marker.exists() else b"committed\n")
        self._published.add(step)
        for old in sorted(self._published - set(self._orbax.all_steps())):
            storage.remove_tree(self.remote / str(old) / COMMIT_MARKER)
            storage.remove_tree(self.remote / str(old))
            self._published.discard(old)

    def save(self, step: int, args, metrics=None) -> bool:
        saved = self._orbax.save(step, args=args, metrics=metrics)
        self._complete.add(step)
        return saved

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
