"""Metrics to `workdir/metrics.jsonl` (one JSON object per line, with its `step`) and TensorBoard.

On resume the JSON lines past the resumed step are dropped first: they came from steps that are
about to be recomputed, and keeping them would leave two values for one step.
"""

from __future__ import annotations

import json
from pathlib import Path

from tensorboardX import SummaryWriter

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def read_metrics(workdir: str | Path) -> list[dict]:
    path = Path(workdir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class MetricsWriter:
    """Appends metrics; a writer with `enabled=False` (processes other than 0) does nothing."""

    def __init__(self, workdir: str | Path, resume_step: int, enabled: bool = True):
        self.enabled = enabled
        if not enabled:
            return
        self.path = Path(workdir) / METRICS_FILE
        kept = [record for record in read_metrics(workdir) if record["step"] <= resume_step]
        self.path.write_text("".join(json.dumps(record) + "\n" for record in kept))
        self.tensorboard = SummaryWriter(str(Path(workdir) / TENSORBOARD_DIR))

    def write(self, step: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        for name, value in metrics.items():
            self.tensorboard.add_scalar(name, value, step)
        self.tensorboard.flush()

    def close(self) -> None:
        if self.enabled:
            self.tensorboard.close()
