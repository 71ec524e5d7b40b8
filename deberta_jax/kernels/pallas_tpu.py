"""Fused disentangled attention for TPUs (Pallas / Mosaic), forward and backward, memory linear in length.

The Triton kernel (`kernels.pallas`) reads DeBERTa's position terms with element gathers inside a tile, which a
TPU's vector unit runs slowly and Mosaic hardly supports. Here the terms are matrix-unit work and lane rotations:

- Outside the kernel each projected relative table (`[H, R, d]`) is expanded to one row per distance,
  stored transposed, `[H, d, 2N]` (`expand_tables`; `O(N d)`, the only gather; distances along lanes, so d = 64
  wastes no lane padding). Position keys are laid out by decreasing distance, position queries by increasing.
- For a tile of `T` queries at `i0` and `T` keys at `j0`, the distances `i - j` of its pairs span the `2T - 1`
  consecutive rows starting at `i0 - j0 - (T - 1)`: a `[d, 2T]` slice of the head's expanded table, which stays
  in VMEM while the head's tiles go by, at an offset aligned to the tile (`i0 - j0` is a multiple of `T`).
  `q_tile @ rows^T` is `[T, 2T]` on the matrix unit: query `a` against every distance of the tile. Rotating row
  `a` by `T + 1 + a` lanes (`pltpu.roll` with a stride) moves the entry for key `c` to column `c`: the relative
  shift of Transformer-XL done per tile, with no `[N, N]` tensor. p2c is the same with keys and position
  queries, transposed. A per-distance bias (ALiBi's, T5's table read per bucket) is expanded like the position
  keys, one row `[H, 1, 2N]`, and a tile's `[1, 2T]` slice of it, broadcast over the tile's queries, is rotated
  into place the same way.
- Nothing of a `[T, 2T]` product is recomputed: along a grid row the side that stays (the forward's queries, the
  backward's keys) meets the next tile's distances one tile further on, so the half of its product the two pairs
  share is kept (`_position_product`); the side that moves (the forward's key tiles, the backward's query tiles)
  meets each of its tiles again one row later, also one tile further on, so its shared half is kept per tile of
  that side (`[tiles, T, T]` float32 in VMEM; the forward's query tiles then run in order). Each pair of either
  side costs one `[T, T]` position product per term, as if only its own distances were multiplied, plus one per
  row or column where that run of pairs starts.
- Past some distance each way the relative index is constant (the outermost bucket, or the clipped row:
  `scores.saturation`), so a tile pair whose distances all lie beyond it (a far pair: at 2,048 tokens with
  DeBERTa-base's 256 buckets half the pairs, at 8,192 six in seven) reads one table row: its c2p is a column per
  query, `q . pos_key[end]`, and its p2c a row per key. The kernels take each table's two end rows (`[H, 2, d]`)
  and form those terms in the tile on the vector unit (`_far_terms`: a multiply and a sum over d, `O(T d)` per
  pair); a far pair runs BERT's products only. Backward, a far pair's c2p gradient is its score gradient's row sums
  times the end row, added to dq at once, and its p2c gradient the column sums, kept per key tile and added to dk
  when the tile is done; the end rows' gradients accumulate over the head. Nothing of the end terms passes
  through HBM, so a far pair moves BERT's bytes too.
- The softmax is FlashAttention's online softmax over key tiles (grid axis 3), saving each row's log-sum-exp.
- With a window (`ScoreTerms.window`) a query tile visits only the band of key tiles its queries' windows reach
  (`KernelShape.key_band` of them, about `(T + W) / T + 1`): the grid's key axis is that band, and the index maps
  compute each step's key tile from the query tile, so tiles outside it are neither computed nor read and a call
  costs `O(N W)`. Keys of a visited tile outside a query's window are masked like padding.

The backward pass is one kernel: each key tile visits its query tiles (the band of those whose windows reach it,
with a window), recomputing every tile pair's probabilities from the log-sum-exp once (FlashAttention-2 splits
this into a dq pass and a dk/dv pass, each recomputing the scores: here five of the pair's products). dk and dv
accumulate over the key tile's query tiles; dq, and a temperature's gradient (a factor per query, and per head when
learned, on its whole score row: the row sum of the score gradient times the scores before the factor), over the
sequence, in float32 blocks of all its queries held in VMEM. The inverse rotation (`_unskew`) takes a tile's score
gradient back to per-distance columns, which give c2p's share of dq (and p2c's of dk) and add into the head's whole
table gradient, held in VMEM (float32) while every sequence and tile pair of the head goes by; summed over the
tile's queries they are the bias's gradient per distance, accumulated the same way (and added into T5's table by
the expansion's gradient).

Attention dropout is drawn inside the kernels from hashes of the tile's query and key positions
(`dropout_masks.attention_keep`; the hashes of every sequence, head and position are computed once outside, for the
whole batch): the dense kernel's mask, which the backward kernel draws again at any tile size.

Scope: self-attention (as many queries as keys), a key padding mask, c2p and p2c each optional, any bucketing
(the expansion reads the per-distance index), a per-distance bias, attention dropout, a temperature and a window
with or without global keys. A query whose window holds no real key (a padding query) averages its band's keys
where the dense kernel averages every key: its output is padding's, which no real token reads. A window's global
keys (a row's first and last real tokens, seen by every query) lie in tiles the band skips: two per row, they are
scored outside the kernel and merged into its softmax through its log-sum-exp (`tiling.merge_global_keys`), which is why
the call's log-sum-exp is a differentiable output. On a TPU the kernels are compiled by Mosaic (also when a program
is compiled for a TPU from another machine, `deberta_jax.aot`); elsewhere Pallas interprets them (exact, slow:
tests).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from deberta_jax.kernels import dropout_masks
from deberta_jax.kernels.scores import ScoreTerms, combine_scores, mask_keys, saturation
from deberta_jax.kernels.tiling import KernelShape, batch_shards, kernel_shape, merge_global_keys, take

# Queries and keys per tile: one lane width, so the `[T, 2T]` products and their rotation fill whole vregs and
# the matrix unit (128 x 128 on v5e) runs full tiles.
TILE = 128


def expand_tables(by_distance: np.ndarray, shape: KernelShape) -> tuple[np.ndarray, np.ndarray]:
    """Row indices into the relative table for the two expanded layouts, `2 * padded` rows each.

    Forward layout (position queries): row `r` is distance `r - (padded - 1)`. Reversed layout (position keys):
    row `r` is distance `padded - 1 - r`. `by_distance` is `scores.distances(length, length)` order; distances
    that only padding positions reach repeat the nearest real one (their scores are masked).
    """
    length, padded = shape.length, shape.padded
    rows = np.arange(2 * padded)
    forward = np.clip(rows - (padded - 1), -(length - 1), length - 1) + length - 1
    reverse = np.clip(padded - 1 - rows, -(length - 1), length - 1) + length - 1
    return by_distance[forward].astype(np.int32), by_distance[reverse].astype(np.int32)


def _dot_t(a, b):
    """`a @ b.T` in float32 on the matrix unit."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _skew(per_distance, tile: int):
    """`[T, 2T]` per-distance products -> `[T, T]`: row `a` rotated left by `T - 1 - a` (column `c` of the
    result is column `c + T - 1 - a` of the input)."""
    return pltpu.roll(per_distance, tile + 1, 1, stride=1, stride_axis=0)[:, :tile]


def _unskew(grad, tile: int):
    """The transpose of `_skew`: `[T, T]` -> `[T, 2T]`, entry `[a, m]` = `grad[a, m - (T - 1 - a)]` where that is a
    column, else 0. The inverse rotation would need a negative stride, which Mosaic lacks; a gather within each
    row's 128 lanes (one vreg along the gathered axis, which Mosaic supports) reads the same entries."""
    a = jax.lax.broadcasted_iota(jnp.int32, grad.shape, 0)
    m = jax.lax.broadcasted_iota(jnp.int32, grad.shape, 1)
    halves = []
    for half in (0, 1):
        source = (m + half * tile + a + tile + 1) % (2 * tile)
        halves.append(jnp.where(source < tile, jnp.take_along_axis(grad, source % tile, axis=1), 0.0))
    return jnp.concatenate(halves, axis=1)


def _position_product(x, rows, carried, restart):
    """`x @ rows`, `[T, d] x [d, 2T]` -> `[T, 2T]` float32. With `carried` (a `[T, T]` float32 scratch) the left
    half is the previous grid step's right half: along the innermost grid axis the side that `x` belongs to stays
    fixed and the other moves one tile, so the distances move one tile too and the pair's left `[d, T]` rows are
    the previous pair's right ones (one product per step instead of two, plus one where the row's band of near
    pairs starts: `restart`)."""
    if carried is None:
        return _dot(x, rows)
    t = x.shape[0]

    @pl.when(restart)
    def _():
        carried[...] = _dot(x, rows[:, :t])

    left, right = carried[...], _dot(x, rows[:, t:])
    carried[...] = right
    return jnp.concatenate([left, right], axis=1)


def _band_edges(shape: KernelShape, tiles):
    """(start, end): whether this grid step's pair is the first / last near pair of its row (its band): where a
    carried position product restarts and where a pending gradient is flushed."""
    step, last = pl.program_id(3), pl.num_programs(3) - 1
    if shape.ends is None:
        return step == 0, step == last
    before = tiles(pl.program_id(2), jnp.maximum(step - 1, 0))
    after = tiles(pl.program_id(2), jnp.minimum(step + 1, last))
    return (step == 0) | ~shape.near(*before), (step == last) | ~shape.near(*after)


def _column_edges(shape: KernelShape, query_tile, key_tile, backward: bool):
    """(start, end): whether the pair is the first / last near pair of its column, the pairs of its moving-side
    tile (the forward's key tile, the backward's query tile) over the grid's rows (consecutive rows visit it with
    distances one tile apart)."""
    def near_visit(row_offset):
        query, key = (query_tile, key_tile + row_offset) if backward else (query_tile + row_offset, key_tile)
        return shape.visited(query, key, backward) & shape.near(query, key)
    return ~near_visit(-1), ~near_visit(1)


def _position_terms(shape: KernelShape, q, k, options, query_tile, key_tile, c2p_carry, p2c_carry):
    """c2p + p2c of one tile pair `[T, T]` (before the divisor): a near pair's from its table rows, a far pair's
    from the end terms (c2p's column of its queries plus p2c's row of its keys). Each `*_carry` is the
    (`[T, T]` scratch, restart) of its `_position_product`."""
    t = shape.tile

    def near():
        ec, eq, _ = _table_rows(shape, options, query_tile, key_tile)
        out = jnp.zeros((t, t), jnp.float32)
        if shape.c2p:
            out = out + _skew(_position_product(q, ec, *c2p_carry), t)
        if shape.p2c:
            out = out + _skew(_position_product(k, eq, *p2c_carry), t).T
        return out

    if shape.ends is None:
        return near()
    hi, lo = shape.far(query_tile, key_tile)

    def far():
        out = jnp.zeros((t, t), jnp.float32)
        if shape.c2p:  # a column per query
            out = out + _far_terms(q, _end_row(options.c2p_rows, hi))
        if shape.p2c:  # a row per key
            out = out + _to_row(_far_terms(k, _end_row(options.p2c_rows, hi)))
        return out
    return jax.lax.cond(hi | lo, far, near)


def _end_row(rows_ref, hi):
    """`[1, d]` float32: the table's last row where the pair's distances are all past `d_hi`, else its first."""
    rows = rows_ref[...].astype(jnp.float32)
    return jnp.where(hi, rows[1:], rows[:1])


def _far_terms(x, row):
    """`x . row` per token of the tile, `[T, 1]` float32: a far pair's position term from one table row, on the
    vector unit (a `[T, d] x [d, 1]` product would take the matrix unit for a whole `[T, T]` one)."""
    return jnp.sum(x.astype(jnp.float32) * row, axis=1, keepdims=True)


def _scores(shape: KernelShape, q, k, options, attended, query_tile, key_tile, c2p_carry, p2c_carry):
    """Masked float32 scores `[T, T]` of one tile, its scores before the temperature, and the temperature column
    `[T, 1]` (None without one). `*_carry`: a position term's (scratch, restart) for `_position_product`: the half
    it shares with the pair one step back along the grid row (the term whose side stays: the forward's c2p, the
    backward's p2c) or one row back along its column (the other term: its side's tile is met again one row later,
    one tile of distances further)."""
    t = shape.tile
    raw = _dot_t(q, k)
    if shape.c2p or shape.p2c:
        raw = raw + _position_terms(shape, q, k, options, query_tile, key_tile, c2p_carry, p2c_carry)
    eb = _table_rows(shape, options, query_tile, key_tile)[2]
    bias = _skew(jnp.broadcast_to(eb, (t, 2 * t)), t) if shape.bias else None
    scores = combine_scores(raw, 0.0, bias, shape.divisor)
    temperature = _to_column(options.temperature[...]) if shape.temperature else None
    positions = key_tile * t + jax.lax.broadcasted_iota(jnp.int32, (1, t), 1)
    # `combine_scores`' last factor, kept apart: the temperature's gradient needs the scores without it.
    return mask_keys(scores if temperature is None else scores * temperature, attended,
                     positions < shape.length), scores, temperature


def _attended(shape: KernelShape, mask_ref, query_tile, key_tile):
    """The keys each query of the tile attends to: its real keys (`[1, T]`), inside its window when there is one
    (`[T, T]`)."""
    real = mask_ref[...] != 0
    if not shape.window:
        return real
    t = shape.tile
    start = shape.window_start(query_tile * t + jax.lax.broadcasted_iota(jnp.int32, (t, 1), 0))
    key = key_tile * t + jax.lax.broadcasted_iota(jnp.int32, (1, t), 1)
    return real & (key >= start) & (key < start + shape.window)


def _to_row(column):
    """`[T, 1]` -> `[1, T]`. Per-query statistics leave and enter the kernels as rows of a `[..., 1, N]` array: as a
    `[..., N, 1]` column each value would fill a 128-lane row of HBM (128x the bytes)."""
    t = column.shape[0]
    return jnp.broadcast_to(column, (t, t)).T[:1]


def _to_column(row):
    """`[1, T]` -> `[T, 1]`."""
    t = row.shape[1]
    return jnp.broadcast_to(row, (t, t)).T[:, :1]


def _table_columns(shape: KernelShape, sign: int, query_tile, key_tile, offset: int = 0, width: int = 2):
    """The `2T` columns of an expanded table that tile pair (query_tile, key_tile) reads: from block
    `n - 1 - (i - j)` in the reversed layout (c2p, `sign` -1), `n - 1 + (i - j)` in the forward one (p2c, +1); or
    `width` blocks of them from block `offset`. Aligned to the tile, so a slice of the head's table (resident in
    VMEM) is a plain load or store."""
    t = shape.tile
    first = shape.num_tiles - 1 + sign * (query_tile - key_tile) + offset
    return pl.ds(pl.multiple_of(first * t, t), width * t)


def _table_rows(shape: KernelShape, options, query_tile, key_tile):
    """The `[d, 2T]` rows of each expanded table and the bias's `[1, 2T]` (None when off) that a tile pair reads."""
    def rows(ref, sign):
        return None if ref is None else ref[:, _table_columns(shape, sign, query_tile, key_tile)]
    return rows(options.ec, -1), rows(options.eq, 1), rows(options.eb, -1)


@dataclasses.dataclass(frozen=True)
class _Options:
    """The refs of a kernel's optional operands, None when off: the dropout hashes of the tile's queries and keys,
    its queries' temperature (rows), the head's expanded tables and bias, and the two end rows (`[2, d]`: the
    relative index's first and last) of c2p's table and of p2c's, which far pairs read."""

    query_hash: object
    key_hash: object
    temperature: object
    ec: object
    eq: object
    eb: object
    c2p_rows: object
    p2c_rows: object


def _split_refs(refs, shape: KernelShape, count: int):
    """The leading `count` refs, the optional operands (`_options` order), then the rest."""
    refs = list(refs)
    head = take(refs, *[True] * count)
    on = (shape.dropout, shape.dropout, shape.temperature, shape.c2p, shape.p2c, shape.bias, shape.far_c2p,
          shape.far_p2c)
    return head, _Options(*take(refs, *on)), refs


def _keep(shape: KernelShape, options: _Options):
    """The tile's attention-dropout keep mask `[T, T]` (None without dropout): the dense kernel's, from the hashes
    of the tile's query and key positions."""
    if not shape.dropout:
        return None
    return dropout_masks.attention_keep(_to_column(options.query_hash[...]), options.key_hash[...],
                                        shape.dropout_rate)


# ------------------------------------------------------------------------------------------------- forward
def _forward_kernel(*refs, shape: KernelShape, tiles):
    (q_ref, k_ref, v_ref, mask_ref), options, rest = _split_refs(refs, shape, 4)
    o_ref, lse_ref, m_sc, l_sc, acc_sc, c2p_sc, p2c_sc = take(rest, True, True, True, True, True, shape.c2p,
                                                               shape.p2c)
    step = pl.program_id(3)
    query_tile, key_tile = tiles(pl.program_id(2), step)

    @pl.when(step == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, -jnp.inf)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    c2p_carry = (c2p_sc, _band_edges(shape, tiles)[0]) if shape.c2p else None
    p2c_carry = (p2c_sc.at[key_tile], _column_edges(shape, query_tile, key_tile, False)[0]) if shape.p2c else None
    s, _, _ = _scores(shape, q_ref[...], k_ref[...], options, _attended(shape, mask_ref, query_tile, key_tile),
                      query_tile, key_tile, c2p_carry, p2c_carry)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    correction = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    # The normalizer sums every probability; dropout acts on the normalized ones (`dense_attention`'s order).
    l_sc[...] = l_sc[...] * correction + p.sum(axis=1, keepdims=True)
    dropped = dropout_masks.apply(p, _keep(shape, options), shape.dropout_rate)
    acc_sc[...] = acc_sc[...] * correction + _dot(dropped.astype(v_ref.dtype), v_ref[...])
    m_sc[...] = m_new

    @pl.when(step == pl.num_programs(3) - 1)
    def _():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
        lse_ref[...] = _to_row(m_sc[...] + jnp.log(l_sc[...]))


# ------------------------------------------------------------------------------------------------ backward
def _score_grad(shape: KernelShape, q, k, v, options, mask_ref, query_tile, key_tile, do, lse, delta,
                c2p_carry, p2c_carry):
    """For one tile: the probabilities as the forward pass weighed the values (after dropout), the gradient of the
    scores before the temperature (`combine_scores`' sum; masked keys get none), and the temperature's gradient
    per query (`[T, 1]`, None without one).

    With dropout the output is `sum_j p_ij z_ij v_j` (`z` the kept mask over the keep probability), so the
    probabilities' gradient is `z_ij do_i.v_j`, and its row sum against `p` is still `do_i.out_i` (`delta`)."""
    attended = _attended(shape, mask_ref, query_tile, key_tile)
    s, scores, temperature = _scores(shape, q, k, options, attended, query_tile, key_tile, c2p_carry, p2c_carry)
    p = jnp.exp(s - _to_column(lse))
    keep = _keep(shape, options)
    dp = dropout_masks.apply(_dot_t(do, v), keep, shape.dropout_rate)
    ds = jnp.where(attended, p * (dp - _to_column(delta)), 0.0)
    if temperature is None:
        return dropout_masks.apply(p, keep, shape.dropout_rate), ds, None
    return (dropout_masks.apply(p, keep, shape.dropout_rate), ds * temperature,
            jnp.sum(ds * scores, axis=1, keepdims=True))


def _head_steps():
    """(first, last) step of a head in a backward grid (head, sequence, x, y), where x and y are its tiles."""
    first = (pl.program_id(1) == 0) & (pl.program_id(2) == 0) & (pl.program_id(3) == 0)
    last = ((pl.program_id(1) == pl.num_programs(1) - 1) & (pl.program_id(2) == pl.num_programs(2) - 1)
            & (pl.program_id(3) == pl.num_programs(3) - 1))
    return first, last


def _query_rows(shape: KernelShape, query_tile):
    """The query tile's rows of a whole-sequence block (an aligned dynamic slice: a plain load or store)."""
    return pl.ds(pl.multiple_of(query_tile * shape.tile, shape.tile), shape.tile)


def _backward_kernel(*refs, shape: KernelShape, tiles):
    """Grid (head, sequence, key tile, query tile step): every gradient in one pass over the tile pairs, so each
    pair's scores and probabilities are recomputed once. dk and dv accumulate over the key tile's query tiles; dq
    and the temperature's gradient over the whole sequence (float32 blocks of every query, in VMEM while the
    sequence's pairs go by); the tables' and the bias's over the head.

    p2c's products share halves between consecutive steps, as its scores do (`_position_product`): the key tile is
    fixed and the pair's distances move one tile per step, so the right half of a step's per-distance gradient
    multiplies the same `[d, T]` table rows as the next step's left half. The two are summed first (`p2c_pending`)
    and each block of rows takes one product for dk and one for its table gradient. c2p's do the same along each
    query tile's column: the next key tile meets the query tile one row later, one tile of distances further, so
    its scores' right half and its pending gradient (for dq and the table) are kept per query tile, in VMEM for
    the whole sequence (`c2p_carried`, `c2p_pending`: `[tiles, T, T]` float32 each). A far pair's position terms
    are end terms (`_far_terms`): c2p's gradient is the score gradient's row sums times the end row, added to dq
    then and there, p2c's the column sums, kept for the key tile (`p2c_far`) and added to dk with its other
    gradients; the end rows' gradients are those sums against the queries and keys, accumulated over the head."""
    (q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref), options, rest = _split_refs(refs, shape, 7)
    on = (True, True, True, shape.c2p, shape.p2c, shape.bias, shape.temperature, shape.far_c2p, shape.far_p2c)
    dk_ref, dv_ref, dq_ref, d_ec_ref, d_eq_ref, d_eb_ref, dt_ref, d_cr_ref, d_pr_ref = take(rest, *on)
    dk_sc, dv_sc, dq_sc, ec_acc, eq_acc, eb_acc, dt_sc, cr_acc, pr_acc = take(rest, *on)
    p2c_carried, p2c_pending, c2p_carried, c2p_pending, p2c_far = take(
        rest, shape.p2c, shape.p2c, shape.c2p, shape.c2p, shape.far_p2c)
    t = shape.tile
    step = pl.program_id(3)
    last_step = step == pl.num_programs(3) - 1
    query_tile, key_tile = tiles(pl.program_id(2), step)
    sequence_first = (pl.program_id(2) == 0) & (step == 0)
    sequence_last = (pl.program_id(2) == pl.num_programs(2) - 1) & last_step
    head_first, head_last = _head_steps()
    band_start, band_end = _band_edges(shape, tiles)
    column_start, column_end = _column_edges(shape, query_tile, key_tile, True)

    @pl.when(step == 0)
    def _():
        for acc in (dk_sc, dv_sc, p2c_far, p2c_pending):
            if acc is not None:
                acc[...] = jnp.zeros_like(acc)

    @pl.when(sequence_first)
    def _():
        for acc in (dq_sc, dt_sc):
            if acc is not None:
                acc[...] = jnp.zeros_like(acc)

    @pl.when(head_first)
    def _():
        for acc in (ec_acc, eq_acc, eb_acc, cr_acc, pr_acc):
            if acc is not None:
                acc[...] = jnp.zeros_like(acc)

    q, k, do = q_ref[...], k_ref[...], do_ref[...]
    c2p_carry = (c2p_carried.at[query_tile], column_start) if shape.c2p else None
    p2c_carry = (p2c_carried, band_start) if shape.p2c else None
    p, d_scores, dt = _score_grad(shape, q, k, v_ref[...], options, mask_ref, query_tile, key_tile, do,
                                  lse_ref[...], delta_ref[...], c2p_carry, p2c_carry)
    ds = d_scores / shape.divisor  # the gradient of the raw sum q.k + c2p + p2c
    rows = _query_rows(shape, query_tile)
    columns = _table_columns(shape, -1, query_tile, key_tile)
    per_distance = _unskew(d_scores, t) if shape.bias else None  # the scores' gradient per (query, distance)
    if shape.bias:
        eb_acc[:, columns] += per_distance.sum(axis=0, keepdims=True)

    @pl.when(shape.near(query_tile, key_tile))
    def _():
        if shape.c2p:
            per_distance_raw = (_unskew(d_scores, t) if per_distance is None else per_distance) / shape.divisor
            left, right = (_table_columns(shape, -1, query_tile, key_tile, offset=half, width=1) for half in (0, 1))
            pending = c2p_pending.at[query_tile]
            # Uninitialised at a column's first pair: selected away, never added.
            merged = per_distance_raw[:, :t] + jnp.where(column_start, 0.0, pending[...])
            pending[...] = per_distance_raw[:, t:]
            dq_sc[rows, :] += _dot_t(merged.astype(options.ec.dtype), options.ec[:, left])
            ec_acc[:, left] += _dot(q.T.astype(jnp.float32), merged)

            @pl.when(column_end)
            def _():
                rest = pending[...]
                dq_sc[rows, :] += _dot_t(rest.astype(options.ec.dtype), options.ec[:, right])
                ec_acc[:, right] += _dot(rest.T, q.astype(jnp.float32)).T  # as p2c's flush below
        if shape.p2c:
            per_key = _unskew(ds.T, t)  # per (key, distance)
            left, right = (_table_columns(shape, 1, query_tile, key_tile, offset=half, width=1) for half in (0, 1))
            merged = p2c_pending[...] + per_key[:, :t]
            p2c_pending[...] = per_key[:, t:]
            dk_sc[...] += _dot_t(merged.astype(options.eq.dtype), options.eq[:, left])
            eq_acc[:, left] += _dot(k.T.astype(jnp.float32), merged)

            @pl.when(band_end)
            def _():
                rest = p2c_pending[...]
                dk_sc[...] += _dot_t(rest.astype(options.eq.dtype), options.eq[:, right])
                # `(rest.T @ k).T`, not `k.T @ rest`: with `k.T` feeding a product here and the one above, libtpu
                # 0.0.42's compiler fails a check (mxu_lmr_transform) on some train steps.
                eq_acc[:, right] += _dot(rest.T, k.astype(jnp.float32)).T

    if shape.ends is not None:
        hi, lo = shape.far(query_tile, key_tile)

        @pl.when(hi | lo)
        def _():
            def by_end(sums):  # `[1, x]` -> `[2, x]`: the sums in the row of the pair's end (lo, hi)
                return jnp.concatenate([jnp.where(lo, sums, 0.0), jnp.where(hi, sums, 0.0)], axis=0)
            if shape.c2p:
                per_query = ds.sum(axis=1, keepdims=True)  # `[T, 1]`
                dq_sc[rows, :] += per_query * _end_row(options.c2p_rows, hi)
                cr_acc[...] += by_end(jnp.sum(per_query * q.astype(jnp.float32), axis=0, keepdims=True))
            if shape.p2c:
                p2c_far[...] += by_end(ds.sum(axis=0, keepdims=True))

    dq_sc[rows, :] += _dot(ds.astype(k.dtype), k)
    if shape.temperature:
        dt_sc[:, rows] += _to_row(dt)
    dk_sc[...] += _dot(ds.T.astype(q.dtype), q)
    dv_sc[...] += _dot(p.T.astype(do.dtype), do)

    @pl.when(last_step)
    def _():
        if shape.far_p2c:  # the key tile's far column sums, by end, times that end's row
            per_key = [_to_column(p2c_far[e:e + 1, :]) for e in (0, 1)]  # `[T, 1]` each
            ends = options.p2c_rows[...].astype(jnp.float32)
            dk_sc[...] += per_key[0] * ends[:1] + per_key[1] * ends[1:]
            pr_acc[...] += jnp.concatenate(
                [jnp.sum(x * k.astype(jnp.float32), axis=0, keepdims=True) for x in per_key], axis=0)
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)

    @pl.when(sequence_last)
    def _():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)
        if shape.temperature:
            dt_ref[...] = dt_sc[...]

    @pl.when(head_last)
    def _():
        for acc, out in ((ec_acc, d_ec_ref), (eq_acc, d_eq_ref), (eb_acc, d_eb_ref), (cr_acc, d_cr_ref),
                         (pr_acc, d_pr_ref)):
            if acc is not None:
                out[...] = acc[...].astype(out.dtype)


# ------------------------------------------------------------------------------------------------ plumbing
# Matrix-unit products, in units of one `[T, d] x [d, T]`: (per tile pair, more per near pair, more per tile). Forward:
# q.k and p @ v; a near pair's c2p `[T, 2T]` product is one unit (the half it shares with the last step is kept,
# `_position_product`) plus one where its row's band of near pairs starts; p2c's likewise along its column.
# Backward: q.k, dp, ds @ k, ds^T @ q, p^T @ do; a near pair's p2c scores, share of dk and table gradient one unit
# each (halves shared along the row), plus three at the row band's ends; c2p's the same along the column. Every
# row and every column holds one band (its diagonal pair is near), so the bands cost a fixed amount per tile. A far
# pair's position terms are end terms on the vector unit (`_far_terms`): no products.
_PRODUCTS = {
    "_forward_kernel": lambda s: (2, s.c2p + s.p2c, s.c2p + s.p2c),
    "_backward_kernel": lambda s: (5, 3 * (s.c2p + s.p2c), 3 * (s.c2p + s.p2c)),
}


def _cost(kernel, shape: KernelShape, grid, inputs, tables, resident: str | None, out_shapes) -> pl.CostEstimate:
    """What one call costs, for XLA's cost analysis of a compiled program (a custom call is opaque to it): the
    products of every tile pair the grid visits (`_PRODUCTS`; a window's band, not every pair; a far pair's without
    position products), one exp per score, and the bytes the grid moves: blocks of the `resident` side (the one
    fixed along the innermost grid axis) once, the other side's once per step of that axis, an input shared by the
    heads (the key mask, a temperature without a head axis) once per head, and each head's tables once per
    sequence."""
    b, h, _, d = inputs[0][0].shape
    pairs = b * h * grid[2] * grid[3]
    unit = 2 * shape.tile ** 2 * d
    every, near, per_tile = _PRODUCTS[kernel.__name__](shape)
    near_pairs = int(shape.near_pairs(backward=kernel is _backward_kernel).sum())
    units = every * grid[2] * grid[3] + near * near_pairs + per_tile * shape.num_tiles
    streamed = sum(x.size * x.dtype.itemsize * (1 if side == resident else grid[3]) * (b * h // math.prod(x.shape[:2]))
                   for x, (_, side) in zip(*inputs))
    streamed += sum(x.size * x.dtype.itemsize * b for x in tables)
    written = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(out_shapes))
    return pl.CostEstimate(flops=b * h * unit * units, transcendentals=pairs * shape.tile ** 2,
                           bytes_accessed=streamed + written)


def _call(kernel, shape: KernelShape, grid, tiles, inputs, tables, out_shapes, out_specs, scratch, semantics,
          resident: str | None, order=lambda *g: g):
    """One pallas_call over `grid`: `order(*grid point)` is its (sequence, head, x, y) and `tiles(x, y)` its
    (query tile, key tile), which per-token inputs follow (q-side or k-side) and the kernel reads; `resident` is the
    side whose tile the innermost grid axis keeps ("q", "k" or None)."""
    t = shape.tile

    def spec(x, block, side):
        def index(*point):
            b, h, i, j = order(*point)
            tile = tiles(i, j)[0 if side == "q" else 1]
            head = h if x.shape[1] > 1 else 0  # a row shared by the heads (a temperature without a head axis)
            return {"token": (b, h, tile, 0), "row": (b, head, 0, tile), "mask": (b, 0, tile)}[block]
        shapes = {"token": (None, None, t, x.shape[-1]), "row": (None, None, 1, t), "mask": (None, 1, t)}
        return pl.BlockSpec(shapes[block], index)

    in_specs = [spec(x, block, side) for x, (block, side) in zip(*inputs)]
    # A head's expanded tables stay in VMEM while its tiles go by (their block changes only with the head).
    in_specs += [pl.BlockSpec((None,) + x.shape[1:], lambda *point: (order(*point)[1], 0, 0)) for x in tables]
    operands = list(inputs[0]) + list(tables)
    body = functools.partial(kernel, shape=shape, tiles=tiles)

    cost = _cost(kernel, shape, grid, inputs, tables, resident, out_shapes)
    # VMEM for every block twice (Pallas double-buffers them) and the scratch, plus 16 MiB for the tile's
    # intermediates, at least 32 MiB. v5e/v5p/v6e chips have 95-128 MiB: DeBERTa-base's whole-head tables (and the
    # backward kernel's float32 accumulators of them, of the sequence's dq and of c2p's carried halves, 1 KiB per
    # token each at d = 64, T = 128) reach that at about 16k tokens.
    def block_bytes(spec, x):
        return math.prod(s for s in spec.block_shape if s is not None) * jnp.dtype(x.dtype).itemsize
    blocks = [block_bytes(s, x) for s, x in zip(in_specs, operands)]
    blocks += [block_bytes(s, x) for s, x in zip(jax.tree.leaves(out_specs), jax.tree.leaves(out_shapes))]
    scratch_bytes = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in scratch)
    vmem_limit = max(32 * 2**20, 16 * 2**20 + 2 * sum(blocks) + scratch_bytes)

    def run(interpret, *args):
        return pl.pallas_call(
            body, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shapes,
            scratch_shapes=scratch, interpret=interpret, cost_estimate=cost,
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=vmem_limit),
            name=kernel.__name__.strip("_"))(*args)

    # Mosaic when the program is lowered for a TPU (also from another machine), Pallas' interpreter elsewhere.
    return jax.lax.platform_dependent(*operands, tpu=functools.partial(run, False),
                                      default=functools.partial(run, True))


_TOKEN_Q, _TOKEN_K, _MASK = ("token", "q"), ("token", "k"), ("mask", "k")
_ROW_Q, _ROW_K = ("row", "q"), ("row", "k")
_PARALLEL, _ARBITRARY = pltpu.GridDimensionSemantics.PARALLEL, pltpu.GridDimensionSemantics.ARBITRARY


def _options(shape: KernelShape, options):
    """The optional operands that are on, in `_Options` order: (per-token rows and their blocks, tables: a head's
    whole block each)."""
    query_hash, key_hash, temperature, ec, eq, eb, c2p_rows, p2c_rows = options
    rows = [(x, block) for x, block, on in ((query_hash, _ROW_Q, shape.dropout), (key_hash, _ROW_K, shape.dropout),
                                            (temperature, _ROW_Q, shape.temperature)) if on]
    return rows, [x for x, on in ((ec, shape.c2p), (eq, shape.p2c), (eb, shape.bias), (c2p_rows, shape.far_c2p),
                                  (p2c_rows, shape.far_p2c)) if on]


def _inputs(shape: KernelShape, tokens, blocks, options):
    """`_call`'s (inputs, their blocks) and tables: the kernel's fixed per-token inputs, then the options."""
    rows, tables = _options(shape, options)
    return (tuple(tokens) + tuple(x for x, _ in rows), tuple(blocks) + tuple(block for _, block in rows)), tables


def _forward(shape: KernelShape, q, k, v, mask, options):
    b, h, n_pad, d = q.shape
    t, n = shape.tile, shape.num_tiles
    out, lse = _call(
        _forward_kernel, shape, (b, h, n, shape.key_band), lambda i, j: (i, shape.key_tile(i, j)),
        *_inputs(shape, (q, k, v, mask), (_TOKEN_Q, _TOKEN_K, _TOKEN_K, _MASK), options),
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, 1, n_pad), jnp.float32)],
        [pl.BlockSpec((None, None, t, d), lambda b_, h_, i, j: (b_, h_, i, 0)),
         pl.BlockSpec((None, None, 1, t), lambda b_, h_, i, j: (b_, h_, 0, i))],
        [pltpu.VMEM((t, 1), jnp.float32), pltpu.VMEM((t, 1), jnp.float32), pltpu.VMEM((t, d), jnp.float32)]
        + [pltpu.VMEM((t, t), jnp.float32)] * shape.c2p + [pltpu.VMEM((n, t, t), jnp.float32)] * shape.p2c,
        # p2c's carried products pass from one query tile to the next: those run in order.
        (_PARALLEL, _PARALLEL, _ARBITRARY if shape.p2c else _PARALLEL, _ARBITRARY), resident="q")
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(shape: KernelShape, q, k, v, mask, options):
    """(output, log-sum-exp `[B, H, 1, N]`), both differentiable: global keys merge into the call's softmax
    through its log-sum-exp (`tiling.merge_global_keys`)."""
    return _forward(shape, q, k, v, mask, options)


def _attention_fwd(shape, q, k, v, mask, options):
    out, lse = _forward(shape, q, k, v, mask, options)
    return (out, lse), (q, k, v, mask, options, out, lse)


def _attention_bwd(shape: KernelShape, residuals, cotangents):
    q, k, v, mask, options, out, lse = residuals
    d_out, d_lse = cotangents
    b, h, n_pad, d = q.shape
    t, n = shape.tile, shape.num_tiles
    # The score gradient is p * (dp - delta); the log-sum-exp's cotangent adds p * d_lse (its gradient is p).
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)[:, :, None, :] - d_lse
    inputs, tables = _inputs(shape, (q, k, v, mask, d_out, lse, delta),
                             (_TOKEN_Q, _TOKEN_K, _TOKEN_K, _MASK, _TOKEN_Q, _ROW_Q, _ROW_Q), options)
    # Heads outermost: a head's table gradient accumulates over its sequences and tile pairs, so only heads run
    # in parallel when one is computed; dq accumulates over a sequence's key tiles, so those run in order.
    order = lambda h_, b_, x, y: (b_, h_, x, y)  # noqa: E731
    key_tile = pl.BlockSpec((None, None, t, d), lambda h_, b_, x, y: (b_, h_, x, 0))
    sequence = pl.BlockSpec((None, None, n_pad, d), lambda h_, b_, x, y: (b_, h_, 0, 0))
    sequence_row = pl.BlockSpec((None, None, 1, n_pad), lambda h_, b_, x, y: (b_, h_, 0, 0))
    whole_table = pl.BlockSpec((None, d, 2 * n_pad), lambda h_, b_, x, y: (h_, 0, 0))
    accumulator = pltpu.VMEM((d, 2 * n_pad), jnp.float32)
    _, _, temperature, ec, eq, eb, c2p_rows, p2c_rows = options
    # (on, an array like the output, its spec, its float32 accumulator) in `_backward_kernel`'s order; the
    # temperature's gradient per head is a row per sequence, like the log-sum-exp; the end rows' gradients
    # accumulate over the head, as the tables' do.
    end_rows = pl.BlockSpec((None, 2, d), lambda h_, b_, x, y: (h_, 0, 0))
    items = [(True, k, key_tile, pltpu.VMEM((t, d), jnp.float32)), (True, v, key_tile, pltpu.VMEM((t, d), jnp.float32)),
             (True, q, sequence, pltpu.VMEM((n_pad, d), jnp.float32)), (shape.c2p, ec, whole_table, accumulator),
             (shape.p2c, eq, whole_table, accumulator),
             (shape.bias, eb, pl.BlockSpec((None, 1, 2 * n_pad), lambda h_, b_, x, y: (h_, 0, 0)),
              pltpu.VMEM((1, 2 * n_pad), jnp.float32)),
             (shape.temperature, lse, sequence_row, pltpu.VMEM((1, n_pad), jnp.float32)),
             (shape.far_c2p, c2p_rows, end_rows, pltpu.VMEM((2, d), jnp.float32)),
             (shape.far_p2c, p2c_rows, end_rows, pltpu.VMEM((2, d), jnp.float32))]
    on = [item for item in items if item[0]]
    # p2c's carried products and pending gradient, a tile's; c2p's, every query tile's; the key tile's far sums.
    carried = ([pltpu.VMEM((t, t), jnp.float32)] * (2 * shape.p2c)
               + [pltpu.VMEM((n, t, t), jnp.float32)] * (2 * shape.c2p)
               + [pltpu.VMEM((2, t), jnp.float32)] * shape.far_p2c)
    tables_accumulate = shape.c2p or shape.p2c or shape.bias
    dk, dv, dq, *rest = _call(
        _backward_kernel, shape, (h, b, n, shape.query_band), lambda j, i: (shape.query_tile(j, i), j), inputs,
        tables, [jax.ShapeDtypeStruct(x.shape, x.dtype) for _, x, _, _ in on], [spec for _, _, spec, _ in on],
        [scratch for _, _, _, scratch in on] + carried,
        (_PARALLEL, _ARBITRARY if tables_accumulate else _PARALLEL, _ARBITRARY, _ARBITRARY), resident="k",
        order=order)
    d_ec, d_eq, d_eb, dt, d_cr, d_pr = take(rest, shape.c2p, shape.p2c, shape.bias, shape.temperature,
                                            shape.far_c2p, shape.far_p2c)
    if shape.temperature and temperature.shape[1] == 1:  # one factor for every head
        dt = jnp.sum(dt, axis=1, keepdims=True)
    d_options = (None, None, dt, d_ec, d_eq, d_eb, d_cr, d_pr)
    return dq, dk, dv, None, d_options


_attention.defvjp(_attention_fwd, _attention_bwd)


def pallas_tpu_attention(terms: ScoreTerms, v: jax.Array, key_mask: jax.Array, *, dropout_rate: float = 0.0,
                         dropout_key: jax.Array | None = None, tile: int = TILE) -> jax.Array:
    """Self-attention of any variant, DeBERTa's included, fused for TPUs.

    `terms` carries DeBERTa's projected tables (`pos_key` / `pos_query`, `[H, R, d]`) and the row per distance
    (`relative`), as the dense kernel's shift formulation takes them. Attention dropout (a `dropout_key` and a
    rate) drops exactly the dense kernel's entries. `tile` is for tests (interpret mode runs any size; Mosaic
    needs a multiple of 128).
    """
    shape = kernel_shape(terms, "pallas_tpu", tile, dropout_rate, dropout_key)
    q, k = terms.q, terms.k
    batch, heads, length, _ = q.shape
    relative = terms.relative is not None
    dropout = shape.dropout
    if relative:
        shape = dataclasses.replace(shape, ends=saturation(terms.relative.by_distance, length, length))
    if shape.ends is not None and shape.near_pairs(backward=False).sum() == shape.num_tiles * shape.key_band:
        # The table reaches every distance the grid visits (it grows with the training length, and the model is
        # not scored past it): no far pair, so no end terms to compute.
        shape = dataclasses.replace(shape, ends=None)
    pad = shape.padded - length

    def padded(x):
        return jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)])

    hashes = query_hash = key_hash = temperature = ec = eq = eb = c2p_rows = p2c_rows = None
    if dropout:
        # Hashed outside the kernel, over the whole batch: a device running the kernel on its rows of a sharded
        # batch (below) reads its sequences' hashes, so the mask does not depend on the sharding.
        positions = np.arange(shape.padded)
        hashes = dropout_masks.attention_hashes(dropout_key, batch, heads, positions, positions)
        query_hash, key_hash = jnp.swapaxes(hashes[0], -1, -2), hashes[1]  # a row per head, like the log-sum-exp
    if shape.temperature:  # `[B, 1 or H, N, 1]` -> a row per head (or for every head), like the log-sum-exp
        temperature = jnp.pad(jnp.swapaxes(terms.temperature.astype(jnp.float32), -1, -2),
                              [(0, 0), (0, 0), (0, 0), (0, pad)], constant_values=1.0)
    if shape.c2p or shape.p2c:
        forward, reverse = expand_tables(terms.relative.by_distance, shape)
        # Transposed, `[H, d, 2N]`: distances along lanes, so a head's table fills VMEM without padding d.
        ec = jnp.swapaxes(terms.pos_key[:, reverse], 1, 2) if shape.c2p else None
        eq = jnp.swapaxes(terms.pos_query[:, forward], 1, 2) if shape.p2c else None
        ends = np.asarray(terms.relative.by_distance)[[0, -1]]  # the rows far pairs read, `[H, 2, d]` each
        c2p_rows = terms.pos_key[:, ends] if shape.far_c2p else None
        p2c_rows = terms.pos_query[:, ends] if shape.far_p2c else None
    if shape.bias:  # laid out like the position keys: a tile's slice rotates into place as c2p's products do
        _, reverse = expand_tables(np.arange(2 * length - 1), shape)
        eb = terms.bias[:, None, reverse].astype(jnp.float32)
    mask = jnp.pad(key_mask.astype(jnp.int32), [(0, 0), (0, pad)])[:, None, :]
    attend = batch_shards(functools.partial(_attention, shape),
                          ("rows",) * 4 + (("rows",) * 3 + ("whole",) * 5,))
    out, lse = attend(padded(q), padded(k), padded(v), mask,
                      (query_hash, key_hash, temperature, ec, eq, eb, c2p_rows, p2c_rows))
    out = out[:, :, :length]
    if terms.global_keys is not None and shape.window:
        out = merge_global_keys(terms, v, out, lse[:, :, 0, :length], shape, hashes)
    return out
