"""Dropout masks from 16 random bits per element: half the random-number work of `nnx.Dropout`.

`jax.random.bernoulli` spends a full 32-bit draw on every element (a float32 uniform). With
threefry, JAX's default generator and the one whose bits do not depend on how an array is sharded,
drawing the masks is a visible share of a small model's train step on CPU (benchmarks/README.md has the
figures). Comparing each 16-bit half of a 32-bit draw with `round(rate * 2**16)` gives the same Bernoulli
distribution for half the generator work, with the rate rounded to a multiple of 2**-16 (0.1 becomes
0.1000061); kept values are scaled by the rounded keep probability, so the output stays unbiased. The bits
are still a pure function of the key, so resumed runs and 1-vs-8-device runs draw the same masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

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


def apply(x: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """Zero the dropped elements of `x` and rescale the kept ones; `keep=None` means no dropout."""
    if keep is None:
        return x
    return jnp.where(keep, x / jnp.asarray(keep_probability(rate), x.dtype), jnp.zeros_like(x))
