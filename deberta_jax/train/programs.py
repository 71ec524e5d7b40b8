"""A run's jitted programs, built once from its config and a device mesh: init, train step, eval step.

`train.py` runs them on the devices it has; `deberta_jax.aot` lowers and compiles the very same objects for a TPU
slice it does not have, so what it reports about memory and cost is about the program a run executes (same
optimizer, shardings, donation and kernels), not a re-creation of it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from ml_collections import config_dict

from deberta_jax.model.config import ModelConfig
from deberta_jax.train import optim, sharding, steps

# What a batch holds (`deberta_jax.data.batches.Batch`): every field is `[rows, seq_len]`.
BATCH_DTYPES = dict(input_ids=jnp.int32, attention_mask=jnp.int32, labels=jnp.int32, weights=jnp.float32)


@dataclasses.dataclass(frozen=True)
class RunPrograms:
    """The jitted functions of a run and the shardings they were jitted with.

    - `init()`: the initial `TrainState`, created where `state_sharding` puts it;
    - `train_step(state, batch) -> (state, metrics)`: one optimizer update; the state is donated;
    - `eval_step(params, batch) -> sums`: masked-LM sums of one evaluation batch.
    Both score each device's masked positions on that device (`steps.masked_lm_sums`' groups).
    """

    init: Callable
    train_step: Callable
    eval_step: Callable
    abstract_state: steps.TrainState
    state_sharding: steps.TrainState
    batch_sharding: NamedSharding


def _traced_on(mesh: Mesh, fn):
    """`fn` traced with `mesh` as the context mesh: a kernel XLA cannot partition by itself (the fused TPU kernel)
    reads it to split its call over the batch (`shard_map`)."""
    @functools.wraps(fn)
    def traced(*args):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args)
    return traced


def build(config: config_dict.ConfigDict, model_config: ModelConfig, mesh: Mesh) -> RunPrograms:
    """The programs of `config` (validated) with `model_config` (its vocabulary resolved) on `mesh`."""
    train_cfg = config.train
    schedule = optim.learning_rate_schedule(train_cfg.learning_rate, train_cfg.warmup_steps,
                                            train_cfg.num_steps, train_cfg.schedule)
    optimizer = optim.make_optimizer(train_cfg, schedule, model_config)
    graphdef = steps.model_graphdef(model_config)
    init_fn = steps.make_init_fn(model_config, optimizer, config.seed)
    abstract_state = jax.eval_shape(init_fn)
    replicated = sharding.replicated(mesh)
    state_sharding = sharding.state_sharding(mesh, abstract_state)  # replicated unless config.mesh.fsdp > 1
    batch_sharding = sharding.batch_sharding(mesh)
    train_step = jax.jit(
        _traced_on(mesh, steps.make_train_step(graphdef, optimizer, schedule, seed=config.seed,
                                               grad_accum_steps=train_cfg.grad_accum_steps,
                                               mask_prob=config.data.mask_prob, head_groups=mesh.size)),
        in_shardings=(state_sharding, batch_sharding), out_shardings=(state_sharding, replicated),
        donate_argnums=0)
    eval_step = jax.jit(_traced_on(mesh, steps.make_eval_step(graphdef, mask_prob=config.data.mask_prob,
                                                              head_groups=mesh.size)),
                        in_shardings=(state_sharding.params, batch_sharding), out_shardings=replicated)
    return RunPrograms(init=jax.jit(init_fn, out_shardings=state_sharding), train_step=train_step,
                       eval_step=eval_step, abstract_state=abstract_state, state_sharding=state_sharding,
                       batch_sharding=batch_sharding)


def abstract_batch(rows: int, seq_len: int, batch_sharding: NamedSharding) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes, dtypes and sharding of a global batch of `rows` sequences (what `lower` needs)."""
    return {name: jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=batch_sharding)
            for name, dtype in BATCH_DTYPES.items()}


def abstract_with_sharding(tree, shardings):
    """`tree`'s shapes and dtypes with `shardings` attached: the arguments `jit(...).lower` compiles for."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
