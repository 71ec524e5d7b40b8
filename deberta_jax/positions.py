"""Position functions: relative distances, DeBERTa's log-bucketing, the relative-table index, and the
policies for absolute positions past the training length.

Everything here depends only on static sizes, so it is computed with numpy while a function is traced
and enters the XLA program as a constant: no per-step cost, and the result is bit-identical on every
backend. The float32 arithmetic of the bucketing deliberately mirrors transformers' torch code so that
checkpoints trained there land in exactly the same buckets here (tested against it).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np


def relative_positions(query_len: int, key_len: int) -> np.ndarray:
    """`rel[i, j] = i - j` (int32, shape [query_len, key_len]); positive when the key is to the left."""
    return np.arange(query_len, dtype=np.int32)[:, None] - np.arange(key_len, dtype=np.int32)[None, :]


def log_bucket_position(rel: np.ndarray, position_buckets: int, max_position: int) -> np.ndarray:
    """DeBERTa's log-bucketing of relative distances.

    Distances with `|rel| <= mid` (`mid = position_buckets // 2`) keep their exact value; longer ones
    are mapped log-uniformly so that `|rel| = max_position - 1` lands on bucket `2 * mid - 1`. Past
    that the formula keeps growing (bucket >= 2 * mid), which is why callers clamp (see
    `relative_index`). The output is odd-symmetric: `bucket(-r) == -bucket(r)`.
    """
    rel = np.asarray(rel, dtype=np.int64)
    mid = position_buckets // 2
    sign = np.sign(rel)
    # Inside the exact window the log would be of 0; substitute a harmless value, it is not selected.
    abs_pos = np.where((rel < mid) & (rel > -mid), mid - 1, np.abs(rel)).astype(np.float32)
    denom = np.log(np.float32((max_position - 1) / mid))
    log_pos = np.ceil(np.log(abs_pos / np.float32(mid)) / denom * np.float32(mid - 1)) + np.float32(mid)
    bucket = np.where(abs_pos <= mid, rel.astype(np.float32), log_pos * sign.astype(np.float32))
    return bucket.astype(np.int32)


@functools.lru_cache(maxsize=64)
def relative_index(
    query_len: int,
    key_len: int,
    *,
    position_buckets: int,
    max_relative_positions: int,
    clamp: bool = True,
) -> np.ndarray:
    """Row of the `2k`-row relative table used for each (query i, key j): `bucket(i - j) + k`.

    The same index serves content-to-position and position-to-content (the reference code's p2c index
    `-bucket(j - i)` equals `bucket(i - j)` because the bucketing is odd-symmetric).

    With `clamp=True` (our default, as in the official microsoft/DeBERTa code) distances are first
    clamped to `+-(max_relative_positions - 1)`: a sequence longer than anything seen in training
    reuses the outermost trained bucket. With `clamp=False` (transformers) they are not, and the final
    clip to `[0, 2k - 1]` sends `j - i >= max_relative_positions` to row 0, which no in-range distance
    ever uses and so was never trained. Either way the index is always valid: never NaN rows.
    """
    rel = relative_positions(query_len, key_len)
    if clamp:
        rel = np.clip(rel, -(max_relative_positions - 1), max_relative_positions - 1)
    if position_buckets > 0:
        rel = log_bucket_position(rel, position_buckets, max_relative_positions)
    span = position_buckets if position_buckets > 0 else max_relative_positions
    index = np.clip(rel + span, 0, 2 * span - 1).astype(np.int32)
    index.setflags(write=False)  # cached: callers must not mutate it
    return index


def relative_rows_used(query_len: int, key_len: int, **kw) -> tuple[int, int]:
    """[lo, hi) range of relative-table rows a length can touch; lets attention slice the table."""
    index = relative_index(query_len, key_len, **kw)
    return int(index.min()), int(index.max()) + 1


class PositionRangeError(ValueError):
    """A sequence needs absolute positions the model has no (trained) rows for."""


def absolute_position_embeddings(
    table: jnp.ndarray, seq_len: int, trained_length: int, policy: str
) -> jnp.ndarray:
    """Rows `[seq_len, d]` of a learned absolute table for positions `0..seq_len-1`.

    Up to `trained_length` every policy returns the trained rows unchanged. Beyond it:
      - "strict": raise `PositionRangeError` (positions never seen in training);
      - "untrained": use the table's rows as allocated (they exist when the table is longer than the
        training length, but never received gradient); error past the end of the table;
      - "clip": repeat the row of position `trained_length - 1`;
      - "interpolate": resample the trained rows linearly over `seq_len` positions (position `p` reads
        fractional row `p * (trained_length - 1) / (seq_len - 1)`), the "position interpolation" trick.
    Indexing is explicit and in range, so out-of-range reads can never silently produce NaN rows.
    """
    table_size = table.shape[0]
    if seq_len <= trained_length:
        if seq_len > table_size:
            raise PositionRangeError(f"sequence length {seq_len} exceeds the absolute table ({table_size} rows)")
        return table[:seq_len]
    if policy == "strict":
        raise PositionRangeError(
            f"sequence length {seq_len} exceeds the training length {trained_length} of the absolute "
            "position table; pick an explicit policy for unseen positions "
            "(absolute_position_policy='untrained' | 'clip' | 'interpolate')")
    if policy == "untrained":
        if seq_len > table_size:
            raise PositionRangeError(
                f"policy 'untrained' needs {seq_len} rows but the table has {table_size} "
                "(max_position_embeddings); use 'clip' or 'interpolate', or allocate a longer table")
        return table[:seq_len]
    if policy == "clip":
        ids = np.minimum(np.arange(seq_len), trained_length - 1)
        return jnp.take(table, ids, axis=0, mode="clip")
    if policy == "interpolate":
        pos = np.arange(seq_len, dtype=np.float64) * (trained_length - 1) / max(seq_len - 1, 1)
        lo = np.floor(pos).astype(np.int32)
        hi = np.minimum(lo + 1, trained_length - 1)
        frac = jnp.asarray((pos - lo)[:, None], dtype=table.dtype)
        return (1 - frac) * jnp.take(table, lo, axis=0) + frac * jnp.take(table, hi, axis=0)
    raise ValueError(f"unknown absolute_position_policy {policy!r}; use strict, untrained, clip or interpolate")
