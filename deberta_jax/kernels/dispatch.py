"""The kernel a config names (`ModelConfig.attention_kernel`): one call signature for all of them,
`kernel(terms, v, key_mask, *, dropout_rate, dropout_key) -> [B, H, Nq, d]`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from deberta_jax.kernels.blockwise import blockwise_attention
from deberta_jax.kernels.dense import dense_attention

# The fused kernels: `pallas` implements neither attention dropout nor the length-aware options (window,
# temperature; `ModelConfig` refuses them with it); `pallas_tpu` implements both.
KERNELS = ("dense", "blockwise", "pallas", "pallas_tpu")


def attention_kernel(name: str, block_size: int) -> Callable[..., jax.Array]:
    """`dense`, `blockwise` (blocks of `block_size` keys), `pallas` (its forward pass fused for GPUs) or
    `pallas_tpu` (forward and backward fused for TPUs; DeBERTa's terms from the projected tables)."""
    if name == "dense":
        return dense_attention
    if name == "blockwise":
        return functools.partial(blockwise_attention, block_size=block_size)
    if name == "pallas":
        # Imported on demand: only this kernel needs Pallas and its Triton lowering.
        from deberta_jax.kernels.pallas import pallas_attention
        return functools.partial(pallas_attention, block_size=block_size)
    if name == "pallas_tpu":
        from deberta_jax.kernels.pallas_tpu import pallas_tpu_attention
        return pallas_tpu_attention
    raise ValueError(f"unknown attention kernel {name!r}; choose one of {KERNELS}")
