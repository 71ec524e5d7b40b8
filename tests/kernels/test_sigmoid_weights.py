"""Sigmoid attention weights (`ModelConfig.attention_weights="sigmoid"`): each key weighs `sigmoid(s - log L)` on its
own, in the dense and the blockwise kernel alike (outputs, gradients, dropout); keys added to a row leave the
weights of the others as they were, where a softmax dilutes them; the kernels that cannot do it are refused."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.kernels import dispatch
from deberta_jax.kernels.dense import dense_attention
from deberta_jax.kernels.scores import ScoreTerms
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM
from tests.kernels.test_kernels import N, assert_trees_close, outputs_and_grads, variant_inputs

BIAS = -np.log(24.0)


@pytest.mark.parametrize("variant", ["disentangled", "kerple_log"])
@pytest.mark.parametrize("block_size", [8, 64])
def test_each_key_weighs_the_sigmoid_of_its_own_score_in_both_kernels(variant, block_size):
    terms, v, key_mask = variant_inputs(variant)

    def reference(terms, v, key_mask):
        weights = jax.nn.sigmoid(terms.scores(np.arange(N)) + BIAS) * key_mask[:, None, None, :]
        return jnp.einsum("bhij,bhjd->bhid", weights, v)

    want_out, want_grads = outputs_and_grads(reference, terms, v, key_mask)
    for kernel in (dispatch.attention_kernel("dense", block_size, BIAS),
                   dispatch.attention_kernel("blockwise", block_size, BIAS)):
        out, grads = outputs_and_grads(kernel, terms, v, key_mask)
        np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
        assert_trees_close(grads, want_grads, atol=1e-5)
    softmax_out = dense_attention(terms, v, key_mask)
    assert not np.allclose(softmax_out, want_out, atol=1e-2)


def test_blockwise_sigmoid_dropout_draws_the_dense_kernels_masks():
    terms, v, key_mask = variant_inputs("disentangled")
    dropout = dict(dropout_rate=0.3, dropout_key=jax.random.key(5))
    want_out, want_grads = outputs_and_grads(dispatch.attention_kernel("dense", 8, BIAS), terms, v, key_mask,
                                             **dropout)
    out, grads = outputs_and_grads(dispatch.attention_kernel("blockwise", 8, BIAS), terms, v, key_mask, **dropout)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    assert_trees_close(grads, want_grads, atol=1e-5)
    without = dispatch.attention_kernel("blockwise", 8, BIAS)(terms, v, key_mask)
    assert not np.allclose(out, without, atol=1e-3)


@pytest.mark.parametrize("kernel", ["dense", "blockwise"])
def test_keys_added_to_a_row_leave_the_others_weights_under_sigmoid_and_dilute_them_under_softmax(kernel):
    # Queries and keys alone (no position terms), so the scores of the first n keys are the same in both rows; the
    # added keys carry zero values, so whatever changes in the first n queries' outputs is the old keys' weights.
    n, extra = 16, 48
    rng = np.random.default_rng(4)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 2, n + extra, 8)), jnp.float32) for _ in range(3))
    v = v.at[:, :, n:].set(0.0)

    def outputs(length, bias):
        terms = ScoreTerms(q=q[:, :, :length], k=k[:, :, :length], key_len=length)
        call = dispatch.attention_kernel(kernel, 8, bias)
        return call(terms, v[:, :, :length], jnp.ones((1, length), jnp.int32))[:, :, :n]

    np.testing.assert_allclose(outputs(n + extra, BIAS), outputs(n, BIAS), atol=1e-6)
    diluted = np.abs(outputs(n + extra, None)).mean() / np.abs(outputs(n, None)).mean()
    assert diluted < 0.6  # 48 added keys of 64 take most of the softmax's weight


TINY = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, hidden_dropout=0.0,
            attention_dropout=0.0, position_buckets=8, max_relative_positions=16, score_bias="kerple_log",
            max_position_embeddings=64, trained_length=16)


def test_a_sigmoid_model_is_the_same_in_both_kernels_and_reads_its_bias_from_the_training_length():
    ids = np.random.default_rng(0).integers(0, 64, (2, 40)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 30:] = 0
    cfg = ModelConfig(**TINY, attention_weights="sigmoid")
    graphdef, params = nnx.split(MaskedLM(cfg, rngs=nnx.Rngs(0)))

    def logits(**changes):
        return nnx.merge(nnx.graphdef(MaskedLM(dataclasses.replace(cfg, **changes), rngs=nnx.Rngs(0))), params)(
            ids, mask)

    dense = logits()
    np.testing.assert_allclose(logits(attention_kernel="blockwise", attention_block_size=8), dense, atol=1e-5)
    assert cfg.sigmoid_bias == pytest.approx(-np.log(16))
    assert not np.allclose(logits(trained_length=32), dense, atol=1e-4)
    assert not np.allclose(logits(attention_weights="softmax"), dense, atol=1e-4)


@pytest.mark.parametrize("kernel", ["pallas", "pallas_tpu", "cudnn"])
def test_the_kernels_that_only_softmax_are_refused_with_sigmoid_weights(kernel):
    with pytest.raises(ConfigError, match=rf"model\.attention_kernel='{kernel}'.*softmax only.*'dense', 'blockwise'"):
        ModelConfig(attention="entangled", attention_kernel=kernel, attention_weights="sigmoid")
    with pytest.raises(ValueError, match="softmax only"):
        dispatch.attention_kernel(kernel, 8, BIAS)
    with pytest.raises(ConfigError, match=r"model\.attention_weights='relu'.*'softmax', 'sigmoid'"):
        ModelConfig(attention_weights="relu")
