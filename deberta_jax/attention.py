"""Self-attention: the score functions of every attention variant, the softmax kernel, and the module.

The *variant* (how scores are made) is separate from the *kernel* (how masked scores become a
context vector): `entangled_scores` and `disentangled_scores` are pure functions of projected
tensors, and `dense_attention` turns scores into outputs. The three DeBERTa terms live in one place,
`disentangled_scores`. The literature baselines reuse the dot product: RoPE rotates q and k first
(`positions.apply_rope`), ALiBi and T5 add a position bias to it.

Layout: queries/keys/values are `[B, H, N, d]`; projected relative tables are `[H, R, d]` where R is
the number of relative-table rows this sequence length can reach (see `PositionContext`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deberta_jax import positions
from deberta_jax.config import ModelConfig
from deberta_jax.layers import dense

NEG_INF = float(np.finfo(np.float32).min)


@dataclasses.dataclass(frozen=True)
class PositionContext:
    """What the embeddings and every attention layer need about positions, built once per forward pass.

    - `position_ids` `[1 or B, N]`: token positions, read by absolute embeddings and RoPE; `0..N-1`
      (numpy), or sampled per sequence when `sampled` (randomized positions in training), in which
      case a learned table reads those rows directly instead of applying the out-of-range policy;
    - `bias` `[H, N, N]`: score bias added by ALiBi and T5, else None;
    - `rel_embeddings` / `rel_index` (disentangled): the (LayerNorm'd) relative-table rows `[R, hidden]`
      that the current length can reach, and `rel_index[i, j]` (numpy, `[N, N]`) pointing into them.
      Projecting only reachable rows keeps short sequences from paying for the whole 2k-row table.
    """

    position_ids: jax.Array | np.ndarray
    sampled: bool = False
    bias: jax.Array | None = None
    rel_embeddings: jax.Array | None = None
    rel_index: np.ndarray | None = None


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """[..., N, H*d] -> [..., H, N, d]."""
    *lead, n, hd = x.shape
    x = x.reshape(*lead, n, num_heads, hd // num_heads)
    return jnp.swapaxes(x, -2, -3)


def merge_heads(x: jax.Array) -> jax.Array:
    """[B, H, N, d] -> [B, N, H*d]."""
    b, h, n, d = x.shape
    return jnp.swapaxes(x, 1, 2).reshape(b, n, h * d)


def entangled_scores(q: jax.Array, k: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """`q_i . k_j / sqrt(d)`, plus an additive position `bias` `[H, Nq, Nk]` when given.

    BERT and NoPE (no bias, positions mixed in upstream or absent), RoPE (q, k already rotated),
    ALiBi and T5 (the bias) all score this way; only DeBERTa needs its own function.
    """
    scores = jnp.einsum("bhid,bhjd->bhij", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    return scores if bias is None else scores + bias


def disentangled_scores(
    q: jax.Array,
    k: jax.Array,
    pos_q: jax.Array | None,
    pos_k: jax.Array | None,
    index: np.ndarray,
    pos_att_type: tuple[str, ...],
) -> jax.Array:
    """DeBERTa: `(q_i.k_j + q_i.Kr[idx_ij] + k_j.Qr[idx_ij]) / sqrt(d * (1 + n_pos_terms))`.

    c2p and p2c are computed as `[B, H, N, R]` products against the R reachable table rows and then
    gathered with `take_along_axis`; `[N, N, d]` relative embeddings are never materialized. Both
    terms use the same index `idx_ij = bucket(i - j) + k` (see `positions.relative_index`).
    """
    n_q, n_k = q.shape[-2], k.shape[-2]
    scale = math.sqrt(q.shape[-1] * (1 + len(pos_att_type)))
    scores = jnp.einsum("bhid,bhjd->bhij", q, k)
    if "c2p" in pos_att_type:
        c2p = jnp.einsum("bhid,hrd->bhir", q, pos_k)
        scores = scores + jnp.take_along_axis(c2p, jnp.asarray(index)[None, None], axis=-1)
    if "p2c" in pos_att_type:
        # p2c[b, h, j, r] = k_j . Qr[r]; the score for (i, j) reads row idx_ij of key j's vector.
        p2c = jnp.einsum("bhjd,hrd->bhjr", k, pos_q)
        gathered = jnp.take_along_axis(p2c, jnp.asarray(index.T)[None, None], axis=-1)  # [b, h, j, i]
        scores = scores + jnp.swapaxes(gathered, -1, -2)
    assert scores.shape[-2:] == (n_q, n_k)
    return scores / jnp.asarray(scale, scores.dtype)


def dense_attention(
    scores: jax.Array,
    key_mask: jax.Array,
    v: jax.Array,
    dropout: nnx.Dropout,
    rngs: nnx.Rngs | None,
) -> jax.Array:
    """Masked softmax over keys in float32, dropout on the probabilities, weighted sum of values.

    `key_mask` is `[B, N]` (1 = real token). Only keys are masked: outputs at real tokens do not
    depend on how much padding follows, which is what makes padded batches safe.
    """
    scores = scores.astype(jnp.float32)
    scores = jnp.where(key_mask[:, None, None, :].astype(bool), scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = dropout(probs, deterministic=rngs is None, rngs=rngs)
    return jnp.einsum("bhij,bhjd->bhid", probs.astype(v.dtype), v)


class SelfAttention(nnx.Module):
    """Multi-head self-attention of any variant, with the projections named as in DeBERTa."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.hidden_size
        self.query_proj = dense(cfg, h, h, rngs)
        self.key_proj = dense(cfg, h, h, rngs)
        self.value_proj = dense(cfg, h, h, rngs)
        separate = cfg.attention == "disentangled" and not cfg.share_att_key
        self.pos_key_proj = dense(cfg, h, h, rngs) if separate and "c2p" in cfg.pos_att_type else None
        self.pos_query_proj = dense(cfg, h, h, rngs) if separate and "p2c" in cfg.pos_att_type else None
        self.pos_dropout = nnx.Dropout(cfg.hidden_dropout)
        self.dropout = nnx.Dropout(cfg.attention_dropout)

    def _relative_projections(self, ctx: PositionContext, rngs):
        """Project the reachable relative rows into per-head position queries/keys `[H, R, d]`."""
        cfg = self.cfg
        table = self.pos_dropout(ctx.rel_embeddings, deterministic=rngs is None, rngs=rngs)
        key_proj = self.key_proj if cfg.share_att_key else self.pos_key_proj
        query_proj = self.query_proj if cfg.share_att_key else self.pos_query_proj
        pos_k = split_heads(key_proj(table), cfg.num_heads) if "c2p" in cfg.pos_att_type else None
        pos_q = split_heads(query_proj(table), cfg.num_heads) if "p2c" in cfg.pos_att_type else None
        return pos_q, pos_k

    def __call__(
        self,
        hidden: jax.Array,
        key_mask: jax.Array,
        ctx: PositionContext,
        query_states: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        """`hidden` gives keys and values; `query_states` (default `hidden`) gives queries (EMD)."""
        cfg = self.cfg
        query_states = hidden if query_states is None else query_states
        q = split_heads(self.query_proj(query_states), cfg.num_heads)
        k = split_heads(self.key_proj(hidden), cfg.num_heads)
        v = split_heads(self.value_proj(hidden), cfg.num_heads)
        if cfg.attention == "disentangled":
            pos_q, pos_k = self._relative_projections(ctx, rngs) if cfg.pos_att_type else (None, None)
            scores = disentangled_scores(q, k, pos_q, pos_k, ctx.rel_index, cfg.pos_att_type)
        else:
            if cfg.attention == "rope":
                ids = ctx.position_ids[:, None]  # [1 or B, 1, N] against [B, H, N, d]
                q = positions.apply_rope(q, ids, cfg.rope_theta)
                k = positions.apply_rope(k, ids, cfg.rope_theta)
            scores = entangled_scores(q, k, ctx.bias)
        return merge_heads(dense_attention(scores, key_mask, v, self.dropout, rngs))
