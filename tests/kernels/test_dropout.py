"""Dropout masks from 16-bit halves: the drawn rate, independence of neighbours, unbiased outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.kernels import dropout_masks
from deberta_jax.model.dropout import Dropout


@pytest.mark.parametrize("rate", [0.1, 0.5, 0.03])
def test_keep_mask_draws_the_requested_rate_with_independent_neighbours(rate):
    shape = (64, 3, 1001)  # odd last axis: the second half of the last draw is discarded
    keep = np.asarray(dropout_masks.keep_mask(jax.random.key(0), shape, rate))
    assert keep.shape == shape
    p = dropout_masks.keep_probability(rate)
    assert abs(p - (1 - rate)) < 2 ** -16
    n = keep.size
    assert abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / n)
    # Both halves of one 32-bit draw (elements 2i, 2i+1) and consecutive draws must be uncorrelated.
    even, odd = keep[..., 0:1000:2].astype(float), keep[..., 1:1001:2].astype(float)
    for a, b in ((even, odd), (odd[..., :-1], even[..., 1:])):
        corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(corr) < 5 / np.sqrt(a.size)


def test_masks_differ_between_keys_and_repeat_for_one_key():
    a = dropout_masks.keep_mask(jax.random.key(1), (4, 256), 0.1)
    assert np.array_equal(a, dropout_masks.keep_mask(jax.random.key(1), (4, 256), 0.1))
    assert not np.array_equal(a, dropout_masks.keep_mask(jax.random.key(2), (4, 256), 0.1))


def test_dropout_is_unbiased_and_the_identity_without_rngs():
    layer = Dropout(0.1)
    x = jnp.ones((200, 1000))
    assert layer(x) is x
    dropped = np.asarray(layer(x, nnx.Rngs(dropout=0)))
    assert set(np.unique(dropped)) == {0.0, np.float32(1 / dropout_masks.keep_probability(0.1))}
    assert abs(dropped.mean() - 1.0) < 5 * np.sqrt(0.1 / 0.9 / x.size)
    assert Dropout(0.0)(x, nnx.Rngs(dropout=0)) is x
