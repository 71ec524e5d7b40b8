"""Self-attention: the score functions of every attention variant and the module.

The *variant* (how scores are made) is separate from the *kernel* (how masked scores become a
context vector, `deberta_jax.kernels`): `entangled_scores` and `disentangled_scores` are pure
functions of projected tensors, `attention_scores` serves either to a kernel for any subset of keys
(all of them for the dense kernel, one block at a time for the blockwise one), and `SelfAttention`
projects, picks the variant and the kernel. The three DeBERTa terms live in one place,
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

from deberta_jax.kernels import blockwise, dropout
from deberta_jax.model import positions
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.parameters import dense


@dataclasses.dataclass(frozen=True)
class PositionContext:
    """What the embeddings and every attention layer need about positions, built once per forward pass.

    - `position_ids` `[1 or B, N]`: token positions, read by absolute embeddings and RoPE; `0..N-1`
      (numpy), or sampled per sequence when `sampled` (randomized positions in training), in which
      case a learned table reads those rows directly instead of applying the out-of-range policy;
    - `bias` `[H, 2N - 1]`: score bias added by ALiBi and T5 per distance `i - j`
      (`positions.distances`), else None;
    - `rel_embeddings` / `rel_index` (disentangled): the (LayerNorm'd) relative-table rows `[R, hidden]`
      that the current length can reach, and the row for each distance `i - j` (numpy, `[2N - 1]`).
      Projecting only reachable rows keeps short sequences from paying for the whole 2k-row table.
    Position terms are stored per distance, not per (i, j), so a blockwise kernel expands only the
    `[N, block]` slice it needs (`positions.toeplitz`) and memory stays linear in length.
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


def relative_products(x: jax.Array, table: jax.Array) -> jax.Array:
    """`x_n . table[h, r]` for every head, token and relative row: `[B, H, N, d] x [H, R, d] -> [B, H, N, R]`.

    DeBERTa's c2p (queries against position keys) and p2c (keys against position queries). Written as
    one `[B*N, d] x [d, R]` matmul per head, heads leading, rather than the equivalent
    `einsum("bhid,hrd->bhir")`: XLA's CPU backend runs the latter (a batch axis that is not leading
    on one side, shared by the other) 1.6x slower forward and backward (benchmarks/README.md).
    """
    b, h, n, d = x.shape
    rows = jnp.swapaxes(x, 0, 1).reshape(h, b * n, d)
    return jnp.swapaxes(jnp.einsum("hmd,hrd->hmr", rows, table).reshape(h, b, n, -1), 0, 1)


def entangled_scores(q: jax.Array, k: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """`q_i . k_j / sqrt(d)`, plus an additive position `bias` `[H, Nq, Nk]` when given.

    BERT and NoPE (no bias, positions mixed in upstream or absent), RoPE (q, k already rotated),
    ALiBi and T5 (the bias) all score this way; only DeBERTa needs its own function.
    """
    scores = jnp.einsum("bhid,bhjd->bhij", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    return scores if bias is None else scores + bias


def relative_terms(c2p: jax.Array | None, p2c: jax.Array | None, index) -> jax.Array | float:
    """DeBERTa's position terms `q_i.Kr[idx_ij] + k_j.Qr[idx_ij]` for an index `[Nq', Nk']` (0 without terms).

    `c2p` `[B, H, Nq', R]` (`q_i . Kr[r]`) and `p2c` `[B, H, Nk', R]` (`k_j . Qr[r]`) are the products
    with the R reachable table rows, or None when the term is off; `index` holds `idx_ij = bucket(i - j)
    + k` for these queries and keys (see `positions.relative_index_by_distance`). Both terms are
    gathered with `take_along_axis`: `[N, N, d]` relative embeddings are never built. A static (numpy)
    index gets the hand-written gradient of `_relative_terms_static`.
    """
    if c2p is None and p2c is None:
        return 0.0
    if isinstance(index, np.ndarray):
        return _relative_terms_static(c2p, p2c, index)
    return _gather_terms(c2p, p2c, jnp.asarray(index))


def _gather_terms(c2p, p2c, index: jax.Array) -> jax.Array | float:
    terms = 0.0
    if c2p is not None:
        terms = terms + jnp.take_along_axis(c2p, index[None, None], axis=-1)
    if p2c is not None:
        # The term for (i, j) reads row idx_ij of key j's vector: gather [b, h, j, i], then transpose.
        terms = terms + jnp.swapaxes(jnp.take_along_axis(p2c, index.T[None, None], axis=-1), -1, -2)
    return terms


def _relative_terms_static(c2p, p2c, index: np.ndarray) -> jax.Array:
    """`_gather_terms` with a faster p2c gather and a gradient that lays the cotangent out once for both terms.

    The gradient of a gather is a scatter-add. Differentiated automatically, each term's scatter puts
    the (b, h) axes innermost with its own transpose of the `[B, H, Nq, Nk]` cotangent, and p2c's
    (transposed) one is a 3-D permutation that XLA's CPU backend runs slowly. Here one `[Nq, Nk, B, H]`
    transpose feeds both scatter-adds (rows i for c2p, j for p2c), whose `[B, H]` windows are then
    contiguous. Measured in benchmarks/README.md.
    """
    n_q, n_k = index.shape
    query_rows = np.broadcast_to(np.arange(n_q)[:, None], index.shape)
    key_rows = np.broadcast_to(np.arange(n_k)[None, :], index.shape)
    tables = {name: x for name, x in (("c2p", c2p), ("p2c", p2c)) if x is not None}

    @jax.custom_vjp
    def terms(tables):
        # p2c is gathered from its [B, H, R, Nk] transpose, straight into [i, j] order: half the time
        # of gathering [j, i] and transposing, but a slow gradient under autodiff (`_gather_terms`).
        rows = jnp.asarray(index)[None, None]
        out = 0.0
        if "c2p" in tables:
            out = out + jnp.take_along_axis(tables["c2p"], rows, axis=-1)
        if "p2c" in tables:
            out = out + jnp.take_along_axis(jnp.swapaxes(tables["p2c"], -1, -2), rows, axis=-2)
        return out

    def forward(tables):
        return terms(tables), None

    def backward(_, cotangent):
        laid_out = jnp.transpose(cotangent, (2, 3, 0, 1))  # [Nq, Nk, B, H]
        rows = {"c2p": query_rows, "p2c": key_rows}
        grads = {}
        for name, table in tables.items():
            b, h, n, r = table.shape
            grad = jnp.zeros((n, r, b, h), cotangent.dtype).at[rows[name], index].add(laid_out)
            grads[name] = jnp.transpose(grad, (2, 3, 0, 1)).astype(table.dtype)
        return (grads,)

    terms.defvjp(forward, backward)
    return terms(tables)


def banded_relative_terms(c2p: jax.Array | None, p2c: jax.Array | None, rel_index: np.ndarray,
                          key_positions: jax.Array, key_len: int) -> jax.Array | float:
    """`relative_terms` of every query against a block of consecutive keys, gathering only near the diagonal.

    Past some distance the index per distance (`rel_index`, numpy) is constant: the clamped outermost
    bucket (or transformers' clipped row). For those pairs the terms are `c2p[i, row] + p2c[j, row]`,
    a broadcast; only the band of queries within that distance of the block is gathered. A model
    trained at length T and evaluated at 8T gathers about `(block + 2T) / 8T` of what a full gather
    does. Falls back to `relative_terms` when the band spans every query (short sequences, the dense
    kernel's single block of all keys).
    """
    if c2p is None and p2c is None:
        return 0.0
    n_q = rel_index.shape[0] - key_len + 1
    block = key_positions.shape[0]
    distance = positions.distances(n_q, key_len)
    not_hi, not_lo = np.flatnonzero(rel_index != rel_index[-1]), np.flatnonzero(rel_index != rel_index[0])
    width = n_q  # no band when the index is the same at every distance
    if not_hi.size:
        # The index is rel_index[-1] for i - j >= d_hi and rel_index[0] for i - j <= d_lo.
        d_hi, d_lo = int(distance[not_hi[-1] + 1]), int(distance[not_lo[0] - 1])
        width = block + d_hi - d_lo - 2
    if isinstance(key_positions, np.ndarray) or width >= n_q:
        return relative_terms(c2p, p2c, positions.toeplitz(rel_index, np.arange(n_q), key_positions, key_len))

    def outer(row):  # the terms of every pair whose index is `row`
        return ((0.0 if c2p is None else c2p[..., row][..., :, None])
                + (0.0 if p2c is None else p2c[..., row][..., None, :]))

    pair_distance = jnp.arange(n_q)[:, None] - key_positions[None, :]
    far = jnp.where(pair_distance >= d_hi, outer(rel_index[-1]), outer(rel_index[0]))
    start = jnp.clip(key_positions[0] + d_lo + 1, 0, n_q - width)  # the band: d_lo < i - j < d_hi
    band_index = positions.toeplitz(rel_index, start + jnp.arange(width), key_positions, key_len)
    band_c2p = None if c2p is None else jax.lax.dynamic_slice_in_dim(c2p, start, width, axis=2)
    band = relative_terms(band_c2p, p2c, band_index)
    return jax.lax.dynamic_update_slice_in_dim(far, band.astype(far.dtype), start, axis=2)


def disentangled_scores(q: jax.Array, k: jax.Array, terms: jax.Array | float, num_terms: int) -> jax.Array:
    """DeBERTa: `(q_i.k_j + q_i.Kr[idx_ij] + k_j.Qr[idx_ij]) / sqrt(d * (1 + n_pos_terms))`, with the
    position terms from `relative_terms` (or `banded_relative_terms`) and `num_terms` of them in use."""
    scale = math.sqrt(q.shape[-1] * (1 + num_terms))
    scores = jnp.einsum("bhid,bhjd->bhij", q, k) + terms
    return scores / jnp.asarray(scale, scores.dtype)


def attention_scores(shared: dict, keys: dict, key_positions, *, key_len: int,
                     rel_index: np.ndarray | None = None) -> jax.Array:
    """Scores of every query (positions `0..Nq-1`) against the keys at `key_positions`: the score
    function every kernel calls (see `deberta_jax.kernels`).

    `shared` holds `q` `[B, H, Nq, d]` and, by variant, `c2p` `[B, H, Nq, R]` (DeBERTa) or a per-distance
    `bias` `[H, Nq + key_len - 1]` (ALiBi, T5); `keys` holds `k` `[B, H, nk, d]` and, for DeBERTa's
    p2c, `p2c` `[B, H, nk, R]`, for the `nk` keys at `key_positions`. `rel_index` (per distance, numpy)
    selects the disentangled variant; without it the scores are the (biased) dot product.
    """
    q = shared["q"]
    query_positions = np.arange(q.shape[-2])
    if rel_index is None:
        bias = shared.get("bias")
        if bias is not None:
            bias = positions.toeplitz(bias, query_positions, key_positions, key_len)
        return entangled_scores(q, keys["k"], bias)
    c2p, p2c = shared.get("c2p"), keys.get("p2c")
    terms = banded_relative_terms(c2p, p2c, rel_index, key_positions, key_len)
    return disentangled_scores(q, keys["k"], terms, (c2p is not None) + (p2c is not None))


@dataclasses.dataclass(frozen=True, eq=False)
class ScoreFunction:
    """`attention_scores` for one layer's key length and variant, as the kernels call it.

    A plain callable for the dense and blockwise kernels; the fused Pallas kernel scores tiles itself
    and reads the variant from `rel_index` (disentangled when set) and the tensors it is given.
    """

    key_len: int
    rel_index: np.ndarray | None = None

    def __call__(self, shared: dict, keys: dict, key_positions) -> jax.Array:
        return attention_scores(shared, keys, key_positions, key_len=self.key_len, rel_index=self.rel_index)


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
        self.pos_dropout = dropout.Dropout(cfg.hidden_dropout)

    def _relative_projections(self, ctx: PositionContext, rngs):
        """Project the reachable relative rows into per-head position queries/keys `[H, R, d]`."""
        cfg = self.cfg
        table = self.pos_dropout(ctx.rel_embeddings, rngs)
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
        shared, keys, rel_index = {"q": q}, {"k": k}, None
        if cfg.attention == "disentangled":
            pos_q, pos_k = self._relative_projections(ctx, rngs) if cfg.pos_att_type else (None, None)
            if pos_k is not None:
                shared["c2p"] = relative_products(q, pos_k)
            if pos_q is not None:
                keys["p2c"] = relative_products(k, pos_q)
            rel_index = ctx.rel_index
        else:
            if cfg.attention == "rope":
                ids = ctx.position_ids[:, None]  # [1 or B, 1, N] against [B, H, N, d]
                shared["q"] = positions.apply_rope(q, ids, cfg.rope_theta)
                keys["k"] = positions.apply_rope(k, ids, cfg.rope_theta)
            if ctx.bias is not None:
                shared["bias"] = ctx.bias
        score_fn = ScoreFunction(key_len=k.shape[-2], rel_index=rel_index)
        dropout_key = rngs.dropout() if rngs is not None and cfg.attention_dropout > 0 else None
        kernel = blockwise.attention_kernel(cfg.attention_kernel, cfg.attention_block_size)
        return merge_heads(kernel(score_fn, shared, keys, v, key_mask,
                                  dropout_rate=cfg.attention_dropout, dropout_key=dropout_key))
