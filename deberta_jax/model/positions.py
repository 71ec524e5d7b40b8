"""Position functions: relative distances, DeBERTa's log-bucketing, the relative-table index, the
policies for absolute positions past the training length, and the baselines from the
length-generalization literature (sinusoidal, RoPE, ALiBi, T5 buckets, randomized positions).

Whatever depends only on static sizes (relative indices, buckets, ALiBi distances) is computed with
numpy while a function is traced and enters the XLA program as a constant: no per-step cost, and the
result is bit-identical on every backend. Functions of token positions (sinusoidal, RoPE) use jnp,
because randomized training samples those positions inside the step. The float32 arithmetic of the
bucketings deliberately mirrors the torch code of transformers (DeBERTa) and T5, so that checkpoints
trained there land in exactly the same buckets here (both tested against transformers).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from deberta_jax.kernels.scores import distances, row_ends, toeplitz, window_starts


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
def relative_index_by_distance(
    query_len: int,
    key_len: int,
    *,
    position_buckets: int,
    max_relative_positions: int,
    clamp: bool = True,
    scale: float = 1.0,
) -> np.ndarray:
    """Row of the `2k`-row relative table used at each distance `i - j` (see `distances`): `bucket(i - j) + k`.

    The same index serves content-to-position and position-to-content (the reference code's p2c index
    `-bucket(j - i)` equals `bucket(i - j)` because the bucketing is odd-symmetric).

    With `clamp=True` (our default) distances are first clamped to `+-(max_relative_positions - 1)`:
    a sequence longer than anything seen in training reuses the outermost trained bucket. The official
    microsoft/DeBERTa code clamps the same way with log buckets (inside `make_log_bucket_position`) but
    not without them (`position_buckets=0`), where the clamp is this project's own option. With
    `clamp=False` (transformers) distances are not clamped, and the final clip to `[0, 2k - 1]` sends
    `j - i >= max_relative_positions` to row 0, which no in-range distance ever uses and so was never
    trained. Either way the index is always valid: never NaN rows.

    `scale` (`ModelConfig.distance_scale`) multiplies every distance first, rounded to the nearest integer.
    """
    rel = scaled_distances(query_len, key_len, scale)
    if clamp:
        rel = np.clip(rel, -(max_relative_positions - 1), max_relative_positions - 1)
    if position_buckets > 0:
        rel = log_bucket_position(rel, position_buckets, max_relative_positions)
    span = position_buckets if position_buckets > 0 else max_relative_positions
    index = np.clip(rel + span, 0, 2 * span - 1).astype(np.int32)
    index.setflags(write=False)  # cached: callers must not mutate it
    return index


def scaled_distances(query_len: int, key_len: int, scale: float) -> np.ndarray:
    """`distances` times `scale`, rounded to the nearest integer (the distances themselves at scale 1)."""
    rel = distances(query_len, key_len)
    return rel if scale == 1.0 else np.rint(rel * scale).astype(np.int32)


def global_keys(key_mask) -> jax.Array:
    """`[B, 1, N]` bool, the keys `ModelConfig.window_global_tokens` keeps visible to every query of a window: each
    row's first and last real positions (`row_ends`). Laid out like a key-side score term (`ScoreTerms`)."""
    first, last = row_ends(key_mask)
    position = jnp.arange(jnp.shape(key_mask)[-1])[None]
    ends = (position == first[:, None]) | (position == last[:, None])
    return (ends & jnp.asarray(key_mask).astype(bool))[:, None, :]


def visible_keys(key_mask, window: int, with_ends: bool = False) -> jax.Array:
    """`[B, N]` float32: how many real keys (`key_mask` `[B, N]`, 1 = real) each query may attend to: every real
    key of its row, or those inside its window of `window` positions (`scores.window_starts`) when `window` is
    set, plus, `with_ends`, the row's first and last real positions where they lie outside that window."""
    mask = jnp.asarray(key_mask, jnp.float32)
    n = mask.shape[-1]
    if not window or window >= n:
        return jnp.broadcast_to(mask.sum(-1, keepdims=True), mask.shape)
    counts = jnp.cumsum(jnp.pad(mask, [(0, 0), (1, 0)]), axis=-1)  # counts[:, p]: real keys before position p
    starts = window_starts(n, n, window)
    visible = counts[:, starts + window] - counts[:, starts]
    if with_ends:
        first, last = row_ends(key_mask)

        def outside(p):  # [B, N]: position p of each row lies outside each query's window
            return ((p[:, None] < starts) | (p[:, None] >= starts + window)).astype(jnp.float32)
        real = mask.sum(-1, keepdims=True) > 0
        visible = visible + real * (outside(first) + jnp.where((last != first)[:, None], outside(last), 0.0))
    return visible


def log_keys(visible: jax.Array) -> jax.Array:
    """`log(n_i)` per query as `[B, 1, N, 1]` (a query with no real key counts one): what every temperature scales,
    by `1 / log(L)` (fixed) or by a learned parameter per head (`learned_temperature`)."""
    return jnp.log(jnp.maximum(visible, 1.0))[:, None, :, None]


def learned_temperature(kind: str, parameter, log_keys, trained_length: int):
    """The factor on the scores of a query that sees `exp(log_keys)` keys, from a head's learned `parameter`
    (`ModelConfig.attention_temperature`): Scalable-Softmax's `s_h * log(n)` ("learned"), or `1 + r_h * log(n / L)`
    ("learned_rate"). Broadcasts: `parameter` shaped to meet `log_keys` (numpy or jax)."""
    if kind == "learned":
        return parameter * log_keys
    return 1 + parameter * (log_keys - np.float32(np.log(trained_length)))


def relative_index(query_len: int, key_len: int, **kw) -> np.ndarray:
    """`relative_index_by_distance` expanded to `[query_len, key_len]`: the table row for each (i, j)."""
    return toeplitz(relative_index_by_distance(query_len, key_len, **kw),
                    np.arange(query_len), np.arange(key_len), key_len)


def relative_rows_used(query_len: int, key_len: int, **kw) -> tuple[int, int]:
    """[lo, hi) range of relative-table rows a length can touch; lets attention slice the table."""
    index = relative_index_by_distance(query_len, key_len, **kw)
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


# --------------------------------------------------------------------------- length-generalization baselines
def sinusoidal_embeddings(positions, dim: int) -> jax.Array:
    """Vaswani et al.'s fixed encoding `[..., dim]` for integer `positions` `[...]` (float32).

    `PE[p, 2i] = sin(p / 10000^(2i/dim))`, `PE[p, 2i+1] = cos(p / 10000^(2i/dim))`. A function rather
    than a table, so every position has a value and no out-of-range policy applies. `dim` must be even.
    """
    inv_freq = np.power(10000.0, -np.arange(0, dim, 2) / dim).astype(np.float32)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq
    return jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1).reshape(*angles.shape[:-1], dim)


def apply_rope(x: jax.Array, positions, theta: float) -> jax.Array:
    """Rotary position embedding (Su et al.): rotate feature pairs of `x` `[..., N, d]` by `p * theta^(-2i/d)`.

    `positions` (broadcastable to `x.shape[:-1]`) are the token positions. Rotations keep norms, and
    `R(p_i) q . R(p_j) k = q . R(p_j - p_i) k`, so scores of rotated queries and keys depend on
    positions only through their difference. Pairs are `(x[i], x[i + d/2])` (the GPT-NeoX/LLaMA layout):
    the paper's adjacent pairs up to a fixed permutation of the learned projection's outputs, and two
    contiguous halves instead of a strided reshape. Computed in float32, returned in `x.dtype`.
    """
    half = x.shape[-1] // 2
    inv_freq = np.power(float(theta), -np.arange(half) / half).astype(np.float32)
    angles = jnp.asarray(positions, jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi's per-head slopes (Press et al. 2022), float32 `[num_heads]`.

    For `n` a power of two: the geometric sequence `2^(-8/n), 2^(-16/n), ..., 2^(-8)`. Otherwise, as in
    the paper's code: the slopes of the largest power of two `m < n`, then every other slope of `2m`
    heads for the remaining `n - m` heads (slopes that interleave with the first ones).
    """
    def geometric(n: int) -> list[float]:
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]

    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = geometric(closest) + geometric(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, np.float32)


def alibi_bias(query_len: int, key_len: int, num_heads: int, scale: float = 1.0) -> jax.Array:
    """Symmetric ALiBi score bias `-m_h * |i - j|` per distance, float32 `[num_heads, query_len + key_len - 1]`
    (expand with `toeplitz`).

    Press et al. define ALiBi for causal decoders (`j <= i`); a bidirectional encoder sees keys on both
    sides, and the symmetric form penalizes distance in either direction alike. `scale` multiplies every distance
    (`ModelConfig.distance_scale`).
    """
    distance = np.abs(distances(query_len, key_len)).astype(np.float32) * np.float32(scale)
    return -jnp.asarray(alibi_slopes(num_heads))[:, None] * distance


def t5_relative_bucket(rel: np.ndarray, num_buckets: int, max_distance: int) -> np.ndarray:
    """T5's bidirectional relative-position buckets (Raffel et al.) for `rel = i - j` (int32, shape of `rel`).

    Half the buckets per direction: keys left of (or at) the query (`rel >= 0`) use `[0, n/2)`, keys to
    its right `[n/2, n)`, exactly as T5's `_relative_position_bucket(j - i, bidirectional=True)`.
    Within a half, distances below `n/4` get their own bucket; longer ones are log-spaced up to
    `max_distance` and every distance beyond shares the last bucket, so any length reads trained buckets.
    """
    rel = np.asarray(rel, dtype=np.int64)
    half = num_buckets // 2
    max_exact = half // 2
    distance = np.abs(rel)
    # T5 computes the log in float32; substitute max_exact below it (those values are not selected).
    scaled = np.maximum(distance, max_exact).astype(np.float32) / np.float32(max_exact)
    large = max_exact + (np.log(scaled) / np.float32(math.log(max_distance / max_exact))
                         * np.float32(half - max_exact)).astype(np.int64)
    bucket = np.where(distance < max_exact, distance, np.minimum(large, half - 1))
    return (bucket + np.where(rel < 0, half, 0)).astype(np.int32)


def t5_distance_buckets(query_len: int, key_len: int, num_buckets: int, max_distance: int,
                        scale: float = 1.0) -> np.ndarray:
    """T5's bucket of each distance (`kernels.scores.distances` order) times `scale` (`scaled_distances`)."""
    return t5_relative_bucket(scaled_distances(query_len, key_len, scale), num_buckets, max_distance)


def t5_bias(table: jax.Array, query_len: int, key_len: int, max_distance: int, scale: float = 1.0) -> jax.Array:
    """Score bias per distance `[H, query_len + key_len - 1]` (expand with `toeplitz`), read from a
    learned `[num_buckets, H]` table by T5 bucket of each distance (`t5_distance_buckets`)."""
    bucket = t5_distance_buckets(query_len, key_len, table.shape[0], max_distance, scale)
    return jnp.take(table, bucket, axis=0).T


def random_positions(key: jax.Array, batch: int, seq_len: int, max_position: int) -> jax.Array:
    """Randomized positions (Ruoss et al. 2023): per sequence, an increasing sample without replacement
    of `seq_len` positions from `range(max_position)`, int32 `[batch, seq_len]`.

    Training on such positions shows the model the position values (and gaps) of sequences up to
    `max_position` long while only paying for `seq_len` tokens; order is kept, so relative order and
    the sign of differences stay meaningful. Evaluation uses the plain positions `0..N-1`.
    """
    if seq_len > max_position:
        raise ValueError(f"cannot sample {seq_len} distinct positions below random_position_max={max_position}; "
                         "raise model.random_position_max to at least the training sequence length")
    sample = lambda k: jnp.sort(jax.random.choice(k, max_position, (seq_len,), replace=False))  # noqa: E731
    return jax.vmap(sample)(jax.random.split(key, batch)).astype(jnp.int32)
