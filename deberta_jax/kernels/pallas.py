"""Fused attention for GPUs (Pallas on Triton), forward and backward, for every variant, memory linear in length.

FlashAttention-2's structure: the forward pass runs one program per (sequence, head, query tile), which walks its
key tiles with an online softmax in registers and writes only the output and each row's log-sum-exp. The backward
pass is two kernels, as FlashAttention-2's: the key pass runs one program per key tile, which walks its query tiles
(recomputing each pair's probabilities from the log-sum-exp, accumulating dk and dv), and the query pass one per
query tile, which walks its key tiles (accumulating dq), so nothing is accumulated across programs and no atomics
are needed; each program holds one pass's accumulators only, and the passes run in smaller tiles than the forward
(`Launches.backward_tile`), where no register spills. Which tile pairs a
program visits is the tiling plan the TPU kernel walks too (`tiling.KernelShape`): all of them, or with a window
the band of tiles its windows reach, so a windowed call costs `O(N W)`.

DeBERTa's position terms are read inside the tile, one of two ways. With a table of bounded size (DeBERTa-v3's
published one) the projected tables (`[H, R, d]`) are multiplied by the queries (c2p) and keys (p2c) once per call
outside the kernels, `[B, H, N, R]` (linear in length; recomputed in the backward pass rather than saved), and a
tile gathers `c2p[i, idx(i - j)]` and `p2c[j, idx(i - j)]` with the row per distance gathered from the relative
index: a GPU loads scattered elements from its caches. With a table that grows with the length those products are
quadratic, and each tile pair forms its own instead (`Layout.local`; `kernels.pallas_tpu` forms its skewed products
likewise). ALiBi and T5 read their per-distance bias the way of the first.

The gradient of a gathered term is a sum, per token and table row, of the score gradients whose distance reads
that row. Past some distance each way the relative index is constant (`scores.saturation`), so the backward
kernel writes each token's score gradient per distance only for the distances nearer than that (every
`(token, distance)` once: plain stores, no atomics), and sums the far ones per token and end: the far pairs' end
terms. XLA then multiplies them by the table rows of the band's distances (the side's gradient) and by the tokens,
adding the distances that read the same row (the table's). Tile-local terms send their score gradients back through
the program's scratch into dq and dk, and a third backward kernel sums the tables' gradients per diagonal of tile
pairs. A T5 bias's gradient is the same per-distance
gradient summed over the queries (`ScoreTerms.bias_index` says where its buckets saturate); ALiBi's bias is a
constant and gets none. The per-distance buffers are `[H, B, N, W]` in the inputs' dtype for the W distances
before saturation (DeBERTa-base's 256 buckets saturate at 506 each way, so W = 1,011): linear in length with the
published tables, quadratic with a table grown to the sequence.

Attention dropout is drawn in the tile from hashes of its query and key positions (`dropout_masks.attention_keep`,
the dense kernel's mask), and drawn again in the backward pass. A temperature scales each query's score row, and
its gradient per query is accumulated with dq. A window's global keys (a row's first and last real tokens, seen
by every query) lie in tiles the band skips: they are scored outside and merged through the log-sum-exp, as the
TPU kernel does (`tiling.merge_global_keys`).

Triton compiles the kernels for any NVIDIA GPU from Ampere on (Hopper included) when a program is lowered for
CUDA, also from a machine without a GPU (`deberta_jax.aot`); lowered for any other platform, Pallas interprets
them: exact, slow, for tests.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from deberta_jax.kernels import dropout_masks
from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms, combine_scores, mask_keys, saturation
from deberta_jax.kernels.tiling import KernelShape, batch_shards, kernel_shape, merge_global_keys, take

# From jax 0.11 every lowering of a Triton Pallas call warns that the backend is deprecated (docs/tpu.md says what
# replaces it); once per layer and program is noise in a log that says it elsewhere.
warnings.filterwarnings("ignore", message="The Pallas Triton backend is deprecated", category=DeprecationWarning)

# Queries and keys per tile of the forward (and the padding unit) and of the backward passes. Triton wants powers
# of two of at least 16. Gathering DeBERTa's terms from products, 64 x 64 float32 scores, their gathers and the
# accumulators fit a thread block's registers at head sizes up to 128 in the forward, 32 x 32 in the backward
# passes (whose key pass holds two accumulators); with tile-local terms (`Layout.local`) a tile pair also holds
# its [T, 2T] products, and the tiles halve. At these NVIDIA's assembler spills no register at DeBERTa-base's shape
# on Hopper and Ampere (benchmarks/gpu_attention.py --ptxas; results/aot-gpu/kernel_floor.md).
TILE, BACKWARD_TILE = 64, 32
LOCAL_TILE, LOCAL_BACKWARD_TILE = 32, 16


@dataclasses.dataclass(frozen=True)
class Launch:
    """How Triton runs one kernel's programs: warps per program (threads = 32 x warps; more warps, fewer registers
    per thread for the same tile) and the software-pipelining stages of its loop over tiles (each stage keeps one
    more tile's loads in flight, in registers and shared memory)."""

    num_warps: int
    num_stages: int


@dataclasses.dataclass(frozen=True)
class Launches:
    """The launch of each kernel, and the backward passes' tile."""

    forward: Launch = Launch(4, 2)
    key_pass: Launch = Launch(4, 2)
    query_pass: Launch = Launch(4, 2)
    table_pass: Launch = Launch(4, 2)
    # The backward passes' tile, a power of two capped to the forward's (the call's `tile`); None: BACKWARD_TILE,
    # or LOCAL_BACKWARD_TILE with tile-local terms. A key tile's program holds two accumulators, its score gradient
    # and the gathers' addresses: at 64 x 64 they pass the 255 registers a thread may have and spill (jax's own
    # Pallas attention also runs its backward in smaller blocks than its forward).
    backward_tile: int | None = None
    # DeBERTa's position terms are gathered from `[B, H, N, R]` products formed outside the kernels, with gradients
    # kept per token for the W distances before the relative index saturates, while R + W is at most this (the
    # published table's 512 + 1,011 at any length); past it (a table that grows with the length, where both are
    # quadratic) each tile pair forms its own products with the table rows of its distances (`Layout.local`).
    max_product_width: int = 2048

    def __post_init__(self):
        if self.backward_tile is not None and (self.backward_tile < 8 or self.backward_tile & (self.backward_tile - 1)):
            raise ValueError(f"Launches.backward_tile={self.backward_tile}: a power of two of at least 8 (16 for "
                             "Triton)")

    def of(self, kernel) -> Launch:
        return getattr(self, kernel.__name__.strip("_").removesuffix("_kernel"))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the kernels of one call need besides the tiling plan (static)."""

    shape: KernelShape  # its `ends` are those of the index below
    head_dim: int  # padded to a power of two
    relative: RelativeIndex | None  # DeBERTa's row per distance (`scores.distances` order), None without its terms
    bias_grad: bool  # the bias gets a gradient (T5's table is behind it; ALiBi's is a constant): set per call
    # The distances whose gradient is kept per token: `band_lo .. band_lo + band_width - 1`; the others are summed
    # per token and end (distances <= d_lo, >= d_hi).
    band_lo: int
    band_width: int
    launches: Launches = Launches()
    # DeBERTa's terms formed per tile pair (`Launches.max_product_width`): a tile pair's queries (c2p) or keys
    # (p2c) times the table rows of its 2T - 1 distances, `[T, 2T]`, skewed into place through a program's scratch
    # (Triton has no gather from registers); their gradients flow back the same way, the tables' per diagonal of
    # tile pairs in a third backward kernel. Memory linear in length at any table size.
    local: bool = False

    @property
    def ends(self) -> tuple[int, int] | None:
        return self.shape.ends

    @property
    def query_grads(self) -> bool:
        """Whether the query pass writes a per-distance gradient per query (c2p's, a trainable bias's)."""
        return (self.shape.c2p and not self.local) or self.bias_grad

    @property
    def key_grads(self) -> bool:
        """Whether the key pass writes a per-distance gradient per key (p2c's)."""
        return self.shape.p2c and not self.local

    @property
    def skews(self) -> tuple[bool, bool]:
        """Whether a program keeps a scratch block for the skew of c2p's and of p2c's tile-local products."""
        return self.local and self.shape.c2p, self.local and self.shape.p2c

    @property
    def grad_columns(self) -> int:
        """Columns of a per-distance gradient block: the band and one column that takes every other distance's
        stores (discarded), padded to a power of two for Triton."""
        return pl.next_power_of_2(self.band_width + 1)


def _pad(x, axis: int, size: int, value=0):
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _per_distance(table, length: int, padded: int):
    """A per-distance array (`scores.distances(length, length)` order, last axis) re-indexed for `padded` queries and
    keys: entry `i - j + padded - 1`; distances only padding reaches repeat the nearest real one."""
    index = np.clip(np.arange(2 * padded - 1) - (padded - 1), -(length - 1), length - 1) + length - 1
    return table[..., index] if isinstance(table, np.ndarray) else jnp.take(table, index, axis=-1)


# ----------------------------------------------------------------------------------------------- one tile
@dataclasses.dataclass(frozen=True)
class _Refs:
    """A program's inputs (refs of a `(sequence, head)` block: every token of the sequence), None when off."""

    q: object
    k: object
    v: object
    mask: object
    query_hash: object
    key_hash: object
    temperature: object
    c2p: object  # the products (`[N, R]` of the program's sequence and head)
    p2c: object
    rel: object
    bias: object
    pos_key: object  # the projected tables (`[R, d]` of the head), with `Layout.local`
    pos_query: object
    c2p_skew: object = None  # the program's scratch blocks `[T, 2T]` for the skews, with `Layout.local`
    p2c_skew: object = None
    interpreted: bool = False


def _input_flags(lay: Layout) -> tuple:
    """Which optional inputs a call has, in `_Refs`' order after (q, k, v, mask)."""
    s = lay.shape
    return (s.dropout, s.dropout, s.temperature, s.c2p and not lay.local, s.p2c and not lay.local, s.c2p or s.p2c,
            s.bias, s.c2p and lay.local, s.p2c and lay.local)


def _input_refs(refs: list, lay: Layout) -> _Refs:
    fixed = take(refs, True, True, True, True)
    return _Refs(*fixed, *take(refs, *_input_flags(lay)))


def _with_skews(ins: _Refs, refs: list, lay: Layout, interpreted: bool) -> _Refs:
    """The program's inputs with its skew scratch blocks, the refs after its outputs."""
    c2p_skew, p2c_skew = take(refs, *lay.skews)
    return dataclasses.replace(ins, c2p_skew=c2p_skew, p2c_skew=p2c_skew, interpreted=interpreted)


def _sync(interpreted: bool):
    """Wait for the whole thread block, whose stores to a scratch block other threads then load. Interpreted, a
    program runs in order and has no threads to wait for."""
    if not interpreted:
        plgpu.debug_barrier()


def _skew_columns(t: int):
    """`[T, T]`: the column of each pair (a, b) of a tile pair in its `[T, 2T]` per-distance block, `a - b + T - 1`
    (column m is distance `i - j = (query_tile - key_tile) T + m - (T - 1)`)."""
    local = jnp.arange(t)
    return local[:, None] - local[None, :] + (t - 1)


def _band_table(lay: Layout, refs: _Refs, table_ref, query_tile, key_tile):
    """`[2T, d]`: the table's row for each column of the tile pair's per-distance block (the last column, a distance
    no pair has, repeats a neighbour)."""
    s, t = lay.shape, lay.shape.tile
    first = (query_tile - key_tile) * t - (t - 1) + s.padded - 1
    rows = refs.rel[jnp.clip(first + jnp.arange(2 * t), 0, 2 * s.padded - 2)]
    return table_ref[rows[:, None], jnp.arange(lay.head_dim)[None, :]]


def _local_terms(lay: Layout, refs: _Refs, query_tile, key_tile, q, k):
    """c2p + p2c `[T, T]` float32 of a tile pair from its own products with the table rows of its distances:
    `q [T, d] x rows [2T, d]` (c2p) and `k x rows` (p2c), each stored to the program's scratch block and read back
    at each pair's column (for p2c at its key's row)."""
    t = lay.shape.tile
    columns = _skew_columns(t)
    local = jnp.arange(t)
    parts = [(refs.c2p_skew, q, refs.pos_key, local[:, None]), (refs.p2c_skew, k, refs.pos_query, local[None, :])]
    parts = [part for part in parts if part[0] is not None]
    for scratch, x, table, _ in parts:
        product = plgpu.dot(x, _band_table(lay, refs, table, query_tile, key_tile), trans_b=True)
        scratch[...] = product.astype(scratch.dtype)
    _sync(refs.interpreted)
    terms = sum(scratch[jnp.broadcast_to(rows, columns.shape), columns].astype(jnp.float32)
                for scratch, _, _, rows in parts)
    _sync(refs.interpreted)  # before the next pair's stores
    return terms


def _tokens(tile_index, t: int):
    return pl.ds(pl.multiple_of(tile_index * t, t), t)


def _tile(lay: Layout, refs: _Refs, query_tile, key_tile, q, k):
    """One tile pair: (masked float32 scores `[T, T]`, the scores before the temperature, the temperature column
    or None, the attended keys `[T, T]` bool, the distances `i - j`)."""
    s, t = lay.shape, lay.shape.tile
    padded = s.padded
    query = query_tile * t + jnp.arange(t)
    key = key_tile * t + jnp.arange(t)
    distance = query[:, None] - key[None, :]
    raw = plgpu.dot(q, k, trans_b=True)
    if lay.local:
        raw += _local_terms(lay, refs, query_tile, key_tile, q, k)
    elif s.c2p or s.p2c:
        row = refs.rel[distance + padded - 1]
        if s.c2p:
            raw += refs.c2p[query[:, None], row].astype(jnp.float32)
        if s.p2c:
            raw += refs.p2c[key[None, :], row].astype(jnp.float32)
    bias = refs.bias[distance + padded - 1] if s.bias else None
    scores = combine_scores(raw, 0.0, bias, s.divisor)
    temperature = refs.temperature[_tokens(query_tile, t)][:, None] if s.temperature else None
    attended = jnp.broadcast_to((refs.mask[_tokens(key_tile, t)] != 0)[None, :], (t, t))
    if s.window:
        start = s.window_start(query)[:, None]
        attended = attended & (key[None, :] >= start) & (key[None, :] < start + s.window)
    final = scores if temperature is None else scores * temperature
    return mask_keys(final, attended, (key < s.length)[None, :]), scores, temperature, attended, distance


def _keep(lay: Layout, refs: _Refs, query_tile, key_tile):
    """The tile's attention-dropout keep mask (None without dropout): the dense kernel's."""
    s = lay.shape
    if not s.dropout:
        return None
    return dropout_masks.attention_keep(refs.query_hash[_tokens(query_tile, s.tile)][:, None],
                                        refs.key_hash[_tokens(key_tile, s.tile)][None, :], s.dropout_rate)


# ------------------------------------------------------------------------------------------------ forward
def _forward_kernel(*refs, lay: Layout, interpreted: bool):
    refs = list(refs)
    ins = _input_refs(refs, lay)
    out_ref, lse_ref = take(refs, True, True)
    ins = _with_skews(ins, refs, lay, interpreted)
    s, t = lay.shape, lay.shape.tile
    query_tile = pl.program_id(2)
    q = ins.q[_tokens(query_tile, t), :]

    def visit(step, carry):
        top, norm, acc = carry
        key_tile = s.key_tile(query_tile, step)
        keys = _tokens(key_tile, t)
        scores = _tile(lay, ins, query_tile, key_tile, q, ins.k[keys, :])[0]
        new_top = jnp.maximum(top, scores.max(axis=1))
        correction = jnp.exp(top - new_top)
        p = jnp.exp(scores - new_top[:, None])
        # The normalizer sums every probability; dropout acts on the normalized ones (`dense_attention`'s order).
        norm = norm * correction + p.sum(axis=1)
        dropped = dropout_masks.apply(p, _keep(lay, ins, query_tile, key_tile), s.dropout_rate)
        acc = acc * correction[:, None] + plgpu.dot(dropped.astype(ins.v.dtype), ins.v[keys, :])
        return new_top, norm, acc

    init = (jnp.full((t,), -jnp.inf, jnp.float32), jnp.zeros((t,), jnp.float32),
            jnp.zeros((t, lay.head_dim), jnp.float32))
    top, norm, acc = jax.lax.fori_loop(0, s.key_band, visit, init)
    out_ref[...] = (acc / norm[:, None]).astype(out_ref.dtype)
    lse_ref[...] = top + jnp.log(norm)


# ----------------------------------------------------------------------------------------------- backward
def _score_grad(lay: Layout, ins: _Refs, query_tile, key_tile, q, k, v, do, lse, delta):
    """For one tile pair: the probabilities as the forward pass weighed the values (after dropout), the gradient of
    the scores before the temperature (`g`; masked keys get none), the temperature's gradient per query (None
    without one), and the pair's distances.

    With dropout the output is `sum_j p_ij z_ij v_j` (`z` the kept mask over the keep probability), so the
    probabilities' gradient is `z_ij do_i.v_j`, and its row sum against `p` is still `do_i.out_i` (`delta`)."""
    s = lay.shape
    scores, before, temperature, attended, distance = _tile(lay, ins, query_tile, key_tile, q, k)
    p = jnp.exp(scores - lse[:, None])
    keep = _keep(lay, ins, query_tile, key_tile)
    dp = dropout_masks.apply(plgpu.dot(do, v, trans_b=True), keep, s.dropout_rate)
    ds = jnp.where(attended, p * (dp - delta[:, None]), 0.0)
    dt = None if temperature is None else jnp.sum(ds * before, axis=1)
    g = ds if temperature is None else ds * temperature
    return dropout_masks.apply(p, keep, s.dropout_rate), g, dt, distance


def _by_distance(lay: Layout, grad_ref, g, distance, tokens, near):
    """Store `g` `[T, T]` at each token's (`tokens` `[T, 1]` or `[1, T]`, rows of `grad_ref`) column for its
    distance, where the distance is in the band; the others go to the discarded last column. Returns the sums of
    `g` per token (along the other axis) over the distances at or past each end, (low, high)."""
    in_band = (distance >= lay.band_lo) & (distance < lay.band_lo + lay.band_width)
    column = jnp.where(in_band, distance - lay.band_lo, lay.grad_columns - 1)
    axis = 1 if tokens.shape[0] > 1 else 0

    def store():
        grad_ref[jnp.broadcast_to(tokens, distance.shape), column] = g.astype(grad_ref.dtype)

    if near is True:
        store()
    else:
        pl.when(near)(store)
    if lay.ends is None:
        return None
    d_hi, d_lo = lay.ends
    return (jnp.sum(jnp.where(distance <= d_lo, g, 0.0), axis=axis),
            jnp.sum(jnp.where(distance >= d_hi, g, 0.0), axis=axis))


def _zero_rows(grad_ref, interpreted: bool):
    """Zero a program's rows of a per-distance gradient (the distances no pair of it visits stay 0), a chunk of
    columns at a time (a whole row block of a long band would not fit the registers), then wait for the whole
    thread block: the stores of the pairs that follow, by other threads, must land after the zeros. (Zeros made
    outside the kernel and aliased to its outputs would be buffers XLA may allocate long before the backward pass,
    every layer's at once.) Interpreted, the program runs in order and has no threads to wait for."""
    rows, columns = grad_ref.shape
    chunk = min(columns, 128)

    def zero(i, carry):
        grad_ref[:, pl.ds(pl.multiple_of(i * chunk, chunk), chunk)] = jnp.zeros((rows, chunk), grad_ref.dtype)
        return carry
    jax.lax.fori_loop(0, columns // chunk, zero, 0)
    if not interpreted:
        plgpu.debug_barrier()


def _backward_inputs(refs: list, lay: Layout):
    """A backward program's inputs: the forward's, then the output's cotangent, the log-sum-exp and `delta`."""
    ins = _input_refs(refs, lay)
    return ins, *take(refs, True, True, True)


def _key_pass_kernel(*refs, lay: Layout, interpreted: bool):
    """Program (sequence, head, key tile): dk, dv (and p2c's per-distance gradient, its sums past the ends) of the
    key tile over the query tiles whose windows reach it."""
    refs = list(refs)
    ins, do_ref, lse_ref, delta_ref = _backward_inputs(refs, lay)
    s, t = lay.shape, lay.shape.tile
    ends = lay.key_grads and lay.ends is not None
    dk_ref, dv_ref, grad_ref, lo_ref, hi_ref = take(refs, True, True, lay.key_grads, ends, ends)
    ins = _with_skews(ins, refs, lay, interpreted)
    skew_grad, = take(refs, lay.skews[1])  # p2c's tile-local gradient
    tile = pl.program_id(2)
    _zero_scratch(interpreted, grad_ref, skew_grad)
    local = jnp.arange(t)[None, :]
    k, v = ins.k[_tokens(tile, t), :], ins.v[_tokens(tile, t), :]

    def visit_queries(step, carry):
        dk, dv, lo, hi = carry
        query_tile = s.query_tile(tile, step)
        rows = _tokens(query_tile, t)
        q, do = ins.q[rows, :], do_ref[rows, :]
        p, g, _, distance = _score_grad(lay, ins, query_tile, tile, q, k, v, do, lse_ref[rows], delta_ref[rows])
        dv += plgpu.dot(p.astype(do.dtype), do, trans_a=True)
        dk += plgpu.dot((g / s.divisor).astype(q.dtype), q, trans_a=True)
        if skew_grad is not None:
            dk += _local_side_grad(lay, ins, skew_grad, g, local, ins.pos_query, query_tile, tile)
        if lay.key_grads:
            sums = _by_distance(lay, grad_ref, g, distance, local, s.near(query_tile, tile))
            if sums is not None:
                lo, hi = lo + sums[0], hi + sums[1]
        return dk, dv, lo, hi

    zeros, block = jnp.zeros((t,), jnp.float32), jnp.zeros((t, lay.head_dim), jnp.float32)
    dk, dv, lo, hi = jax.lax.fori_loop(0, s.query_band, visit_queries, (block, block, zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    if lo_ref is not None:
        lo_ref[...], hi_ref[...] = lo, hi


def _query_pass_kernel(*refs, lay: Layout, interpreted: bool):
    """Program (sequence, head, query tile): dq (and c2p's or a bias's per-distance gradient, its sums past the
    ends, the temperature's gradient) of the query tile over the key tiles of its band."""
    refs = list(refs)
    ins, do_ref, lse_ref, delta_ref = _backward_inputs(refs, lay)
    s, t = lay.shape, lay.shape.tile
    ends = lay.query_grads and lay.ends is not None
    dq_ref, grad_ref, lo_ref, hi_ref, dt_ref = take(refs, True, lay.query_grads, ends, ends, s.temperature)
    ins = _with_skews(ins, refs, lay, interpreted)
    skew_grad, = take(refs, lay.skews[0])  # c2p's tile-local gradient
    tile = pl.program_id(2)
    _zero_scratch(interpreted, grad_ref, skew_grad)
    local = jnp.arange(t)[:, None]
    rows = _tokens(tile, t)
    q, do, lse, delta = ins.q[rows, :], do_ref[rows, :], lse_ref[rows], delta_ref[rows]

    def visit_keys(step, carry):
        dq, dt, lo, hi = carry
        key_tile = s.key_tile(tile, step)
        keys = _tokens(key_tile, t)
        k = ins.k[keys, :]
        _, g, dt_pair, distance = _score_grad(lay, ins, tile, key_tile, q, k, ins.v[keys, :], do, lse, delta)
        dq += plgpu.dot((g / s.divisor).astype(k.dtype), k)
        if skew_grad is not None:
            dq += _local_side_grad(lay, ins, skew_grad, g, local, ins.pos_key, tile, key_tile)
        if dt_pair is not None:
            dt += dt_pair
        if lay.query_grads:
            sums = _by_distance(lay, grad_ref, g, distance, local, s.near(tile, key_tile))
            if sums is not None:
                lo, hi = lo + sums[0], hi + sums[1]
        return dq, dt, lo, hi

    zeros = jnp.zeros((t,), jnp.float32)
    dq, dt, lo, hi = jax.lax.fori_loop(0, s.key_band, visit_keys,
                                       (jnp.zeros((t, lay.head_dim), jnp.float32), zeros, zeros, zeros))
    dq_ref[...] = dq.astype(dq_ref.dtype)
    if dt_ref is not None:
        dt_ref[...] = dt
    if lo_ref is not None:
        lo_ref[...], hi_ref[...] = lo, hi


def _zero_scratch(interpreted: bool, grad_ref, *blocks):
    """Zero what a backward program accumulates into, where it has it: its rows of a per-distance gradient
    (`_zero_rows`), and its `[T, 2T]` gradient blocks of tile-local terms, once (every tile pair stores its pairs to
    the same T columns of each row, `_skew_columns`, so the others stay 0)."""
    if grad_ref is not None:
        _zero_rows(grad_ref, interpreted)
    blocks = [block for block in blocks if block is not None]
    for block in blocks:
        block[...] = jnp.zeros(block.shape, block.dtype)
    if blocks:
        _sync(interpreted)


def _skewed_grad(lay: Layout, refs: _Refs, scratch, g, rows):
    """`g` `[T, T]` laid out per distance, `[T, 2T]`: stored at each pair's column of its query's (c2p; `rows`
    `[T, 1]`) or key's (p2c; `[1, T]`) row of the scratch block, and read back whole."""
    columns = _skew_columns(lay.shape.tile)
    scratch[jnp.broadcast_to(rows, columns.shape), columns] = g.astype(scratch.dtype)
    _sync(refs.interpreted)
    block = scratch[...]
    _sync(refs.interpreted)  # before the next pair's stores
    return block


def _local_side_grad(lay: Layout, refs: _Refs, scratch, g, rows, table_ref, query_tile, key_tile):
    """A tile-local position term's share of its side's gradient `[T, d]` float32 (dq for c2p, dk for p2c): the
    score gradients per distance times the table rows of those distances."""
    block = _skewed_grad(lay, refs, scratch, g, rows)
    table = _band_table(lay, refs, table_ref, query_tile, key_tile).astype(block.dtype)
    return plgpu.dot(block, table) / lay.shape.divisor


def _table_pass_kernel(*refs, lay: Layout, interpreted: bool):
    """Program (sequence, head, diagonal): with `Layout.local`, the gradient of the table rows of one diagonal's
    distances (the tile pairs whose query tile minus key tile is the same: their per-distance blocks share their
    columns' distances), `[2T, d]` float32 per position term, summed over the diagonal's pairs. The table's
    gradient is then a sum of these per distance (`_local_table_grads`): no atomics, nothing quadratic."""
    refs = list(refs)
    ins, do_ref, lse_ref, delta_ref = _backward_inputs(refs, lay)
    c2p, p2c = lay.skews
    key_table_ref, query_table_ref = take(refs, c2p, p2c)
    ins = _with_skews(ins, refs, lay, interpreted)
    c2p_grad, p2c_grad = take(refs, c2p, p2c)
    _zero_scratch(interpreted, None, c2p_grad, p2c_grad)
    s, t = lay.shape, lay.shape.tile
    n = s.num_tiles
    diagonal = pl.program_id(2) - (n - 1)
    local = jnp.arange(t)
    parts = [part for part in ((c2p_grad, local[:, None], key_table_ref), (p2c_grad, local[None, :], query_table_ref))
             if part[0] is not None]

    def visit(step, grads):
        query_tile = jnp.maximum(diagonal, 0) + step
        key_tile = query_tile - diagonal
        rows, keys = _tokens(query_tile, t), _tokens(key_tile, t)
        q, k = ins.q[rows, :], ins.k[keys, :]
        _, g, _, _ = _score_grad(lay, ins, query_tile, key_tile, q, k, ins.v[keys, :], do_ref[rows, :],
                                 lse_ref[rows], delta_ref[rows])
        columns = _skew_columns(t)
        for scratch, side, _ in parts:
            scratch[jnp.broadcast_to(side, columns.shape), columns] = g.astype(scratch.dtype)
        _sync(interpreted)
        # c2p's rows take their queries, p2c's their keys.
        grads = tuple(acc + plgpu.dot(scratch[...], x, trans_a=True)
                      for acc, (scratch, _, _), x in zip(grads, parts, (q, k) if c2p else (k,)))
        _sync(interpreted)
        return grads

    zeros = tuple(jnp.zeros((2 * t, lay.head_dim), jnp.float32) for _ in parts)
    grads = jax.lax.fori_loop(0, n - jnp.abs(diagonal), visit, zeros)
    for grad, (_, _, out_ref) in zip(grads, parts):
        out_ref[...] = grad


# ------------------------------------------------------------------------------------------------ plumbing
def _call(kernel, lay: Layout, inputs, out_shapes, out_specs, scratch=(), programs: int | None = None):
    """One pallas_call over (sequence, head, tile): Triton when lowered for a GPU, Pallas' interpreter elsewhere.
    `inputs` are (array, block) pairs: "sequence" arrays `[B, H, N, ...]` read whole per (sequence, head), "mask"
    `[B, N]`, "heads" `[H, ...]` (one head's slice), "shared" (one block for every program). `scratch`: a
    `[T, width]` block of `dtype` per program for each (width, dtype), passed after the outputs and not returned
    (Pallas' Triton backend has no scratch memory of its own). `programs`: per (sequence, head); default a tile's."""
    b, h = inputs[0][0].shape[:2]
    programs = programs or lay.shape.num_tiles
    grid = (b, h, programs)
    t = lay.shape.tile
    out_shapes = list(out_shapes) + [jax.ShapeDtypeStruct((b, h, programs, t, width), dtype)
                                     for width, dtype in scratch]
    out_specs = list(out_specs) + [
        pl.BlockSpec((None, None, None, t, width), lambda b_, h_, i: (b_, h_, i, 0, 0)) for width, _ in scratch]

    def spec(x, block):
        if block == "sequence":
            shared_heads = x.shape[1] == 1 and h > 1  # a temperature without a head axis
            return pl.BlockSpec((None, None) + x.shape[2:],
                                lambda b_, h_, i: (b_, 0 if shared_heads else h_) + (0,) * (x.ndim - 2))
        if block == "mask":
            return pl.BlockSpec((None, x.shape[1]), lambda b_, h_, i: (b_, 0))
        if block == "heads":
            return pl.BlockSpec((None,) + x.shape[1:], lambda b_, h_, i: (h_,) + (0,) * (x.ndim - 1))
        return pl.BlockSpec(x.shape, lambda b_, h_, i: (0,) * x.ndim)

    arrays = [x for x, _ in inputs]
    in_specs = [spec(x, block) for x, block in inputs]
    launch = lay.launches.of(kernel)

    def run(interpret, *args):
        return pl.pallas_call(
            functools.partial(kernel, lay=lay, interpreted=interpret), grid=grid, in_specs=in_specs,
            out_specs=out_specs, out_shape=out_shapes, interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=launch.num_warps, num_stages=launch.num_stages),
            name=kernel.__name__.strip("_"))(*args)

    # Triton when the program is lowered for a GPU (also from a machine without one), the interpreter elsewhere.
    outputs = jax.lax.platform_dependent(*arrays, cuda=functools.partial(run, False),
                                         default=functools.partial(run, True))
    return tuple(outputs)[:len(outputs) - len(scratch)]


def _skew_scratch(lay: Layout, dtype, gradients: tuple[bool, bool] = (False, False)) -> list:
    """The scratch blocks of a kernel with `Layout.local`: one `[T, 2T]` per tile-local position term for its
    products, then one per term flagged in `gradients` (c2p, p2c) for its score gradients."""
    width = 2 * lay.shape.tile
    return [(width, dtype) for on in lay.skews if on] + [(width, dtype) for on, grad in zip(lay.skews, gradients)
                                                         if on and grad]


def _per_tile(t: int, width: int | None = None):
    """The output block of a program's tile: rows `tile * T ...` of a `[B, H, N]` or `[B, H, N, width]` array."""
    if width is None:
        return pl.BlockSpec((None, None, t), lambda b_, h_, i: (b_, h_, i))
    return pl.BlockSpec((None, None, t, width), lambda b_, h_, i: (b_, h_, i, 0))


def _products(q, k, options, lay: Layout):
    """c2p `[B, H, N, R]` (queries against the position keys) and p2c (keys against the position queries)."""
    pos_key, pos_query = options[3], options[4]
    c2p = jnp.einsum("bhnd,hrd->bhnr", q, pos_key) if lay.shape.c2p and not lay.local else None
    p2c = jnp.einsum("bhnd,hrd->bhnr", k, pos_query) if lay.shape.p2c and not lay.local else None
    return c2p, p2c


def _inputs(lay: Layout, q, k, v, mask, options):
    s = lay.shape
    rel = None if lay.relative is None else _per_distance(lay.relative.by_distance, s.length, s.padded)
    query_hash, key_hash, temperature, pos_key, pos_query, bias = options
    c2p, p2c = _products(q, k, options, lay)
    items = [(query_hash, "sequence"), (key_hash, "sequence"), (temperature, "sequence"), (c2p, "sequence"),
             (p2c, "sequence"), (rel, "shared"), (bias, "heads"), (pos_key, "heads"), (pos_query, "heads")]
    optional = [item for item, flag in zip(items, _input_flags(lay)) if flag]
    return [(q, "sequence"), (k, "sequence"), (v, "sequence"), (mask, "mask")] + optional


def _forward(lay: Layout, q, k, v, mask, options):
    b, h, n_pad, d = q.shape
    t = lay.shape.tile
    return _call(_forward_kernel, lay, _inputs(lay, q, k, v, mask, options),
                 [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, n_pad), jnp.float32)],
                 [_per_tile(t, d), _per_tile(t)], scratch=_skew_scratch(lay, q.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(lay: Layout, q, k, v, mask, options):
    """(output, log-sum-exp `[B, H, N]`), both differentiable: global keys merge into the call's softmax through
    its log-sum-exp. `options`: (query hashes, key hashes, temperature, position keys, position queries, bias)."""
    return _forward(lay, q, k, v, mask, options)


def _attention_fwd(lay, q, k, v, mask, options):
    # Whether the bias is perturbed (has a tangent): a constant bias (ALiBi's) needs no per-distance gradient.
    bias_grad = lay.shape.bias and options[5].perturbed
    q, k, v, mask, options = jax.custom_derivatives.custom_vjp_primal_tree_values((q, k, v, mask, options))
    out, lse = _forward(lay, q, k, v, mask, options)
    # The flag rides in the residuals' structure (an empty tuple or None): residuals hold no Python values.
    return (out, lse), (q, k, v, mask, options, out, lse, () if bias_grad else None)


def _attention_bwd(lay: Layout, residuals, cotangents):
    q, k, v, mask, options, out, lse, bias_grad = residuals
    lay = dataclasses.replace(lay, bias_grad=bias_grad is not None)
    d_out, d_lse = cotangents
    if isinstance(d_lse, jax.custom_derivatives.SymbolicZero):  # no global keys read the log-sum-exp
        d_lse = 0.0
    # The backward passes walk the same padded arrays in their own tile.
    backward_tile = lay.launches.backward_tile or (LOCAL_BACKWARD_TILE if lay.local else BACKWARD_TILE)
    lay = dataclasses.replace(lay, shape=dataclasses.replace(
        lay.shape, tile=min(backward_tile, lay.shape.tile), pad_unit=lay.shape.pad_unit or lay.shape.tile))
    s, t = lay.shape, lay.shape.tile
    b, h, n_pad, d = q.shape
    # The c2p / p2c products recomputed below depend on saved values only: without this barrier XLA may compute
    # every layer's at the start of the backward pass and hold them all (4.8 GB for DeBERTa-base at 16k tokens).
    q, k, options, d_out = jax.lax.optimization_barrier((q, k, options, d_out))
    # The score gradient is p * (dp - delta); the log-sum-exp's cotangent adds p * d_lse (its gradient is p).
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
    inputs = _inputs(lay, q, k, v, mask, options) + [(d_out, "sequence"), (lse, "sequence"),
                                                          (delta, "sequence")]
    columns = lay.grad_columns
    per_token = jax.ShapeDtypeStruct((b, h, n_pad), jnp.float32)
    # In the inputs' dtype, as the dense kernel's score gradient reaches its gathered terms; heads first, so that
    # their products with the tokens over (sequence, token) are batched matmuls without a transposed copy.
    grads = jax.ShapeDtypeStruct((h, b, n_pad, columns), q.dtype)
    per_distance = pl.BlockSpec((None, None, t, columns), lambda b_, h_, i: (h_, b_, i, 0))
    key_ends = lay.key_grads and lay.ends is not None
    query_ends = lay.query_grads and lay.ends is not None

    def run(kernel, items, gradients=(False, False), programs=None):
        """items: (on, shape, spec) in the kernel's output order; None for each that is off."""
        on = [item for item in items if item[0]]
        outputs = _call(kernel, lay, inputs, [shape for _, shape, _ in on], [spec for *_, spec in on],
                        scratch=_skew_scratch(lay, q.dtype, gradients), programs=programs)
        return take(list(outputs), *[item[0] for item in items])

    # Two passes, as FlashAttention-2's backward: a program of each holds one pass's accumulators only.
    dk, dv, key_grad, key_lo, key_hi = run(_key_pass_kernel, [
        (True, jax.ShapeDtypeStruct(k.shape, k.dtype), _per_tile(t, d)),
        (True, jax.ShapeDtypeStruct(v.shape, v.dtype), _per_tile(t, d)),
        (lay.key_grads, grads, per_distance), (key_ends, per_token, _per_tile(t)),
        (key_ends, per_token, _per_tile(t))], gradients=(False, True))
    dq, query_grad, query_lo, query_hi, dt = run(_query_pass_kernel, [
        (True, jax.ShapeDtypeStruct(q.shape, q.dtype), _per_tile(t, d)), (lay.query_grads, grads, per_distance),
        (query_ends, per_token, _per_tile(t)), (query_ends, per_token, _per_tile(t)),
        (s.temperature, per_token, _per_tile(t))], gradients=(True, False))

    _, _, temperature, pos_key, pos_query, bias = options
    d_pos_key = d_pos_query = d_bias = None
    if lay.local:
        diagonals = 2 * s.num_tiles - 1
        per_diagonal = jax.ShapeDtypeStruct((b, h, diagonals, 2 * t, d), jnp.float32)
        spec = pl.BlockSpec((None, None, None, 2 * t, d), lambda b_, h_, i: (b_, h_, i, 0, 0))
        key_table, query_table = run(_table_pass_kernel, [(s.c2p, per_diagonal, spec), (s.p2c, per_diagonal, spec)],
                                     gradients=(True, True), programs=diagonals)
        d_pos_key = None if key_table is None else _local_table_grads(lay, key_table, pos_key)
        d_pos_query = None if query_table is None else _local_table_grads(lay, query_table, pos_query)
    else:
        if s.c2p:
            dq_terms, d_pos_key = _table_grads(lay, query_grad, query_lo, query_hi, q, pos_key)
            dq = (dq.astype(jnp.float32) + dq_terms).astype(dq.dtype)
        if s.p2c:
            dk_terms, d_pos_query = _table_grads(lay, key_grad, key_lo, key_hi, k, pos_query)
            dk = (dk.astype(jnp.float32) + dk_terms).astype(dk.dtype)
    if lay.bias_grad:
        d_bias = _bias_grad(lay, query_grad, query_lo, query_hi, bias.shape[-1]).astype(bias.dtype)
    if s.temperature and temperature.shape[1] == 1:  # one factor for every head
        dt = jnp.sum(dt, axis=1, keepdims=True)
    # Released together: the tables' and the bias's gradients (off the path to the layer below) would otherwise be
    # left for later by XLA's scheduler, keeping every layer's per-distance gradients alive until then.
    grads = jax.lax.optimization_barrier((dq, dk, dv, (dt, d_pos_key, d_pos_query, d_bias)))
    dq, dk, dv, (dt, d_pos_key, d_pos_query, d_bias) = grads
    return dq, dk, dv, None, (None, None, dt, d_pos_key, d_pos_query, d_bias)


def _local_table_grads(lay: Layout, per_diagonal, table):
    """A table's gradient from the table pass's blocks (`[B, H, 2n - 1, 2T, d]` float32, n tiles): each block row
    (a diagonal's distance) added to the table row that distance reads."""
    s, t = lay.shape, lay.shape.tile
    n = s.num_tiles
    distance = (np.arange(2 * n - 1) - (n - 1))[:, None] * t - (t - 1) + np.arange(2 * t)[None, :]
    by_distance = _per_distance(lay.relative.by_distance, s.length, s.padded)
    rows = by_distance[np.clip(distance + s.padded - 1, 0, 2 * s.padded - 2)].reshape(-1)
    b, h, _, _, d = per_diagonal.shape
    summed = per_diagonal.sum(axis=0).reshape(h, -1, d)
    d_table = jnp.zeros(table.shape, jnp.float32).at[:, rows].add(summed)
    return (d_table / s.divisor).astype(table.dtype)


def _table_grads(lay: Layout, grad, lo, hi, x, table):
    """A position term's share of its side's gradient (`[B, H, N, d]` float32) and its table's gradient, from the
    score gradients per token and band distance `grad` (`[H, B, N, columns]`; and the sums past each end, `lo`,
    `hi`) and the side's tokens `x` (queries for c2p, keys for p2c). The band's table rows, one per distance
    (`[H, W, d]`, a gather of the small table; zeros for the discarded columns), turn the per-distance gradients into
    the side's with one product; the table's gradient adds the distances that read the same row (a segment sum of
    `[H, W, d]`). No per-row `[B, H, N, R]` array is formed, and the big per-distance array is read as it is."""
    by_distance = lay.relative.by_distance
    width = lay.band_width
    rows = by_distance[lay.band_lo + np.arange(width) + lay.shape.length - 1]
    f32 = jnp.float32
    band_table = _pad(table[:, rows].astype(grad.dtype), 1, grad.shape[-1])
    x_heads = jnp.swapaxes(x, 0, 1).astype(grad.dtype)  # [H, B, N, d]
    # Products in the inputs' dtype (a GPU accumulates them in float32 and rounds the result once).
    side = jnp.swapaxes(jnp.einsum("hbnm,hmd->hbnd", grad, band_table), 0, 1).astype(f32)
    per_distance = jnp.einsum("hbnm,hbnd->hmd", grad, x_heads)[:, :width].astype(f32)
    d_table = jnp.zeros(table.shape, f32).at[:, rows].add(per_distance)
    if lay.ends is not None:
        for sums, row in ((lo, by_distance[0]), (hi, by_distance[-1])):
            side = side + sums[..., None] * table[:, None, row].astype(f32)
            d_table = d_table.at[:, row].add(jnp.einsum("bhn,bhnd->hd", sums, x.astype(f32)))
    divisor = lay.shape.divisor
    return side / divisor, (d_table / divisor).astype(table.dtype)


def _bias_grad(lay: Layout, grad, lo, hi, width: int):
    """A trainable bias's gradient per distance `[H, 2N - 1]` from the per-query score gradients: each band
    distance's sum over the queries; the sums past each end all go to the end's first distance (every distance
    past it reads the same bucket, so the gradient of the bucket table is the same). In the padded per-distance
    layout the kernels read (`_per_distance`)."""
    n = lay.shape.padded
    out = jnp.zeros((grad.shape[0], width), jnp.float32)
    per_distance = grad.astype(jnp.float32).sum(axis=(1, 2))[:, :lay.band_width]
    out = out.at[:, lay.band_lo + n - 1 + np.arange(lay.band_width)].add(per_distance)
    if lay.ends is not None:
        d_hi, d_lo = lay.ends
        out = out.at[:, d_lo + n - 1].add(lo.sum(axis=(0, 2))).at[:, d_hi + n - 1].add(hi.sum(axis=(0, 2)))
    return out


_attention.defvjp(_attention_fwd, _attention_bwd, symbolic_zeros=True)


def _tile_local(terms: ScoreTerms, launches: Launches) -> bool:
    """Whether DeBERTa's terms are formed per tile pair (`Layout.local`): their products and per-distance gradients
    would be wider than `launches.max_product_width` (table rows plus distances before the index saturates)."""
    if terms.relative is None or (terms.pos_key is None and terms.pos_query is None):
        return False
    n = terms.q.shape[-2]
    ends = saturation(terms.relative.by_distance, n, n)
    width = 2 * n - 1 if ends is None else ends[0] - ends[1] - 1
    rows = (terms.pos_key if terms.pos_key is not None else terms.pos_query).shape[1]
    return rows + width > launches.max_product_width


def _layout(terms: ScoreTerms, shape: KernelShape, head_dim: int, launches: Launches, local: bool) -> Layout:
    """The call's layout: its band of per-distance gradients covers the distances before each indexed term's index
    saturates (DeBERTa's relative index unless tile-local, a bias's buckets); a bias without buckets (ALiBi's,
    differentiated only in tests) needs every distance."""
    n = shape.length
    relative = shape.c2p or shape.p2c
    indices = [terms.relative] * (relative and not local) + [terms.bias_index] * shape.bias
    ends = [None if index is None else saturation(index.by_distance, n, n) for index in indices]
    d_hi, d_lo = n, -n  # every distance
    if ends and None not in ends:
        d_hi, d_lo = max(hi for hi, _ in ends), min(lo for _, lo in ends)
    return Layout(dataclasses.replace(shape, ends=None if d_hi == n else (d_hi, d_lo)), head_dim,
                  relative=terms.relative if relative else None, bias_grad=shape.bias, band_lo=d_lo + 1,
                  band_width=d_hi - d_lo - 1, launches=launches, local=local)


def pallas_attention(terms: ScoreTerms, v: jax.Array, key_mask: jax.Array, *, dropout_rate: float = 0.0,
                     dropout_key: jax.Array | None = None, tile: int | None = None,
                     launches: Launches = Launches()) -> jax.Array:
    """Self-attention of any variant, DeBERTa's included, fused for GPUs: the dense kernel's result to float
    rounding, attention dropout included (the same mask).

    `terms` carries DeBERTa's projected tables (`pos_key` / `pos_query`, `[H, R, d]`) and the row per distance
    (`relative`), as the TPU kernel takes them. `tile` (the forward's, a power of two, at least 16 for Triton; None:
    TILE, or LOCAL_TILE with tile-local terms) and `launches` are Triton's knobs: tests take small tiles,
    `benchmarks/gpu_check.sh` times other settings."""
    local = _tile_local(terms, launches)
    shape = kernel_shape(terms, "pallas", tile or (LOCAL_TILE if local else TILE), dropout_rate, dropout_key)
    batch, heads, length, d = terms.q.shape
    q, k = terms.q, terms.k
    head_dim = max(16, pl.next_power_of_2(d))  # zero features change no product
    lay = _layout(terms, shape, head_dim, launches, local)
    n_pad = shape.padded

    def padded(x):
        return _pad(_pad(x, 3, head_dim), 2, n_pad)

    hashes = query_hash = key_hash = temperature = bias = None
    if shape.dropout:
        # Hashed outside the kernel, over the whole batch: a device running the kernel on its rows of a sharded
        # batch reads its sequences' hashes, so the mask does not depend on the sharding.
        positions = np.arange(n_pad)
        hashes = dropout_masks.attention_hashes(dropout_key, batch, heads, positions, positions)
        query_hash, key_hash = hashes[0][..., 0], hashes[1][..., 0, :]
    if shape.temperature:  # `[B, 1 or H, N, 1]` -> `[B, 1 or H, N]`
        temperature = _pad(terms.temperature[..., 0].astype(jnp.float32), 2, n_pad, 1.0)
    if shape.bias:
        bias = _per_distance(terms.bias.astype(jnp.float32), length, n_pad)
    mask = _pad(key_mask.astype(jnp.int32), 1, n_pad)
    pos_key = None if not shape.c2p else _pad(terms.pos_key, 2, head_dim)
    pos_query = None if not shape.p2c else _pad(terms.pos_query, 2, head_dim)
    attend = batch_shards(functools.partial(_attention, lay),
                          ("rows", "rows", "rows", "rows", ("rows", "rows", "rows", "whole", "whole", "whole")))
    out, lse = attend(padded(q), padded(k), padded(v), mask,
                      (query_hash, key_hash, temperature, pos_key, pos_query, bias))
    out = out[:, :, :length, :d]
    if terms.global_keys is not None and shape.window:
        out = merge_global_keys(terms, v, out, lse[:, :, :length], shape, hashes)
    return out
