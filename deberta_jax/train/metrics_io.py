"""Metrics to `workdir/metrics.jsonl` (one JSON object per line, with its `step`) and TensorBoard.

On resume the JSON lines past the resumed step are dropped first: they came from steps that are
about to be recomputed, and keeping them would leave two values for one step. Every JSON line is
flushed and fsynced as it is written, so the file is complete up to the last logged step whenever the
process stops; TensorBoard's copy is best-effort (its writer thread is given `CLOSE_TIMEOUT_S` to
finish, so an interrupted run exits instead of hanging in the thread's join).

A workdir in object storage cannot be appended to: there the writer keeps the records and uploads the whole file
at every write (an object is replaced whole, so a kill leaves the previous version, complete), and TensorBoard
writes its events to a local folder whose files are uploaded after each flush.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path

from absl import logging

from deberta_jax import storage


def _summary_writer_class():
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch when it is installed
    (only to accept torch tensors; we log floats), which would add seconds to every train.py start-up."""
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter
        return SummaryWriter
    sys.modules["torch"] = None  # makes `import torch` fail inside tensorboardX, which then does without it
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
CLOSE_TIMEOUT_S = 10.0


def read_metrics(workdir: str | Path) -> list[dict]:
    """Every record of `workdir/metrics.jsonl`. A last line cut short (the process was killed while writing it)
    is left out: its step is past the last checkpoint, so the resumed run writes it again."""
    path = storage.path(workdir) / METRICS_FILE
    if not path.is_file():
        return []
    lines = [line for line in storage.read_text(path).splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ValueError(
                    f"{path} line {i + 1} is not JSON: the metrics log is damaged (the checkpoints are not). Delete "
                    f"that line, or repair it by hand, and run again: the other records are kept, and a resumed run "
                    f"logs on from its checkpoint (sed -i '{i + 1}d' {path} deletes it)") from None
    return records


class MetricsWriter:
    """Appends metrics; a writer with `enabled=False` (processes other than 0) does nothing."""

    def __init__(self, workdir: str | Path, resume_step: int, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        self.path = storage.path(workdir) / METRICS_FILE
        self.remote = storage.is_remote(self.path)
        self.lines = [json.dumps(record) + "\n" for record in read_metrics(workdir) if record["step"] <= resume_step]
        storage.write_text(self.path, "".join(self.lines))  # rewritten whole: a kill loses nothing
        self.tensorboard_dir = storage.path(workdir) / TENSORBOARD_DIR
        self.staging = tempfile.TemporaryDirectory(prefix="deberta-jax-tensorboard-") if self.remote else None
        self.tensorboard = _summary_writer_class()(self.staging.name if self.remote else str(self.tensorboard_dir))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        line = json.dumps({"step": step, **metrics}) + "\n"
        if self.remote:
            self.lines.append(line)
            storage.write_text(self.path, "".join(self.lines))
        else:
            with Path(self.path).open("a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        for name, value in metrics.items():
            self.tensorboard.add_scalar(name, value, step)
        self.tensorboard.flush()
        if self.remote:
            storage.upload_tree(self.staging.name, self.tensorboard_dir)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S, upload: bool = True) -> None:
        """Closes TensorBoard's writer, waiting at most `timeout_s` for its thread (metrics.jsonl is complete); in
        object storage its last events go up unless `upload` is False."""
        if not self.enabled:
            return
        closer = threading.Thread(target=self.tensorboard.close, daemon=True)
        closer.start()
        closer.join(timeout_s)
        try:
            if closer.is_alive():
                logging.warning("TensorBoard's writer did not close within %.0f s; its last events may be missing "
                                "(%s is complete)", timeout_s, self.path)
            elif self.remote and upload:
                storage.upload_tree(self.staging.name, self.tensorboard_dir)
        finally:
            if self.remote:
                self.staging.cleanup()
