"""A run branched off another run's checkpoint: recipes that differ only in how they end train their start once.

The training-side length recipes (`deberta_jax.data.row_lengths`) differ in their long phase, the last
`train.long_steps` updates, and nowhere else: every update before it is the same computation on the same rows,
masks and learning rate, since all of them are functions of (seed, step). So a study of several long phases
need not train their common start once per recipe. `train.py --branch_from=TRUNK` starts a new workdir from
TRUNK's newest checkpoint at or before the first step where the two runs could differ, with TRUNK's tokenizer and
metrics up to that step, and trains the rest itself: it ends exactly where the same command trained from scratch
ends (tested), at the cost of only the steps the trunk did not share.

A branch is refused, in one line naming each field, unless the two configs agree on everything that acts before
the long phase. Fields that cannot act there are left out of that comparison: the long phase's own
(`LONG_PHASE_FIELDS`), how often a run logs, evaluates and saves (`CADENCE_FIELDS`), `data.min_row_length` equal to
`data.seq_len` (rows of L cut to L: nothing is cut) and `model.max_position_embeddings` of a model without an
absolute position table (there it only bounds the longest row).
"""

from __future__ import annotations

import json

from absl import logging
from ml_collections import config_dict

from deberta_jax import storage
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.train import checkpoint, config_checks, metrics_io

LONG_PHASE_FIELDS = ("data.long_seq_len", "train.long_steps", "train.long_share")
CADENCE_FIELDS = ("train.log_every", "train.eval_every", "train.eval_batches", "train.checkpoint_every",
                  "train.keep_checkpoints", "data.eval_files", "data.cache_dir")
# The branch's record of where it started, beside its config.json.
BRANCH_FILE = "branch.json"


def _before_long_phase(run: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """`run` (a config as config.json records it) reduced to what acts on the updates before its long phase."""
    tree = run.to_dict()
    model = ModelConfig.from_dict(tree["model"])  # fields added since a workdir was written hold their defaults
    tree["model"] = model.to_dict()
    if not model.uses_absolute_table:
        tree["model"].pop("max_position_embeddings", None)
    if tree["data"].get("min_row_length") == tree["data"]["seq_len"]:
        tree["data"]["min_row_length"] = 0
    for field in (*LONG_PHASE_FIELDS, *CADENCE_FIELDS):
        section, name = field.split(".")
        tree[section].pop(name, None)
    return config_dict.ConfigDict(tree)


def trunk_key(run: config_dict.ConfigDict) -> str:
    """What `run` trains before its long phase, as a string: runs with equal keys can branch off one another."""
    return json.dumps(_before_long_phase(run).to_dict(), sort_keys=True, default=str)


def shared_steps(run: config_dict.ConfigDict) -> int:
    """The updates of `run` before its long phase (all of them without one)."""
    return run.train.num_steps - run.train.get("long_steps", 0)


def branch_step(trunk: storage.AnyPath, run: config_dict.ConfigDict, trunk_steps: list[int]) -> int:
    """The checkpoint of `trunk` (which holds `trunk_steps`) that `run` starts from: the newest one both runs would
    have trained identically. Refuses, naming the fields or the steps, where there is none."""
    trunk_run = checkpoint.read_config(trunk)
    differ = config_checks.differences(_before_long_phase(trunk_run), _before_long_phase(run))
    if differ:
        raise ConfigError(
            f"--branch_from={trunk} trained another run before its long phase: "
            + ", ".join(f"config.{key} {a!r} there, {b!r} here" for key, (a, b) in differ.items())
            + ". Branch off a run whose config differs only in "
            + ", ".join(f"config.{field}" for field in LONG_PHASE_FIELDS)
            + ", or train this one from its first step without --branch_from.")
    last = min(shared_steps(trunk_run), shared_steps(run))
    usable = [step for step in trunk_steps if step <= last]
    if not usable:
        raise ConfigError(
            f"--branch_from={trunk} has no checkpoint at or before step {last}, the last step the two runs share "
            f"(it holds {sorted(trunk_steps) or 'none'}). Train the trunk with --stop_at_step={last}, whose "
            "checkpoint the same command then resumes from, or train this run without --branch_from.")
    return max(usable)


def start_branch(trunk: storage.AnyPath, workdir: storage.AnyPath, step: int, is_main: bool) -> None:
    """Gives `workdir` the trunk's metrics up to `step` (a branch attempted before is rewritten whole) and the
    record of where it started."""
    if not is_main:
        return
    kept = [record for record in metrics_io.read_metrics(trunk) if record["step"] <= step]
    storage.write_text(storage.path(workdir) / metrics_io.METRICS_FILE,
                       "".join(json.dumps(record) + "\n" for record in kept))
    storage.write_text(storage.path(workdir) / BRANCH_FILE,
                       json.dumps(dict(trunk=str(trunk), step=step), indent=2) + "\n")
    logging.info("branched off %s at step %d: its %d metrics records up to that step copied", trunk, step, len(kept))
