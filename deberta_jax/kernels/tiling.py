"""What the fused kernels share: the tiling plan of one call (`KernelShape`) and the global keys merged outside
them (`merge_global_keys`).

A fused kernel scores a `T x T` tile of queries and keys at a time. Which tile pairs a call visits is the same
question on every accelerator: all of them, or with a window the band of key tiles each query tile's windows reach
(`key_band`) and the band of query tiles whose windows reach each key tile (`query_band`), with the tile of each
visit computed from the other side's (`key_tile`, `query_tile`); and which pairs are far, every distance `i - j`
beyond the reach of the relative index (`scores.saturation`), so that their position terms are one table row's.
The TPU kernel (`kernels.pallas_tpu`) walks that plan as a grid, the GPU kernel (`kernels.pallas`) as loops inside
one program per tile; both read it from here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from deberta_jax.kernels import dropout_masks
from deberta_jax.kernels.scores import ScoreTerms, combine_scores, row_ends, saturation, window_starts


@dataclasses.dataclass(frozen=True)
class KernelShape:
    """What every kernel of one call shares (static)."""

    length: int  # real queries = keys
    tile: int
    divisor: float
    c2p: bool
    p2c: bool
    bias: bool = False  # a per-distance bias
    dropout_rate: float = 0.0  # attention dropout; 0 in evaluation
    temperature: bool = False  # a factor per query on its scores
    window: int = 0  # positions each query sees (`scores.window_starts`), fewer than `length`; 0: every key
    # (d_hi, d_lo): the relative index is its last row at distances >= d_hi and its first at <= d_lo
    # (`scores.saturation`); None without position terms or when no distance is that far.
    ends: tuple[int, int] | None = None
    # The inputs are padded to a multiple of this (a multiple of `tile`; 0: `tile`): the kernels of one call may
    # walk the same padded arrays in different tiles (the GPU kernel's backward passes in smaller ones).
    pad_unit: int = 0

    @property
    def dropout(self) -> bool:
        return self.dropout_rate > 0

    @property
    def far_c2p(self) -> bool:
        """Whether far pairs read c2p's end terms (a column per query) instead of its products."""
        return self.c2p and self.ends is not None

    @property
    def far_p2c(self) -> bool:
        return self.p2c and self.ends is not None

    def far(self, query_tile, key_tile):
        """(hi, lo): whether every distance `i - j` of the tile pair is `>= d_hi` (last row), or `<= d_lo`
        (first row). Python False without end terms; traced or numpy tiles otherwise."""
        if self.ends is None:
            return False, False
        d_hi, d_lo = self.ends
        gap = (query_tile - key_tile) * self.tile
        return gap - (self.tile - 1) >= d_hi, gap + (self.tile - 1) <= d_lo

    def near(self, query_tile, key_tile):
        """Whether the tile pair reads rows of its own (products with the expanded tables); True without end terms."""
        hi, lo = self.far(query_tile, key_tile)
        return True if self.ends is None else ~(hi | lo)

    def visited(self, query_tile, key_tile, backward: bool):
        """Whether the forward grid (each query tile's band of key tiles) or the backward one (each key tile's band
        of query tiles) visits the tile pair; False for tiles outside the sequence."""
        n = self.num_tiles
        inside = (query_tile >= 0) & (query_tile < n) & (key_tile >= 0) & (key_tile < n)
        if backward:
            first = self.query_tile(key_tile, 0)
            return inside & (query_tile >= first) & (query_tile < first + self.query_band)
        first = self.key_tile(query_tile, 0)
        return inside & (key_tile >= first) & (key_tile < first + self.key_band)

    def near_pairs(self, backward: bool) -> np.ndarray:
        """`[query tiles, key tiles]`: whether a grid visits the pair and it is near, which the cost estimate counts.
        Along a grid row, and along a column (one tile of the side that moves, over the rows), the pairs'
        distances move monotonically, so the near pairs of each are one run of consecutive tiles (a band) that
        holds its diagonal pair."""
        query, key = np.arange(self.num_tiles)[:, None], np.arange(self.num_tiles)[None, :]
        with jax.ensure_compile_time_eval():  # the index maps' jnp arithmetic on constants, also inside a trace
            return np.asarray(self.visited(query, key, backward) & self.near(query, key))

    @property
    def num_tiles(self) -> int:
        return self.padded // self.tile

    @property
    def padded(self) -> int:
        unit = self.pad_unit or self.tile
        return -(-self.length // unit) * unit

    def _reach(self) -> tuple[np.ndarray, np.ndarray]:
        """Per tile, how many key tiles its queries' windows reach and how many query tiles reach its keys."""
        t = self.tile
        starts = window_starts(self.length, self.length, self.window)
        ends = starts + self.window - 1  # both nondecreasing in the query
        # A tile of padding only (a backward tile past the last real one) reaches what the last real position does.
        first = np.minimum(np.arange(self.num_tiles) * t, self.length - 1)
        last = np.minimum(first + t, self.length) - 1
        keys = ends[last] // t - starts[first] // t + 1
        queries = (np.searchsorted(starts, last, side="right") - 1) // t - np.searchsorted(ends, first) // t + 1
        return keys, queries

    @property
    def key_band(self) -> int:
        """Key tiles each query tile visits: all of them, or with a window the most any query tile's reach."""
        return int(self._reach()[0].max()) if self.window else self.num_tiles

    @property
    def query_band(self) -> int:
        """Query tiles each key tile visits: all of them, or with a window the most whose windows reach one."""
        return int(self._reach()[1].max()) if self.window else self.num_tiles

    def window_start(self, query):
        """`scores.window_starts` of traced query positions (an index map's scalar, a tile's iota)."""
        return jnp.clip(query - self.window // 2, 0, self.length - self.window)

    def key_tile(self, query_tile, step):
        """The key tile of a query tile's `step`-th visit: the band starts at the tile of its first query's window
        start, moved left where it would run past the last tile (its extra tiles fall outside every window)."""
        if not self.window:
            return step
        first = jax.lax.div(self.window_start(query_tile * self.tile), self.tile)
        return jnp.minimum(first, self.num_tiles - self.key_band) + step

    def query_tile(self, key_tile, step):
        """The query tile of a key tile's `step`-th visit: the band starts at the tile of the first query whose
        window reaches its first key (windows are `W // 2` before the query, shifted right at the row's start)."""
        if not self.window:
            return step
        key = key_tile * self.tile
        first = jnp.where(key > self.window - 1, key - (self.window - 1) + self.window // 2, 0)
        return jnp.minimum(jax.lax.div(first, self.tile), self.num_tiles - self.query_band) + step


def kernel_shape(terms: ScoreTerms, kernel: str, tile: int, dropout_rate: float, dropout_key) -> KernelShape:
    """The plan of one fused call of `kernel` ("pallas", "pallas_tpu") on `terms`, without end terms (each kernel
    decides which index it saturates on); refuses what neither fused kernel takes: DeBERTa's products instead of its
    tables, more keys than queries, a bias with a row axis."""
    if terms.c2p is not None or terms.p2c is not None:
        raise ValueError(f"attention_kernel={kernel!r} takes DeBERTa's projected tables (ScoreTerms.pos_key / "
                         "pos_query), not the c2p/p2c products; use attention_kernel='dense' or 'blockwise' with them")
    length = terms.q.shape[-2]
    if terms.k.shape[-2] != length:
        raise ValueError(f"attention_kernel={kernel!r} is self-attention: {length} queries but {terms.k.shape[-2]} "
                         "keys")
    if terms.bias is not None and terms.bias.ndim != 2:
        raise ValueError(f"attention_kernel={kernel!r} takes one bias per head and distance ([H, 2N - 1]), not one "
                         f"per row (shape {terms.bias.shape}); use attention_kernel='dense' or 'blockwise'")
    relative = terms.relative is not None
    dropout = dropout_key is not None and dropout_rate > 0
    return KernelShape(length, tile, terms.divisor, relative and terms.pos_key is not None,
                       relative and terms.pos_query is not None, terms.bias is not None,
                       float(dropout_rate) if dropout else 0.0, temperature=terms.temperature is not None,
                       window=terms.window if terms.window < length else 0)


def take(items: list, *on) -> list:
    """The next items of `items` (consumed), one for each flag that is on, None for each that is off: a kernel's
    refs and outputs, whose optional ones exist only when their option is on."""
    return [items.pop(0) if flag else None for flag in on]


def batch_shards(attend, specs):
    """`attend` run by each device on its rows of the batch when the surrounding mesh has more than one device:
    XLA cannot partition a Pallas call, and a run's mesh splits the batch over all of its axes
    (`train.sharding.batch_sharding`). `specs` mirrors `attend`'s arguments: "rows" for per-sequence inputs,
    "whole" for replicated ones (tables, a bias); its two outputs are per sequence."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return attend
    rows, whole = PartitionSpec(mesh.axis_names), PartitionSpec()
    in_specs = jax.tree.map(lambda spec: rows if spec == "rows" else whole, specs)
    return jax.shard_map(attend, mesh=mesh, in_specs=in_specs, out_specs=(rows, rows), check_vma=False)


def merge_global_keys(terms: ScoreTerms, v, out, lse, shape: KernelShape, hashes):
    """The output with each row's global keys outside a query's window added to its softmax (a window's global
    keys, seen by every query, sit in tiles the kernel's band skips: its first and last marked keys, which is
    what `positions.global_keys` marks).

    Two keys per row are `O(N)` work in plain JAX: their scores by the score formula (`combine_scores`; the
    position terms from the table rows of each query's distance to them, `global_position_terms`), dropout from
    the same hashes, and one more softmax block merged into the kernel's by log-sum-exp, as split-key attention
    merges blocks. Their gradients come from autodiff, the kernel's through its log-sum-exp."""
    marked = terms.global_keys[:, 0]
    n = marked.shape[-1]
    keys = jnp.stack(row_ends(marked), axis=-1)  # [B, 2]
    real = jnp.take_along_axis(marked, keys, axis=-1) & jnp.concatenate(
        [jnp.ones_like(keys[:, :1], bool), keys[:, :1] != keys[:, 1:]], axis=-1)  # a row's one marked key once
    start = jnp.asarray(window_starts(n, n, shape.window))[None, :, None]
    outside = (keys[:, None, :] < start) | (keys[:, None, :] >= start + shape.window)  # [B, N, 2]
    visible = (real[:, None, :] & outside)[:, None]  # [B, 1, N, 2]

    k, values = (jnp.take_along_axis(x, keys[:, None, :, None], axis=2) for x in (terms.k, v))  # [B, H, 2, d]
    distance = jnp.arange(n)[None, :, None] - keys[:, None, :] + n - 1  # [B, N, 2], `scores.distances` order
    relative = 0.0
    if shape.c2p or shape.p2c:
        relative = jnp.stack([global_position_terms(terms, shape, k[:, :, g], keys[:, g]) for g in range(2)], -1)
    bias = jnp.moveaxis(terms.bias[:, distance], 0, 1) if shape.bias else None
    scores = combine_scores(jnp.einsum("bhid,bhgd->bhig", terms.q, k), relative, bias, shape.divisor,
                            terms.temperature).astype(jnp.float32)
    scores = jnp.where(visible, scores, -jnp.inf)
    window_lse = lse[..., None]
    top = jax.lax.stop_gradient(jnp.maximum(window_lse, scores.max(axis=-1, keepdims=True)))
    total = top + jnp.log(jnp.exp(window_lse - top) + jnp.exp(scores - top).sum(axis=-1, keepdims=True))
    p = jnp.exp(scores - total)
    if shape.dropout:
        query_hash, key_hash = hashes
        keep = dropout_masks.attention_keep(query_hash[:, :, :n], jnp.take_along_axis(
            key_hash, keys[:, None, None, :], axis=-1), shape.dropout_rate)
        p = dropout_masks.apply(p, keep, shape.dropout_rate)
    merged = jnp.exp(window_lse - total) * out.astype(jnp.float32) + jnp.einsum(
        "bhig,bhgd->bhid", p, values.astype(jnp.float32))
    return merged.astype(out.dtype)


def global_position_terms(terms: ScoreTerms, shape: KernelShape, k, key):
    """c2p + p2c `[B, H, N]` of every query with one global key per row (`k` `[B, H, d]` at positions `key` `[B]`).

    Past some distance each way the relative index is constant (the outermost bucket, or the clipped row), so the
    terms of the queries that far from the key are one product with that row; only the band of queries nearer
    than that reads a row per query (a slice of the queries and a gather of the table rows, `[H, B, band, d]`), as
    `scores.banded_relative_terms` does for blocks of keys. Without such distances the band is every query."""
    rel = terms.relative.by_distance
    n = terms.q.shape[-2]
    d_hi, d_lo = saturation(rel, n, n) or (n, -n)
    width = min(n, d_hi - d_lo - 1)
    start = jnp.clip(key + d_lo + 1, 0, n - width)  # the band: queries i with d_lo < i - key < d_hi

    def cut(x):  # [B, H, N, ...] -> the band's [B, H, width, ...], per row
        return jax.vmap(lambda x, s: jax.lax.dynamic_slice_in_dim(x, s, width, axis=1))(x, start)
    rows = jnp.asarray(rel)[start[:, None] + jnp.arange(width) - key[:, None] + n - 1]  # [B, width]
    far = jnp.arange(n)[None, None, :] - key[:, None, None] >= d_hi  # [B, 1, N]: past the band's high end
    terms_far, terms_band = 0.0, 0.0
    if shape.c2p:
        ends = end_terms(terms.q, terms.pos_key, rel)
        terms_far = terms_far + jnp.where(far, ends[:, :, 1], ends[:, :, 0])
        terms_band = terms_band + jnp.einsum("bhwd,hbwd->bhw", cut(terms.q), terms.pos_key[:, rows])
    if shape.p2c:
        ends = end_terms(k[:, :, None], terms.pos_query, rel)
        terms_far = terms_far + jnp.where(far, ends[:, :, 1], ends[:, :, 0])
        terms_band = terms_band + jnp.einsum("bhd,hbwd->bhw", k, terms.pos_query[:, rows])
    terms_far = jnp.broadcast_to(terms_far, terms.q.shape[:3]).astype(jnp.result_type(terms_band))
    return jax.vmap(lambda f, b, s: jax.lax.dynamic_update_slice_in_dim(f, b, s, axis=1))(terms_far, terms_band, start)


def end_terms(x, table, rel: np.ndarray):
    """`x` `[B, H, N, d]` against a projected table's rows at the outermost distances: `[B, H, 2, N]` float32, row
    0 the index's first row (distances `<= d_lo`), row 1 its last (`>= d_hi`)."""
    return jnp.einsum("bhnd,hed->bhen", x, table[:, np.asarray([rel[0], rel[-1]])],
                      preferred_element_type=jnp.float32)
