"""Attention scores from their terms: the one place that says what a score is, for every variant and kernel.

`ScoreTerms` is a pytree of what a layer's scores are made of:
  - `q` `[B, H, Nq, d]` and `k` `[B, H, Nk, d]`: queries and keys (RoPE's already rotated);
  - `c2p` `[B, H, Nq, R]` (`q_i . Kr[r]`) and `p2c` `[B, H, Nk, R]` (`k_j . Qr[r]`): DeBERTa's content-to-position
    and position-to-content products with the R reachable rows of the relative table, and `relative`, the row
    for each distance `i - j` (a static `RelativeIndex`);
  - `bias` `[H, Nq + Nk - 1]`: an additive bias per distance (a bias scheme's, `model.biases`), or
    `[B, H, Nq + Nk - 1]` with a row axis (a bias that depends on the row); the dense and blockwise kernels take
    either, the fused kernels one per head and distance;
  - `temperature` `[B, 1 or H, Nq, 1]`: a factor per query (and head, when learned) on its whole score row
    (length-aware attention), and `window`: how many positions around each query it may attend to (0: all; see
    `window_starts`), besides the `global_keys` `[B, 1, Nk]` (bool, or None) every query sees.
The score is, for every variant,

    A[i, j] = t_i * ((q_i . k_j + c2p[i, idx(i - j)] + p2c[j, idx(i - j)]) / sqrt(d * (1 + number of position terms))
                     + bias[i - j])

with `t_i = 1` without a temperature, and keys outside query i's window (and not global) masked like padding.

(BERT, NoPE and RoPE have neither position term nor bias; DeBERTa's terms are off one by one in the ablations).
`combine_scores` writes that formula once and `mask_keys` the key-masking rule; the dense and blockwise kernels
call `ScoreTerms.scores`, the fused Pallas kernel computes the dot product and the gathers inside a tile and then
calls the same two functions.

Kernels cut the key side (`k`, `p2c`, whose third axis is the key axis) into blocks and keep the query side
(`q`, `c2p`, `bias`) whole: `key_side` and `with_keys` are that split. Position terms are stored per distance,
not per (i, j), so a block of keys expands only the `[Nq, block]` slice it needs (`toeplitz`) and memory stays
linear in length; `[N, N, d]` relative embeddings are never built.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

# The score of a masked key: the float32 minimum, so that a row whose real keys are all masked still averages
# them uniformly (as BERT and DeBERTa do); keys past the real length (blocks' padding) score -inf instead.
NEG_INF = float(np.finfo(np.float32).min)


def distances(query_len: int, key_len: int) -> np.ndarray:
    """Every `i - j` of a `[query_len, key_len]` score matrix in increasing order (int32, `query_len + key_len - 1`).

    A Toeplitz quantity (one that depends on `i - j` only) is stored as a vector over these distances
    (entry `i - j + key_len - 1`) and expanded with `toeplitz`: `O(N)` memory and work to build
    instead of `O(N^2)`, and blockwise attention reads only the entries a block of keys needs.
    """
    return np.arange(-(key_len - 1), query_len, dtype=np.int32)


def toeplitz(table, query_positions, key_positions, key_len: int):
    """Expand a per-distance `table` `[..., query_len + key_len - 1]` to `[..., Nq', Nk']` for the given
    query and key positions (entry `[..., a, b]` = `table[..., q_a - k_b + key_len - 1]`).

    Numpy in, numpy out (a constant of the traced program); traced positions (a block of keys inside
    a loop) give a jnp gather. Positions must lie in `[0, query_len)` / `[0, key_len)`.
    """
    index = query_positions[:, None] - key_positions[None, :] + (key_len - 1)
    if isinstance(table, np.ndarray) and isinstance(index, np.ndarray):
        return table[..., index]
    return jnp.take(jnp.asarray(table), index, axis=-1)


def combine_scores(dot, relative, bias, divisor: float, temperature=None):
    """The score formula: `temperature * ((q.k + position terms) / divisor + bias)`, with `relative` 0 and `bias`,
    `temperature` None when absent."""
    scores = (dot + relative) / jnp.asarray(divisor, jnp.result_type(dot))
    scores = scores if bias is None else scores + bias
    return scores if temperature is None else scores * temperature.astype(scores.dtype)


def window_starts(query_len: int, key_len: int, window: int) -> np.ndarray:
    """First key position of each query's window of `window` consecutive positions (int32 `[query_len]`).

    Centered (`window // 2` positions before the query) and shifted at either end so that it stays inside the
    `key_len` positions: every query of a row of at least `window` positions sees exactly `window` of them, as a
    query does in training at that length, and a row of at most `window` positions is attended whole.
    """
    return np.clip(np.arange(query_len) - window // 2, 0, max(key_len - window, 0)).astype(np.int32)


def in_window(query_len: int, key_len: int, window: int, key_positions):
    """`[query_len, nk]` bool: whether each key (at `key_positions`, numpy or traced) is inside each query's window."""
    start = window_starts(query_len, key_len, window)[:, None]
    lib = np if isinstance(key_positions, np.ndarray) else jnp
    return lib.logical_and(key_positions[None, :] >= start, key_positions[None, :] < start + window)


def row_ends(mask) -> tuple[jax.Array, jax.Array]:
    """Each row's first and last marked positions (`[B]` each) of a `[B, N]` mask: a packed row's [CLS] and
    closing [SEP] for a key mask, a window's global keys for `ScoreTerms.global_keys`."""
    mask = jnp.asarray(mask).astype(bool)
    return jnp.argmax(mask, axis=-1), mask.shape[-1] - 1 - jnp.argmax(mask[:, ::-1], axis=-1)


def mask_keys(scores, real, in_range=None):
    """Masked keys (`real` False) score `NEG_INF`; keys outside the sequence (`in_range` False) score -inf.

    `real` and `in_range` broadcast against the key axis of `scores` (the last).
    """
    scores = jnp.where(real, scores, NEG_INF)
    return scores if in_range is None else jnp.where(in_range, scores, -jnp.inf)


@dataclasses.dataclass(frozen=True, eq=False)
class RelativeIndex:
    """The relative-table row read at each distance `i - j` (numpy int32 `[Nq + Nk - 1]`, in `distances` order).

    A static part of `ScoreTerms` (it becomes constants of the traced program), compared by identity: one object
    is built per forward pass and shared by every layer.
    """

    by_distance: np.ndarray


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class ScoreTerms:
    """The terms of one attention layer's scores (see the module docstring); a pytree whose arrays are leaves."""

    q: jax.Array
    k: jax.Array | None
    c2p: jax.Array | None = None
    p2c: jax.Array | None = None
    bias: jax.Array | None = None
    # Instead of c2p / p2c: the projected relative rows themselves, `[H, R, d]` position keys (c2p) and queries
    # (p2c), for `shifted_relative_terms` (every query against every key, the dense kernel).
    pos_key: jax.Array | None = None
    pos_query: jax.Array | None = None
    temperature: jax.Array | None = None  # [B, 1 or H, Nq, 1]: query side, like q
    global_keys: jax.Array | None = None  # [B, 1, Nk] bool: keys outside the window that every query sees
    relative: RelativeIndex | None = dataclasses.field(default=None, metadata=dict(static=True))
    # The bucket per distance of a bias read from a table (T5's; None for ALiBi's): a kernel that forms the bias's
    # gradient per distance itself (`kernels.pallas`) needs to know past which distance every bucket is the same.
    bias_index: RelativeIndex | None = dataclasses.field(default=None, metadata=dict(static=True))
    key_len: int = dataclasses.field(default=0, metadata=dict(static=True))  # Nk of the whole sequence
    window: int = dataclasses.field(default=0, metadata=dict(static=True))  # 0: every key

    @property
    def num_position_terms(self) -> int:
        return (self.c2p is not None or self.pos_key is not None) + (self.p2c is not None or self.pos_query is not None)

    @property
    def divisor(self) -> float:
        """`sqrt(d * (1 + number of position terms))`: DeBERTa's scale, BERT's `sqrt(d)` without position terms."""
        return math.sqrt(self.q.shape[-1] * (1 + self.num_position_terms))

    def key_side(self) -> dict:
        """The leaves indexed by key (third axis): what a blockwise kernel cuts into blocks."""
        return {"k": self.k, "p2c": self.p2c, "global_keys": self.global_keys}

    def with_keys(self, keys: dict) -> ScoreTerms:
        """These terms with the key side replaced (a block of keys, or None to keep only the query side)."""
        return dataclasses.replace(self, **keys)

    def scores(self, key_positions) -> jax.Array:
        """Scores `[B, H, Nq, nk]` of every query against the `nk` keys of the key side, which sit at
        `key_positions` (numpy for all keys at once, traced for a block inside a loop)."""
        dot = jnp.einsum("bhid,bhjd->bhij", self.q, self.k)
        relative = 0.0
        if self.relative is not None and (self.pos_key is not None or self.pos_query is not None):
            if not (isinstance(key_positions, np.ndarray) and len(key_positions) == self.key_len == self.q.shape[-2]):
                raise ValueError("position tables (ScoreTerms.pos_key / pos_query) score every query against every "
                                 "key at once; a kernel that cuts keys into blocks needs the c2p / p2c products")
            relative = shifted_relative_terms(self.q, self.k, self.pos_key, self.pos_query,
                                              self.relative.by_distance)
        elif self.relative is not None:
            relative = banded_relative_terms(self.c2p, self.p2c, self.relative.by_distance, key_positions,
                                             self.key_len)
        n_q = self.q.shape[-2]
        bias = None
        if self.bias is not None:
            bias = toeplitz(self.bias, np.arange(n_q), key_positions, self.key_len)
        scores = combine_scores(dot, relative, bias, self.divisor, self.temperature)
        if self.window and self.window < self.key_len:
            visible = in_window(n_q, self.key_len, self.window, key_positions)
            if self.global_keys is not None:
                visible = visible | self.global_keys[:, :, None, :]
            scores = jnp.where(visible, scores, NEG_INF)
        return scores


# ----------------------------------------------------------------------------------------- DeBERTa's gathers
def relative_terms(c2p: jax.Array | None, p2c: jax.Array | None, index) -> jax.Array | float:
    """DeBERTa's position terms `q_i.Kr[idx_ij] + k_j.Qr[idx_ij]` for an index `[Nq', Nk']` (0 without terms).

    `c2p` `[B, H, Nq', R]` and `p2c` `[B, H, Nk', R]` are the products with the R reachable table rows, or None
    when the term is off; `index` holds `idx_ij = bucket(i - j) + k` for these queries and keys (see
    `deberta_jax.model.positions.relative_index_by_distance`). Both terms are gathered with `take_along_axis`.
    A static (numpy) index gets the hand-written gradient of `_relative_terms_static`.
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


def skew(per_distance: jax.Array) -> jax.Array:
    """`[..., N, 2N - 1] -> [..., N, N]`, entry `[i, j]` = `per_distance[..., i, j - i + N - 1]`: each row shifted
    left by `N - 1 - i`, by padding one column, flattening and re-cutting the rows one shorter (Transformer-XL's
    relative shift). Pads, reshapes and slices: copies, no gather."""
    *lead, n, width = per_distance.shape
    assert width == 2 * n - 1, per_distance.shape
    padded = jnp.pad(per_distance, [(0, 0)] * (len(lead) + 1) + [(0, 1)])
    flat = padded.reshape(*lead, 2 * n * n)
    return flat[..., n - 1: n - 1 + n * width].reshape(*lead, n, width)[..., :n]


def shifted_relative_terms(q: jax.Array, k: jax.Array, pos_key: jax.Array | None, pos_query: jax.Array | None,
                           rel_index: np.ndarray) -> jax.Array | float:
    """DeBERTa's position terms `q_i.Kr[idx(i - j)] + k_j.Qr[idx(i - j)]` of every query against every key
    (`[B, H, N, N]`, N queries and keys) as matrix-unit work and copies.

    Each projected table (`[H, R, d]`) is first expanded to one row per distance `i - j` (`[H, 2N - 1, d]`: the
    only gather, over the table, not the batch); queries (c2p) or keys (p2c) times those rows give the terms per
    (token, distance), `[B, H, N, 2N - 1]`, which `skew` lays out by (query, key). This does twice the
    multiply-adds of `relative_products` when R = N, and none of `relative_terms`' element gathers over
    `[B, H, N, N]`, which a TPU runs on its vector unit rather than its matrix unit.
    """
    terms = 0.0
    if pos_key is not None:  # row m of the expansion is distance N - 1 - m, so skew's [i, j] reads distance i - j
        per_distance = jnp.einsum("bhid,hmd->bhim", q, pos_key[:, np.ascontiguousarray(rel_index[::-1]), :])
        terms = terms + skew(per_distance)
    if pos_query is not None:  # row p is distance p - (N - 1): skew's [j, i] reads distance i - j
        per_distance = jnp.einsum("bhjd,hpd->bhjp", k, pos_query[:, rel_index, :])
        terms = terms + jnp.swapaxes(skew(per_distance), -1, -2)
    return terms


def saturation(rel_index: np.ndarray, query_len: int, key_len: int) -> tuple[int, int] | None:
    """(d_hi, d_lo): the relative index (`RelativeIndex.by_distance` order) is `rel_index[-1]` for every distance
    `i - j >= d_hi` and `rel_index[0]` for every `i - j <= d_lo` (the clamped outermost buckets, or the clipped
    rows), so only the pairs between read a row of their own; None when the index is the same at every distance."""
    distance = distances(query_len, key_len)
    not_hi, not_lo = np.flatnonzero(rel_index != rel_index[-1]), np.flatnonzero(rel_index != rel_index[0])
    if not not_hi.size:
        return None
    return int(distance[not_hi[-1] + 1]), int(distance[not_lo[0] - 1])


def banded_relative_terms(c2p: jax.Array | None, p2c: jax.Array | None, rel_index: np.ndarray,
                          key_positions, key_len: int) -> jax.Array | float:
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
    ends = saturation(rel_index, n_q, key_len)
    width = n_q  # no band when the index is the same at every distance
    if ends:
        d_hi, d_lo = ends
        width = block + d_hi - d_lo - 2
    if isinstance(key_positions, np.ndarray) or width >= n_q:
        return relative_terms(c2p, p2c, toeplitz(rel_index, np.arange(n_q), key_positions, key_len))

    def outer(row):  # the terms of every pair whose index is `row`
        return ((0.0 if c2p is None else c2p[..., row][..., :, None])
                + (0.0 if p2c is None else p2c[..., row][..., None, :]))

    pair_distance = jnp.arange(n_q)[:, None] - key_positions[None, :]
    far = jnp.where(pair_distance >= d_hi, outer(rel_index[-1]), outer(rel_index[0]))
    start = jnp.clip(key_positions[0] + d_lo + 1, 0, n_q - width)  # the band: d_lo < i - j < d_hi
    band_index = toeplitz(rel_index, start + jnp.arange(width), key_positions, key_len)
    band_c2p = None if c2p is None else jax.lax.dynamic_slice_in_dim(c2p, start, width, axis=2)
    band = relative_terms(band_c2p, p2c, band_index)
    return jax.lax.dynamic_update_slice_in_dim(far, band.astype(far.dtype), start, axis=2)
