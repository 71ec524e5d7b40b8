"""The dropout layer of the model: `nnx.Dropout`'s interface over `kernels.dropout_masks`, which draws the masks
from half the random bits."""

from __future__ import annotations

import jax
from flax import nnx

from deberta_jax.kernels import dropout_masks


class Dropout(nnx.Module):
    """Drop-in for `nnx.Dropout` that draws `keep_mask` from the `dropout` stream of `rngs`;
    the identity when `rngs` is None (evaluation) or `rate` is 0."""

    def __init__(self, rate: float):
        self.rate = float(rate)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        if rngs is None or self.rate == 0.0:
            return x
        return dropout_masks.apply(x, dropout_masks.keep_mask(rngs.dropout(), x.shape, self.rate), self.rate)
