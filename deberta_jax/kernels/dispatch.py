"""The kernel a config names (`ModelConfig.attention_kernel`): one call signature for all of them,
`kernel(terms, v, key_mask, *, dropout_rate, dropout_key) -> [B, H, Nq, d]`."""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from deberta_jax.kernels.blockwise import blockwise_attention
from deberta_jax.kernels.dense import dense_attention

# The fused kernels, `pallas` (GPUs) and `pallas_tpu`, carry every variant, attention dropout and the length options.
# `cudnn` is the anchor for variants without position terms in the scores (BERT): jax.nn.dot_product_attention.
KERNELS = ("dense", "blockwise", "pallas", "pallas_tpu", "cudnn")
# The kernels that can weigh keys by a sigmoid of their scores instead of a softmax (`ModelConfig.attention_weights`).
SIGMOID_KERNELS = ("dense", "blockwise")


def attention_kernel(name: str, block_size: int, sigmoid_bias: float | None = None) -> Callable[..., jax.Array]:
    """`dense`, `blockwise` (blocks of `block_size` keys), `pallas` (forward and backward fused for GPUs) or
    `pallas_tpu` (for TPUs); the fused kernels take DeBERTa's projected tables, not its products.

    `sigmoid_bias` (None: a softmax over keys) weighs each key by `sigmoid(score + sigmoid_bias)` instead, which
    only the kernels in `SIGMOID_KERNELS` do.
    """
    if sigmoid_bias is not None and name not in SIGMOID_KERNELS:
        raise ValueError(f"the {name!r} kernel normalizes scores with a softmax only; sigmoid weights need one of "
                         f"{SIGMOID_KERNELS}")
    if name == "dense":
        return functools.partial(dense_attention, sigmoid_bias=sigmoid_bias)
    if name == "blockwise":
        return functools.partial(blockwise_attention, block_size=block_size, sigmoid_bias=sigmoid_bias)
    if name == "pallas":
        # Imported on demand: only the fused kernels need Pallas.
        from deberta_jax.kernels.pallas import pallas_attention
        return pallas_attention
    if name == "cudnn":
        from deberta_jax.kernels.cudnn import cudnn_attention
        return cudnn_attention
    if name == "pallas_tpu":
        from deberta_jax.kernels.pallas_tpu import pallas_tpu_attention
        return pallas_tpu_attention
    raise ValueError(f"unknown attention kernel {name!r}; choose one of {KERNELS}")
