"""Dropout masks from 16 random bits per element: half the random-number work of `nnx.Dropout`.

`jax.random.bernoulli` spends a full 32-bit draw on every element (a float32 uniform). With
threefry, JAX's default generator and the one whose bits do not depend on how an array is sharded,
drawing the masks is a visible share of a small model's train step on CPU (benchmarks/README.md has the
figures). Comparing each 16-bit half of a 32-bit draw with `round(rate * 2**16)` gives the same Bernoulli
distribution for half the generator work, with the rate rounded to a multiple of 2**-16 (0.1 becomes
0.1000061); kept values are scaled by the rounded keep probability, so the output stays unbiased. The bits
are still a pure function of the key, so resumed runs and 1-vs-8-device runs draw the same masks.

Attention dropout (`attention_hashes`, `attention_keep`) is instead a counter-based hash: each element's 16 bits
are a pure function of the key's bits and the element's (sequence, head, query position, key position), so any
kernel draws the same mask whatever its tiling (blocks of keys, tiles inside a fused kernel, a sharded batch),
and a backward pass regenerates the forward's mask from the positions it is at. The hash is a chain of a 32-bit
integer mixer (`_mix`: multiplies, xors and logical shifts of int32, which XLA and Mosaic both lower): the key's
words, the sequence and the head give one seed per (sequence, head); each query and each key position is hashed
with it once (`O(N)` work, outside any tile), and an element's bits mix its query's hash with its key's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_LEVELS = 1 << 16


def _threshold(rate: float) -> int:
    return min(round(rate * _LEVELS), _LEVELS)


def keep_probability(rate: float) -> float:
    """The keep probability actually drawn for a dropout `rate` (the rate rounded to 2**-16)."""
    return 1.0 - _threshold(rate) / _LEVELS


def keep_mask(key: jax.Array, shape: tuple[int, ...], rate: float) -> jax.Array:
    """Boolean mask of `shape`, True with probability `keep_probability(rate)`, independently per element.

    The two halves of each draw fill neighbouring elements of the last axis, so the draw has the
    mask's leading axes (and their sharding).
    """
    *lead, n = shape
    bits = jax.random.bits(key, (*lead, (n + 1) // 2), jnp.uint32)
    halves = jnp.stack([bits & 0xFFFF, bits >> 16], axis=-1).reshape(*lead, -1)[..., :n]
    return halves >= _threshold(rate)


# lowbias32's multipliers (Chris Wellons' hash-prospector): every input bit flips each output bit with probability
# within 0.2% of one half. As int32, so that the arithmetic wraps the same in jnp and inside a Pallas kernel.
_MULTIPLIERS = tuple(np.uint32(c).view(np.int32) for c in (0x7FEB352D, 0x846CA68B))


def _shift_right(x, bits: int):
    return jax.lax.shift_right_logical(x, jnp.full_like(x, bits))


def _mix(x):
    """A bijection of int32 whose outputs look independent for inputs that differ in a few bits."""
    x = x ^ _shift_right(x, 16)
    x = x * _MULTIPLIERS[0]
    x = x ^ _shift_right(x, 15)
    x = x * _MULTIPLIERS[1]
    return x ^ _shift_right(x, 16)


def attention_hashes(key: jax.Array, batch: int, heads: int, query_positions, key_positions):
    """The per-position hashes attention dropout combines: (queries `[batch, heads, nq, 1]`, keys
    `[batch, heads, 1, nk]`), int32, for sequences `0..batch-1` of the whole batch and every head.

    Query and key positions are hashed as the distinct counters `2 i` and `2 j + 1`, so a query's hash and the
    same position's key hash are unrelated (the diagonal is dropped like any other element).
    """
    seed = jnp.zeros((), jnp.int32)
    for word in jax.lax.bitcast_convert_type(jax.random.key_data(key).ravel(), jnp.int32):
        seed = _mix(seed ^ word)
    per_head = _mix(_mix(seed ^ jnp.arange(batch, dtype=jnp.int32)[:, None]) ^ jnp.arange(heads, dtype=jnp.int32))
    per_head = per_head[:, :, None]
    queries = _mix(per_head ^ (2 * jnp.asarray(query_positions, jnp.int32)))
    keys = _mix(per_head ^ (2 * jnp.asarray(key_positions, jnp.int32) + 1))
    return queries[..., None], keys[..., None, :]


def attention_keep(query_hash, key_hash, rate: float):
    """Keep mask of attention dropout, True with probability `keep_probability(rate)`, from broadcasting query and
    key hashes (`attention_hashes`, or a tile's rows of them inside a kernel)."""
    return _shift_right(_mix(query_hash ^ key_hash), 16) >= _threshold(rate)


def apply(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """Zero the dropped elements of `x` and rescale the kept ones; `keep=None` means no dropout."""
    if keep is None:
        return x
    return jnp.where(keep, x / jnp.asarray(keep_probability(rate), x.dtype), jnp.zeros_like(x))
