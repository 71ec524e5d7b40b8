"""BERT's attention through `jax.nn.dot_product_attention`: cuDNN's fused kernel on NVIDIA GPUs, XLA's elsewhere.

The anchor the fused DeBERTa kernels are measured against: the attention a BERT trained on GPUs would use. cuDNN's
kernel scores queries against keys only, so it serves the variants whose positions are not in the scores (BERT,
NoPE, RoPE's rotated queries and keys), without attention dropout (the JAX call has none), a window or a
temperature; `ModelConfig` refuses the rest. Padding reaches it as each row's count of real keys, which is exact for
rows whose real tokens come first, as packed rows' do (`data.packing`); elsewhere the mask itself is applied.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deberta_jax.kernels.scores import ScoreTerms


def cudnn_attention(terms: ScoreTerms, v: jax.Array, key_mask: jax.Array, *, dropout_rate: float = 0.0,
                    dropout_key: jax.Array | None = None) -> jax.Array:
    """Attention of queries and keys alone (`[B, H, N, d]`), `key_mask` `[B, N]` real tokens first."""
    if terms.relative is not None or terms.bias is not None or terms.temperature is not None or terms.window:
        raise ValueError("attention_kernel='cudnn' scores queries against keys only: no relative terms, bias, "
                         "temperature or window; use 'dense', 'blockwise' or 'pallas' with them")
    if dropout_key is not None and dropout_rate > 0:
        raise ValueError(f"attention_kernel='cudnn' has no attention dropout, but attention_dropout={dropout_rate} "
                         "in training; set model.attention_dropout=0 or use 'pallas'")
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (terms.q, terms.k, v))  # [B, N, H, d], the call's layout

    def fused(q, k, v, key_mask):
        lengths = jnp.sum(key_mask != 0, axis=-1).astype(jnp.int32)
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths, implementation="cudnn")

    def reference(q, k, v, key_mask):
        return jax.nn.dot_product_attention(q, k, v, mask=(key_mask != 0)[:, None, None, :], implementation="xla")

    out = jax.lax.platform_dependent(q, k, v, key_mask, cuda=fused, default=reference)
    return jnp.swapaxes(out, 1, 2)
