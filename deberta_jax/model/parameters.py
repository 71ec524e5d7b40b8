"""Parameter-building helpers shared by the attention and model modules.

All weights are float32 and initialized as in BERT/DeBERTa (normal with `initializer_range`, zero
biases, unit LayerNorm scale); `cfg.dtype` only sets the compute dtype of the matmuls. Each declares whether
weight decay applies to it (`train.optim`): a dense layer's kernel does, nothing else here does.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from deberta_jax.model.config import ModelConfig

# The `weight_decay` metadata every parameter declares (`train.optim.weight_decay_mask`).
DECAYED, UNDECAYED = {"weight_decay": True}, {"weight_decay": False}


def dense(cfg: ModelConfig, n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        n_in, n_out, dtype=jnp.dtype(cfg.dtype), param_dtype=jnp.float32,
        kernel_init=nnx.initializers.normal(cfg.initializer_range), rngs=rngs,
        kernel_metadata=DECAYED, bias_metadata=UNDECAYED,
    )


def layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
    """LayerNorm whose statistics and output are float32 whatever the compute dtype."""
    return nnx.LayerNorm(cfg.hidden_size, epsilon=cfg.layer_norm_eps, dtype=jnp.float32, rngs=rngs,
                         scale_metadata=UNDECAYED, bias_metadata=UNDECAYED)


def table(cfg: ModelConfig, rows: int, rngs: nnx.Rngs) -> nnx.Param:
    """An embedding table `[rows, hidden]` kept as a raw Param so callers index it explicitly."""
    init = nnx.initializers.normal(cfg.initializer_range)
    return nnx.Param(init(rngs.params(), (rows, cfg.hidden_size), jnp.float32), **UNDECAYED)
