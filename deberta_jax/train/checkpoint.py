"""The workdir: resolved config, tokenizer, checkpoints; and `load_workdir`, the way back to a model.

Layout of a workdir:
    config.json          the resolved config (its `model` section is the complete ModelConfig)
    tokenizer.json       the tokenizer the run trained or was given
    checkpoints/<step>/  params + opt_state (orbax); `metrics` holds eval_loss at evaluation steps
    metrics.jsonl, tensorboard/   written by `metrics_io`

A checkpoint holds the parameters, the optimizer state and (as its name) the step. Nothing else is
needed to resume exactly: data order, masks and dropout keys are functions of (seed, step).

Retention: the latest `keep` checkpoints plus the single best by eval loss, in one orbax manager
(`LatestN` or `BestN` preservation). Checkpoints without eval metrics never count as "best".

Saves are synchronous (the train step donates its input state, so a background writer must not
read buffers the next step reuses; a save is rare and small next to the steps between saves).
Orbax writes each checkpoint into a temporary directory and renames it when complete, so an
interrupted save leaves no checkpoint that `latest_step` would pick up; the previous one stays.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from ml_collections import config_dict
from tokenizers import Tokenizer

from deberta_jax.data import tokenizer as tokenizer_lib
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.train.steps import TrainState

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINT_DIR = "checkpoints"
BEST_METRIC = "eval_loss"


def _best_metric(metrics: dict) -> float:
    return metrics[BEST_METRIC]


def checkpoint_manager(workdir: str | Path, keep: int = 1, read_only: bool = False) -> ocp.CheckpointManager:
    """Manager of `workdir/checkpoints`, keeping the latest `keep` plus the best by eval loss."""
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        read_only=read_only,
        create=not read_only,
        save_interval_steps=0 if read_only else 1,
        cleanup_tmp_directories=not read_only,  # remove what an interrupted save left behind
        enable_async_checkpointing=False,
        best_fn=_best_metric,  # lets `best_step()` rank checkpoints and makes `save` record metrics
        best_mode="min",
        preservation_policy=policies.AnyPreservationPolicy([
            policies.LatestN(n=keep),
            policies.BestN(get_metric_fn=_best_metric, reverse=True, n=1, keep_checkpoints_without_metrics=False),
        ]),
    )
    return ocp.CheckpointManager(Path(workdir).absolute() / CHECKPOINT_DIR, options=options)


def save(manager: ocp.CheckpointManager, state: TrainState, eval_metrics: dict | None = None) -> None:
    """Saves params and optimizer state under `state.step`; `eval_metrics` make it a candidate for best."""
    args = ocp.args.Composite(params=ocp.args.StandardSave(state.params),
                              opt_state=ocp.args.StandardSave(state.opt_state))
    metrics = None if eval_metrics is None else {BEST_METRIC: float(eval_metrics[BEST_METRIC])}
    manager.save(int(state.step), args=args, metrics=metrics)


def restore(manager: ocp.CheckpointManager, step: int, abstract_state: TrainState) -> TrainState:
    """Restores a full train state onto the shardings given in `abstract_state` (ShapeDtypeStructs)."""
    restored = manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(abstract_state.params),
        opt_state=ocp.args.StandardRestore(abstract_state.opt_state)))
    step = jax.device_put(np.asarray(step, np.int32), abstract_state.step.sharding)
    return TrainState(step=step, params=restored.params, opt_state=restored.opt_state)


def write_config(workdir: str | Path, config: config_dict.ConfigDict) -> None:
    path = Path(workdir) / CONFIG_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")


def read_config(workdir: str | Path) -> config_dict.ConfigDict:
    path = Path(workdir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {workdir} is not a training workdir (train.py writes "
                                f"{CONFIG_FILE} there at start-up)")
    return config_dict.ConfigDict(json.loads(path.read_text()))


def select_step(manager: ocp.CheckpointManager, step: int | str | None, workdir) -> int:
    """`None` or "latest" -> latest, "best" -> lowest eval loss, int -> that step."""
    available = manager.all_steps()
    if not available:
        raise FileNotFoundError(f"no checkpoint in {Path(workdir) / CHECKPOINT_DIR}: the run has not saved one yet "
                                "(checkpoints are written every config.train.checkpoint_every steps)")
    if step in (None, "latest"):
        return manager.latest_step()
    if step == "best":
        best = manager.best_step()
        if best is None:
            raise FileNotFoundError(f"no checkpoint in {workdir} has an eval loss (was config.data.eval_files empty?); "
                                    "load the latest with step=None")
        return best
    if step not in available:
        raise FileNotFoundError(f"no checkpoint for step {step} in {workdir}; available steps: {sorted(available)}")
    return step


def load_workdir(workdir: str | Path, step: int | str | None = None, **overrides
                 ) -> tuple[config_dict.ConfigDict, MaskedLM, Tokenizer]:
    """Rebuilds `(config, model, tokenizer)` from a training workdir, nothing else needed.

    `step`: None (or "latest") for the latest checkpoint, "best" for the lowest eval loss, or a step number.
    Only the parameters are read (not the optimizer state); they land on the default device.
    `overrides` replace `ModelConfig` fields that leave the parameters as they are, e.g.
    `attention_kernel="blockwise"` to evaluate at lengths whose dense attention would not fit.
    """
    config = read_config(workdir)
    model_config = dataclasses.replace(ModelConfig.from_dict(config.model.to_dict()), **overrides)
    tokenizer = tokenizer_lib.load_tokenizer(Path(workdir) / TOKENIZER_FILE)
    manager = checkpoint_manager(workdir, read_only=True)
    chosen = select_step(manager, step, workdir)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: MaskedLM(model_config, rngs=nnx.Rngs(params=0))))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                   nnx.to_pure_dict(abstract_state))
    restored = manager.restore(chosen, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
    manager.close()
    return config, nnx.merge(graphdef, restored.params), tokenizer
