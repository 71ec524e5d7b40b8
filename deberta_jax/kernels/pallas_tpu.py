"""Fused disentangled attention for TPUs (Pallas / Mosaic), forward and backward, memory linear in length.

The Triton kernel (`kernels.pallas`) reads DeBERTa's position terms with element gathers inside a tile, which a
TPU's vector unit runs slowly and Mosaic hardly supports. Here the terms are matrix-unit work and lane rotations:

- Outside the kernel each projected relative table (`[H, R, d]`) is expanded to one row per distance,
  `[H, 2N, d]` (`expand_tables`; `O(N d)`, the only gather). Position keys are laid out by decreasing distance,
  position queries by increasing distance.
- For a tile of `T` queries at `i0` and `T` keys at `j0`, the distances `i - j` of its pairs span the `2T - 1`
  consecutive rows starting at `i0 - j0 - (T - 1)`: two aligned `[T, d]` blocks of the expanded table (aligned
  because `i0 - j0` is a multiple of `T`). `q_tile @ rows^T` is `[T, 2T]` on the matrix unit: query `a` against
  every distance of the tile. Rotating row `a` by `T + 1 + a` lanes (`pltpu.roll` with a stride) moves the entry
  for key `c` to column `c`: the relative shift of Transformer-XL done per tile, with no `[N, N]` tensor. p2c is
  the same with keys and position queries, transposed.
- The softmax is FlashAttention's online softmax over key tiles (grid axis 3), saving each row's log-sum-exp.

The backward pass recomputes each tile's probabilities from the log-sum-exp in three kernels, each owning the
gradients it accumulates: queries (and c2p's share of them) over key tiles, keys and values (and p2c's share)
over query tiles, and the expanded tables over the tiles of one diagonal `i0 - j0`, where every pair reads the
same `2T` table rows. The inverse rotation (`_unskew`) takes a score gradient back to per-distance columns;
the per-diagonal table gradients overlap by `T` rows and are added outside (`_overlap_add`).

Scope: self-attention (as many queries as keys), a key padding mask, c2p and p2c each optional, any bucketing
(the expansion reads the per-distance index). No attention dropout, per-distance bias, temperature or window:
those are refused with the fix. On a TPU the kernels are compiled by Mosaic (also when a program is compiled
for a TPU from another machine, `deberta_jax.aot`); elsewhere Pallas interprets them (exact, slow: tests).
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
from jax.sharding import PartitionSpec

from deberta_jax.kernels.scores import ScoreTerms, mask_keys

# Queries and keys per tile: one lane width, so the `[T, 2T]` products and their rotation fill whole vregs and
# the matrix unit (128 x 128 on v5e) runs full tiles.
TILE = 128


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What every kernel of one call shares (static)."""

    length: int  # real queries = keys
    tile: int
    divisor: float
    c2p: bool
    p2c: bool

    @property
    def num_tiles(self) -> int:
        return -(-self.length // self.tile)

    @property
    def padded(self) -> int:
        return self.num_tiles * self.tile


def expand_tables(by_distance: np.ndarray, length: int, tile: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indices into the relative table for the two expanded layouts, `2 * padded` rows each.

    Forward layout (position queries): row `r` is distance `r - (padded - 1)`. Reversed layout (position keys):
    row `r` is distance `padded - 1 - r`. `by_distance` is `scores.distances(length, length)` order; distances
    that only padding positions reach repeat the nearest real one (their scores are masked).
    """
    padded = -(-length // tile) * tile
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


def _scores(shape: _Shape, q, k, ec, eq, real, key_tile):
    """Masked float32 scores `[T, T]` of one tile; `ec` / `eq` are its `[2T, d]` expanded rows (or None)."""
    t = shape.tile
    raw = _dot_t(q, k)
    if shape.c2p:
        raw = raw + _skew(_dot_t(q, ec), t)
    if shape.p2c:
        raw = raw + _skew(_dot_t(k, eq), t).T
    positions = key_tile * t + jax.lax.broadcasted_iota(jnp.int32, (1, t), 1)
    return mask_keys(raw / shape.divisor, real, positions < shape.length)


def _rows(lo_ref, hi_ref):
    return None if lo_ref is None else jnp.concatenate([lo_ref[...], hi_ref[...]], axis=0)


def _split_refs(refs, shape: _Shape, count: int):
    """The leading `count` refs, then c2p's two row blocks and p2c's (None when off), then the rest."""
    refs = list(refs)
    head, refs = refs[:count], refs[count:]
    ec = (refs.pop(0), refs.pop(0)) if shape.c2p else (None, None)
    eq = (refs.pop(0), refs.pop(0)) if shape.p2c else (None, None)
    return head, ec, eq, refs


# ------------------------------------------------------------------------------------------------- forward
def _forward_kernel(*refs, shape: _Shape):
    (q_ref, k_ref, v_ref, mask_ref), ec, eq, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _split_refs(refs, shape, 4)
    key_tile = pl.program_id(3)

    @pl.when(key_tile == 0)
    def _():
        m_sc[...] = jnp.full_like(m_sc, -jnp.inf)
        l_sc[...] = jnp.zeros_like(l_sc)
        acc_sc[...] = jnp.zeros_like(acc_sc)

    s = _scores(shape, q_ref[...], k_ref[...], _rows(*ec), _rows(*eq), mask_ref[...] != 0, key_tile)
    m_prev = m_sc[...]
    m_new = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
    correction = jnp.exp(m_prev - m_new)
    p = jnp.exp(s - m_new)
    l_sc[...] = l_sc[...] * correction + p.sum(axis=1, keepdims=True)
    acc_sc[...] = acc_sc[...] * correction + _dot(p.astype(v_ref.dtype), v_ref[...])
    m_sc[...] = m_new

    @pl.when(key_tile == pl.num_programs(3) - 1)
    def _():
        o_ref[...] = (acc_sc[...] / l_sc[...]).astype(o_ref.dtype)
        lse_ref[...] = m_sc[...] + jnp.log(l_sc[...])


# ------------------------------------------------------------------------------------------------ backward
def _score_grad(shape: _Shape, q, k, v, ec, eq, real, key_tile, do, lse, delta):
    """Probabilities and the gradient of the raw score sum `q.k + c2p + p2c` of one tile (masked keys get none)."""
    p = jnp.exp(_scores(shape, q, k, ec, eq, real, key_tile) - lse)
    dp = _dot_t(do, v)
    return p, jnp.where(real, p * (dp - delta), 0.0) / shape.divisor


def _dq_kernel(*refs, shape: _Shape):
    (q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref), ec, eq, (dq_ref, dq_sc) = _split_refs(refs, shape, 7)
    key_tile = pl.program_id(3)

    @pl.when(key_tile == 0)
    def _():
        dq_sc[...] = jnp.zeros_like(dq_sc)

    k, ec_rows = k_ref[...], _rows(*ec)
    _, ds = _score_grad(shape, q_ref[...], k, v_ref[...], ec_rows, _rows(*eq), mask_ref[...] != 0, key_tile,
                        do_ref[...], lse_ref[...], delta_ref[...])
    dq = _dot(ds.astype(k.dtype), k)
    if shape.c2p:
        dq = dq + _dot(_unskew(ds, shape.tile).astype(ec_rows.dtype), ec_rows)
    dq_sc[...] += dq

    @pl.when(key_tile == pl.num_programs(3) - 1)
    def _():
        dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(*refs, shape: _Shape):
    (q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref), ec, eq, rest = _split_refs(refs, shape, 7)
    dk_ref, dv_ref, dk_sc, dv_sc = rest
    query_tile = pl.program_id(3)

    @pl.when(query_tile == 0)
    def _():
        dk_sc[...] = jnp.zeros_like(dk_sc)
        dv_sc[...] = jnp.zeros_like(dv_sc)

    q, do, eq_rows = q_ref[...], do_ref[...], _rows(*eq)
    p, ds = _score_grad(shape, q, k_ref[...], v_ref[...], _rows(*ec), eq_rows, mask_ref[...] != 0,
                        pl.program_id(2), do, lse_ref[...], delta_ref[...])
    dk = _dot(ds.T.astype(q.dtype), q)
    if shape.p2c:
        dk = dk + _dot(_unskew(ds.T, shape.tile).astype(eq_rows.dtype), eq_rows)
    dk_sc[...] += dk
    dv_sc[...] += _dot(p.T.astype(do.dtype), do)

    @pl.when(query_tile == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = dk_sc[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_sc[...].astype(dv_ref.dtype)


def _diagonal(shape: _Shape, diagonal, step):
    """Query and key tile of step `step` along tile diagonal `diagonal` (`i - j = diagonal - (n - 1)`), clamped
    into range, and whether the step is real (a diagonal off the main one has fewer tiles)."""
    n = shape.num_tiles
    offset = diagonal - (n - 1)
    query_tile = jnp.maximum(offset, 0) + step
    key_tile = query_tile - offset
    real = jnp.logical_and(query_tile < n, key_tile < n)
    return jnp.minimum(query_tile, n - 1), jnp.minimum(key_tile, n - 1), real


def _dtable_kernel(*refs, shape: _Shape):
    (q_ref, k_ref, v_ref, mask_ref, do_ref, lse_ref, delta_ref), ec, eq, rest = _split_refs(refs, shape, 7)
    outs, scratch = rest[:len(rest) // 2], rest[len(rest) // 2:]
    step = pl.program_id(3)
    _, key_tile, real = _diagonal(shape, pl.program_id(2), step)

    @pl.when(step == 0)
    def _():
        for acc in scratch:
            acc[...] = jnp.zeros_like(acc)

    @pl.when(real)
    def _():
        q, k = q_ref[...], k_ref[...]
        _, ds = _score_grad(shape, q, k, v_ref[...], _rows(*ec), _rows(*eq), mask_ref[...] != 0, key_tile,
                            do_ref[...], lse_ref[...], delta_ref[...])
        grads = []
        if shape.c2p:
            grads.append(_dot(_unskew(ds, shape.tile).T, q.astype(jnp.float32)))
        if shape.p2c:
            grads.append(_dot(_unskew(ds.T, shape.tile).T, k.astype(jnp.float32)))
        for acc, grad in zip(scratch, grads):
            acc[...] += grad

    @pl.when(step == pl.num_programs(3) - 1)
    def _():
        for out, acc in zip(outs, scratch):
            out[...] = acc[...]


# ------------------------------------------------------------------------------------------------ plumbing
def _table_specs(shape: _Shape, tiles):
    """BlockSpecs of the two `[T, d]` row blocks of each expanded table a tile reads; `tiles(*grid)` gives the
    (query tile, key tile) of a grid point. Reversed layout (c2p) starts at block `n - 1 - (i - j)`, forward (p2c)
    at `n - 1 + (i - j)`."""
    n, t = shape.num_tiles, shape.tile
    specs = []
    for on, sign in ((shape.c2p, -1), (shape.p2c, 1)):
        if on:
            for half in (0, 1):
                def index(b, h, x, y, sign=sign, half=half):
                    i, j = tiles(x, y)[:2]
                    return h, n - 1 + sign * (i - j) + half, 0
                specs.append((index, (None, t, None)))
    return specs


# Matrix-unit work per tile pair beyond recomputing the scores, in units of a `[T, T] x [T, d]` product: the
# forward's p @ v; dq's dp, ds @ k and c2p's `[T, 2T] x [2T, d]`; dk/dv's dp, ds^T @ q, p^T @ do and p2c's; the
# table kernel's dp and one `[2T, T] x [T, d]` per table.
_EXTRA_PRODUCTS = {"_forward_kernel": lambda s: 1, "_dq_kernel": lambda s: 2 + 2 * s.c2p,
                   "_dkv_kernel": lambda s: 3 + 2 * s.p2c, "_dtable_kernel": lambda s: 1 + 2 * (s.c2p + s.p2c)}


def _cost(kernel, shape: _Shape, operands, out_shapes) -> pl.CostEstimate:
    """What one call costs, for XLA's cost analysis of a compiled program (a custom call is opaque to it): the
    products of every tile pair (scores: q.k plus `[T, d] x [d, 2T]` per position term), one exp per score, and
    the bytes of every block the grid streams (each key-side block once per query tile and the reverse)."""
    b, h, _, d = operands[0].shape
    pairs = b * h * shape.num_tiles ** 2
    unit = 2 * shape.tile ** 2 * d
    products = 1 + 2 * (shape.c2p + shape.p2c) + _EXTRA_PRODUCTS[kernel.__name__](shape)
    streamed = sum(x.size * x.dtype.itemsize for x in operands) * shape.num_tiles
    written = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(out_shapes))
    return pl.CostEstimate(flops=pairs * unit * products, transcendentals=pairs * shape.tile ** 2,
                           bytes_accessed=streamed + written)


def _call(kernel, shape: _Shape, grid, tiles, inputs, tables, out_shapes, out_specs, scratch, semantics):
    """One pallas_call over `grid`: per-token inputs follow `tiles` (query tile for q-side, key tile for k-side)."""
    t = shape.tile

    def spec(x, block, side):
        def index(b, h, i, j):
            tile = tiles(i, j)[0 if side == "q" else 1]
            return (b, h, tile, 0) if block == "token" else (b, 0, tile)
        return pl.BlockSpec((None, None, t, x.shape[-1]) if block == "token" else (None, 1, t), index)

    in_specs = [spec(x, block, side) for x, (block, side) in zip(*inputs)]
    d = inputs[0][0].shape[-1]
    for index, block in _table_specs(shape, tiles):
        in_specs.append(pl.BlockSpec((block[0], block[1], d), index))
    operands = list(inputs[0]) + [x for x in tables for _ in (0, 1)]
    body = functools.partial(kernel, shape=shape)

    def run(interpret, *args):
        return pl.pallas_call(
            body, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shapes,
            scratch_shapes=scratch, interpret=interpret, cost_estimate=_cost(kernel, shape, operands, out_shapes),
            compiler_params=pltpu.CompilerParams(dimension_semantics=semantics),
            name=kernel.__name__.strip("_"))(*args)

    # Mosaic when the program is lowered for a TPU (also from another machine), Pallas' interpreter elsewhere.
    return jax.lax.platform_dependent(*operands, tpu=functools.partial(run, False),
                                      default=functools.partial(run, True))


_TOKEN_Q, _TOKEN_K, _MASK = ("token", "q"), ("token", "k"), ("mask", "k")
_PARALLEL, _ARBITRARY = pltpu.GridDimensionSemantics.PARALLEL, pltpu.GridDimensionSemantics.ARBITRARY


def _tables(shape: _Shape, ec, eq):
    return [x for x, on in ((ec, shape.c2p), (eq, shape.p2c)) if on]


def _forward(shape: _Shape, q, k, v, mask, ec, eq):
    b, h, n_pad, d = q.shape
    t, n = shape.tile, shape.num_tiles
    token = lambda: pl.BlockSpec((None, None, t, d), lambda b_, h_, i, j: (b_, h_, i, 0))  # noqa: E731
    out, lse = _call(
        _forward_kernel, shape, (b, h, n, n), lambda i, j: (i, j),
        ((q, k, v, mask), (_TOKEN_Q, _TOKEN_K, _TOKEN_K, _MASK)), _tables(shape, ec, eq),
        [jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((b, h, n_pad, 1), jnp.float32)],
        [token(), pl.BlockSpec((None, None, t, 1), lambda b_, h_, i, j: (b_, h_, i, 0))],
        [pltpu.VMEM((t, 1), jnp.float32), pltpu.VMEM((t, 1), jnp.float32), pltpu.VMEM((t, d), jnp.float32)],
        (_PARALLEL, _PARALLEL, _PARALLEL, _ARBITRARY))
    return out, lse


def _overlap_add(parts, reverse: bool):
    """Per-diagonal `[H, 2n - 1, 2T, d]` table gradients -> `[H, 2nT, d]`: diagonal `g` wrote the rows starting at
    block `g` (forward layout) or `2n - 2 - g` (reversed), so its two halves land on neighbouring blocks."""
    h, g, two_t, d = parts.shape
    parts = parts[:, ::-1] if reverse else parts
    lo, hi = parts[:, :, : two_t // 2], parts[:, :, two_t // 2:]
    blocks = jnp.pad(lo, [(0, 0), (0, 1), (0, 0), (0, 0)]) + jnp.pad(hi, [(0, 0), (1, 0), (0, 0), (0, 0)])
    return blocks.reshape(h, (g + 1) * two_t // 2, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(shape: _Shape, q, k, v, mask, ec, eq):
    return _forward(shape, q, k, v, mask, ec, eq)[0]


def _attention_fwd(shape, q, k, v, mask, ec, eq):
    out, lse = _forward(shape, q, k, v, mask, ec, eq)
    return out, (q, k, v, mask, ec, eq, out, lse)


def _attention_bwd(shape: _Shape, residuals, d_out):
    q, k, v, mask, ec, eq, out, lse = residuals
    b, h, n_pad, d = q.shape
    t, n = shape.tile, shape.num_tiles
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    inputs = (q, k, v, mask, d_out, lse, delta)
    sides = (_TOKEN_Q, _TOKEN_K, _TOKEN_K, _MASK, _TOKEN_Q, _TOKEN_Q, _TOKEN_Q)
    tables = _tables(shape, ec, eq)
    token = lambda: pl.BlockSpec((None, None, t, d), lambda b_, h_, x, y: (b_, h_, x, 0))  # noqa: E731
    semantics = (_PARALLEL, _PARALLEL, _PARALLEL, _ARBITRARY)
    dq = _call(_dq_kernel, shape, (b, h, n, n), lambda i, j: (i, j), (inputs, sides), tables,
               jax.ShapeDtypeStruct(q.shape, q.dtype), token(), [pltpu.VMEM((t, d), jnp.float32)], semantics)
    dk, dv = _call(_dkv_kernel, shape, (b, h, n, n), lambda j, i: (i, j), (inputs, sides), tables,
                   [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
                   [token(), token()], [pltpu.VMEM((t, d), jnp.float32)] * 2, semantics)
    grads = {"ec": None, "eq": None}
    if tables:
        per_diagonal = pl.BlockSpec((None, None, None, 2 * t, d), lambda b_, h_, g, s: (b_, h_, g, 0, 0))
        parts = _call(_dtable_kernel, shape, (b, h, 2 * n - 1, n),
                      lambda g, s: _diagonal(shape, g, s)[:2], (inputs, sides), tables,
                      [jax.ShapeDtypeStruct((b, h, 2 * n - 1, 2 * t, d), jnp.float32)] * len(tables),
                      [per_diagonal] * len(tables), [pltpu.VMEM((2 * t, d), jnp.float32)] * len(tables),
                      (_PARALLEL, _PARALLEL, _PARALLEL, _ARBITRARY))
        names = [name for name, on in (("ec", shape.c2p), ("eq", shape.p2c)) if on]
        for name, part in zip(names, parts):
            table = ec if name == "ec" else eq
            grads[name] = _overlap_add(part.sum(axis=0), reverse=name == "ec").astype(table.dtype)
    return dq, dk, dv, None, grads["ec"], grads["eq"]


_attention.defvjp(_attention_fwd, _attention_bwd)


def pallas_tpu_attention(terms: ScoreTerms, v: jax.Array, key_mask: jax.Array, *, dropout_rate: float = 0.0,
                         dropout_key: jax.Array | None = None, tile: int = TILE) -> jax.Array:
    """Self-attention of any variant without per-distance bias, DeBERTa's included, fused for TPUs.

    `terms` carries DeBERTa's projected tables (`pos_key` / `pos_query`, `[H, R, d]`) and the row per distance
    (`relative`), as the dense kernel's shift formulation takes them. `tile` is for tests (interpret mode runs
    any size; Mosaic needs a multiple of 128).
    """
    if dropout_key is not None and dropout_rate > 0:
        raise ValueError(
            f"attention_kernel='pallas_tpu' has no attention dropout, but attention_dropout={dropout_rate} in "
            "training; set model.attention_dropout=0 or train with attention_kernel='dense' or 'blockwise'")
    unsupported = [name for name, value in (("per-distance bias (ALiBi, T5)", terms.bias),
                                            ("attention_temperature", terms.temperature),
                                            ("c2p/p2c products", terms.c2p if terms.c2p is not None else terms.p2c))
                   if value is not None] + (["attention_window"] if terms.window else [])
    if unsupported:
        raise ValueError(f"attention_kernel='pallas_tpu' does not implement {', '.join(unsupported)}; "
                         "use attention_kernel='dense' or 'blockwise'")
    q, k = terms.q, terms.k
    length = q.shape[-2]
    if k.shape[-2] != length:
        raise ValueError(f"attention_kernel='pallas_tpu' is self-attention: {length} queries but {k.shape[-2]} keys")
    relative = terms.relative is not None
    shape = _Shape(length, tile, terms.divisor, relative and terms.pos_key is not None,
                   relative and terms.pos_query is not None)
    pad = shape.padded - length

    def padded(x):
        return jnp.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)])

    ec = eq = None
    if shape.c2p or shape.p2c:
        forward, reverse = expand_tables(terms.relative.by_distance, length, tile)
        ec = terms.pos_key[:, reverse] if shape.c2p else None
        eq = terms.pos_query[:, forward] if shape.p2c else None
    mask = jnp.pad(key_mask.astype(jnp.int32), [(0, 0), (0, pad)])[:, None, :]
    attend = functools.partial(_attention, shape)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        # XLA cannot partition a Mosaic call: each device runs it on its rows of the batch, which a run's mesh
        # splits over all of its axes (`train.sharding.batch_sharding`); the tables are replicated.
        rows, whole = PartitionSpec(mesh.axis_names), PartitionSpec()
        attend = jax.shard_map(attend, mesh=mesh, in_specs=(rows, rows, rows, rows, whole, whole), out_specs=rows,
                               check_vma=False)
    out = attend(padded(q), padded(k), padded(v), mask, ec, eq)
    return out[:, :, :length]
