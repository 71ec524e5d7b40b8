"""The dense kernel: every key at once, `[B, H, Nq, Nk]` scores and probabilities in memory.

The fastest kernel while the scores fit; memory quadratic in length (the blockwise kernel is linear).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deberta_jax.kernels import dropout_masks
from deberta_jax.kernels.scores import ScoreTerms, mask_keys


def peak_bytes(batch: int, heads: int, query_len: int, key_len: int) -> int:
    """Memory the dense kernel's largest intermediates take: float32 scores and probabilities of shape
    `[B, H, Nq, Nk]`, both live at the softmax (what XLA allocates for them, observed on CPU)."""
    return 2 * 4 * batch * heads * query_len * key_len


def dense_attention(terms: ScoreTerms, v: jax.Array, key_mask: jax.Array, *, dropout_rate: float = 0.0,
                    dropout_key: jax.Array | None = None, sigmoid_bias: float | None = None) -> jax.Array:
    """Softmax over all `Nk` keys; `v` `[B, H, Nk, d]`, `key_mask` `[B, Nk]` (1 = real token) -> `[B, H, Nq, d]`.

    With `sigmoid_bias` each key weighs `sigmoid(score + sigmoid_bias)` instead, whatever the other keys score
    (`ModelConfig.attention_weights`); masked keys weigh 0.
    The weights are computed in float32 and only keys are masked, so outputs at real tokens do not depend on padding.
    Dropout (when `dropout_key` is given) draws the mask of every (sequence, head, query, key) from their
    positions (`dropout_masks.attention_keep`), the mask the blockwise and fused TPU kernels draw too.
    """
    scores = terms.scores(np.arange(v.shape[-2])).astype(jnp.float32)
    scores = mask_keys(scores, key_mask[:, None, None, :].astype(bool))
    probs = jax.nn.softmax(scores, axis=-1) if sigmoid_bias is None else jax.nn.sigmoid(scores + sigmoid_bias)
    if dropout_key is not None and dropout_rate > 0:
        b, h, n_q, n_k = probs.shape
        hashes = dropout_masks.attention_hashes(dropout_key, b, h, np.arange(n_q), np.arange(n_k))
        probs = dropout_masks.apply(probs, dropout_masks.attention_keep(*hashes, dropout_rate), dropout_rate)
    return jnp.einsum("bhij,bhjd->bhid", probs.astype(v.dtype), v)
