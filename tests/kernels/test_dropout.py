"""Dropout masks from 16-bit halves: the drawn rate, independence of neighbours, unbiased outputs; attention
dropout's counter-based mask: the drawn rate, independence along every axis, a function of positions alone, so the
blockwise kernel drops the dense kernel's entries (the fused kernels' are tested in test_fused_kernels.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.kernels import dropout_masks
from deberta_jax.kernels.blockwise import blockwise_attention
from deberta_jax.kernels.dense import dense_attention
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


def attention_mask(key, batch, heads, n, rate=0.1):
    positions = np.arange(n)
    return np.asarray(dropout_masks.attention_keep(
        *dropout_masks.attention_hashes(key, batch, heads, positions, positions), rate))


@pytest.mark.parametrize("rate", [0.1, 0.5])
def test_attention_mask_draws_the_rate_independently_across_sequences_heads_positions_and_tiles(rate):
    """1M elements of `[4, 4, 512, 512]`: the keep rate within 5 standard deviations of `keep_probability`, and no
    correlation between an element and its neighbour along each axis (the next sequence, head, query, key), the
    element a tile of 128 further along either position, the diagonal's elements and the rest, or the fourth corner
    of a rectangle and the other three (the hash mixes a query's and a key's hash by xor)."""
    keep = attention_mask(jax.random.key(0), 4, 4, 512, rate).astype(float)
    p = dropout_masks.keep_probability(rate)
    assert abs(keep.mean() - p) < 5 * np.sqrt(p * (1 - p) / keep.size)
    pairs = {"sequence": (keep[:-1], keep[1:]), "head": (keep[:, :-1], keep[:, 1:]),
             "query": (keep[..., :-1, :], keep[..., 1:, :]), "key": (keep[..., :-1], keep[..., 1:]),
             "query tile": (keep[..., :-128, :], keep[..., 128:, :]), "key tile": (keep[..., :-128], keep[..., 128:]),
             "rectangle": ((keep[..., :-1, :-1] + keep[..., 1:, :-1] + keep[..., :-1, 1:]) % 2, keep[..., 1:, 1:])}
    for name, (a, b) in pairs.items():
        assert abs(np.corrcoef(a.ravel(), b.ravel())[0, 1]) < 5 / np.sqrt(a.size), name
    diagonal = keep[..., np.arange(512), np.arange(512)]
    assert abs(diagonal.mean() - p) < 5 * np.sqrt(p * (1 - p) / diagonal.size)


def test_attention_mask_is_a_function_of_positions_and_key():
    """Hashes of a block of positions are those positions' entries of the whole range's (any tiling draws the same
    mask); another key draws another mask, a legacy uint32 key the same as its typed one."""
    key = jax.random.key(3)
    whole = attention_mask(key, 2, 3, 40)
    query_hash, key_hash = dropout_masks.attention_hashes(key, 2, 3, np.arange(8, 24), np.arange(30, 40))
    np.testing.assert_array_equal(dropout_masks.attention_keep(query_hash, key_hash, 0.1), whole[..., 8:24, 30:40])
    np.testing.assert_array_equal(attention_mask(jax.random.PRNGKey(3), 2, 3, 40), whole)
    assert not np.array_equal(attention_mask(jax.random.key(4), 2, 3, 40), whole)


def test_blockwise_attention_dropout_equals_the_dense_kernel():
    """Blocks of 8 over 37 keys (the last ragged), DeBERTa's terms, padding: with the same key both kernels drop the
    same entries, so outputs and every gradient agree to float rounding (observed ~5e-7)."""
    from tests.kernels.test_kernels import outputs_and_grads, variant_inputs

    dropout = dict(dropout_rate=0.3, dropout_key=jax.random.key(2))
    inputs = variant_inputs("disentangled")
    want = outputs_and_grads(jax.jit(functools.partial(dense_attention, **dropout)), *inputs)
    got = outputs_and_grads(jax.jit(functools.partial(blockwise_attention, block_size=8, **dropout)), *inputs)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=2e-6, rtol=0)
    undropped = jax.jit(dense_attention)(*inputs)
    assert np.abs(np.asarray(got[0] - undropped)).max() > 0.1
