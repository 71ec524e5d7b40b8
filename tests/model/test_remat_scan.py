"""Remat and scanned layers change how the layer stack is computed, never the result: identical loss and
gradients (float32, within 1e-6) under every policy, with dropout on; the same parameters, so checkpoints
interchange."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.model.config import REMAT_POLICIES, ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM, with_options

# Three layers (a scan of more than two), EMD (the last layer re-applied outside the scan), both position terms,
# dropout in every place it applies, and parameters large enough to make every term count.
CFG = dict(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=48, hidden_dropout=0.2,
           attention_dropout=0.15, position_buckets=8, max_relative_positions=16, use_emd=True,
           initializer_range=0.2, layer_norm_eps=1e-5)
IDS = np.random.default_rng(0).integers(0, 61, (2, 14)).astype(np.int32)
MASK = np.concatenate([np.ones((2, 11), np.int32), np.zeros((2, 3), np.int32)], axis=1)  # padded keys too


def loss_and_grads(dropout_seed=3, **fields):
    model = MaskedLM(ModelConfig(**CFG, **fields), rngs=nnx.Rngs(params=0))
    graphdef, state = nnx.split(model)

    def loss(state):
        logits = nnx.merge(graphdef, state)(IDS, MASK, rngs=nnx.Rngs(dropout=dropout_seed))
        return jnp.mean(jax.nn.log_softmax(logits)[..., 7] * MASK)

    value, grads = jax.jit(jax.value_and_grad(loss))(state)
    return float(value), jax.tree.leaves(grads)


@pytest.fixture(scope="module")
def reference():
    return loss_and_grads()


@pytest.mark.parametrize("remat,scan", [c for c in itertools.product(REMAT_POLICIES, (False, True))
                                        if c != ("none", False)])
def test_remat_and_scan_give_the_same_loss_and_gradients(reference, remat, scan):
    loss, grads = loss_and_grads(remat=remat, scan_layers=scan)
    assert abs(loss - reference[0]) < 1e-6
    assert len(grads) == len(reference[1])
    worst = max(float(np.max(np.abs(g - r))) for g, r in zip(grads, reference[1]))
    assert worst < 1e-6, f"remat={remat}, scan_layers={scan}: gradients differ by {worst}"


def test_dropout_is_drawn_per_layer_and_is_active(reference):
    """Another dropout key changes the loss (the comparison above is not of a dropout-free model), and layers do
    not share masks (two layers with the same key would make the scan's agreement trivial)."""
    assert abs(loss_and_grads(dropout_seed=4)[0] - reference[0]) > 1e-4
    model = MaskedLM(ModelConfig(**{**CFG, "use_emd": False, "attention_dropout": 0.0}), rngs=nnx.Rngs(params=0))
    ctx = model.encoder.position_context(*IDS.shape)
    hidden = jnp.ones((2, 14, 32))
    layer = model.encoder.layers[0]
    keys = jax.vmap(jax.random.fold_in, (None, 0))(jax.random.key(1), jnp.arange(2))
    first, second = (layer(hidden, jnp.asarray(MASK), ctx, rngs=nnx.Rngs(dropout=k)) for k in keys)
    assert not np.allclose(first, second)


def test_checkpoints_interchange_between_remat_and_scan_settings():
    plain = MaskedLM(ModelConfig(**CFG), rngs=nnx.Rngs(params=0))
    scanned = with_options(plain, remat="full", scan_layers=True)
    assert jax.tree.structure(nnx.state(scanned)) == jax.tree.structure(nnx.state(plain))
    np.testing.assert_allclose(scanned(IDS, MASK), plain(IDS, MASK), rtol=0, atol=1e-5)  # logits up to ~10


def test_unknown_remat_policy_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"model.remat='dots_saveable' is invalid: choose one of"):
        ModelConfig(**CFG, remat="dots_saveable")


def test_remat_lowers_the_compiled_memory_of_the_backward_pass():
    """What remat is for, in XLA's own accounting: 'full' keeps only each layer's input, so the compiled gradient
    needs a fraction of the temporaries; 'dots_no_batch' keeps the projections, in between. (Unrolled layers
    would show no saving at all: the reason remat runs as a scan.)"""
    ids = np.random.default_rng(1).integers(0, 61, (4, 256)).astype(np.int32)

    def temporaries(remat):
        cfg = ModelConfig(vocab_size=61, hidden_size=64, num_layers=8, num_heads=4, intermediate_size=256,
                          attention="entangled", position_biased_input=True, pos_att_type=(), remat=remat)
        graphdef, state = nnx.split(MaskedLM(cfg, rngs=nnx.Rngs(params=0)))
        loss = lambda state: jnp.mean(nnx.merge(graphdef, state).encode(ids, rngs=nnx.Rngs(dropout=0)))  # noqa: E731
        return jax.jit(jax.grad(loss)).lower(state).compile().memory_analysis().temp_size_in_bytes

    none, projections, full = (temporaries(r) for r in ("none", "dots_no_batch", "full"))
    assert full < 0.4 * none and full < projections < none, (none, projections, full)
