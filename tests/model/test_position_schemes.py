"""Length-generalization baselines: sinusoidal, RoPE, ALiBi, T5 buckets, NoPE and randomized positions.

Pure functions against hand-computed values, the relative schemes' translation invariance on the score
functions, and every scheme end to end in a tiny model (padding, 8x the training length, gradients).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.kernels.scores import ScoreTerms, toeplitz
from deberta_jax.model import biases, positions
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM
from tests.helpers import assert_padding_invariant, bias_params

TRAIN_LEN = 16
BASE = dict(vocab_size=60, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
            max_position_embeddings=32, trained_length=TRAIN_LEN, attention="entangled")
SCHEMES = {
    "nope": dict(BASE),
    "sinusoidal": dict(BASE, position_biased_input=True, absolute_embedding="sinusoidal"),
    "rope": dict(BASE, attention="rope"),
    # Every registered bias scheme alone, and one added to DeBERTa's terms.
    **{name: dict(BASE, attention=name, t5_num_buckets=8, t5_max_distance=20) for name in biases.SCHEMES},
    "deberta_kerple_log": dict(BASE, attention="disentangled", score_bias="kerple_log", position_buckets=8,
                               max_relative_positions=16),
    "learned_randomized": dict(BASE, position_biased_input=True, randomized_positions=True, random_position_max=32,
                               absolute_position_policy="clip"),
    "sinusoidal_randomized": dict(BASE, position_biased_input=True, absolute_embedding="sinusoidal",
                                  randomized_positions=True, random_position_max=64),
    "rope_randomized": dict(BASE, attention="rope", randomized_positions=True, random_position_max=64),
}


def build(name, **kw):
    return MaskedLM(ModelConfig(**dict(SCHEMES[name], **kw)), rngs=nnx.Rngs(0))


def ids(b, n, seed=0):
    return np.random.default_rng(seed).integers(5, 60, size=(b, n)).astype(np.int32)


# --------------------------------------------------------------------------- pure functions
def test_sinusoidal_values():
    out = np.asarray(positions.sinusoidal_embeddings(np.array([0, 1, 2]), 4))
    # dim 4: frequencies 1 and 1/100 (10000^(-2/4)); even features sin, odd features cos.
    expected = [[0, 1, 0, 1],
                [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)],
                [math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)]]
    np.testing.assert_allclose(out, expected, atol=1e-6)


def test_rope_rotates_pairs_by_hand_computed_angles():
    # d=4, theta=100: pair (x0, x2) turns by p, pair (x1, x3) by p / 10.
    x = jnp.array([1.0, 1.0, 0.0, 0.0])
    out = np.asarray(positions.apply_rope(x[None], np.array([3]), 100.0))[0]
    np.testing.assert_allclose(out, [math.cos(3), math.cos(0.3), math.sin(3), math.sin(0.3)], atol=1e-6)


def test_rope_preserves_norms_and_dot_products_depend_only_on_distance():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(2, 8)).astype(np.float32)
    pos = np.arange(40)
    rq = np.asarray(positions.apply_rope(np.broadcast_to(q, (40, 8)), pos, 10000.0))
    rk = np.asarray(positions.apply_rope(np.broadcast_to(k, (40, 8)), pos, 10000.0))
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q), rtol=1e-5)
    dots = rq @ rk.T  # dots[i, j] = R(i) q . R(j) k must be a function of i - j alone
    np.testing.assert_allclose(dots[5:, 5:], dots[:-5, :-5], atol=1e-4)
    np.testing.assert_allclose(dots[0, 0], q @ k, atol=1e-5)


def test_alibi_slopes_for_power_of_two_and_other_head_counts():
    np.testing.assert_array_equal(positions.alibi_slopes(4), [2**-2, 2**-4, 2**-6, 2**-8])
    # 6 heads: the 4-head slopes, then every other 8-head slope (2^-1, 2^-3) for the last two.
    np.testing.assert_array_equal(positions.alibi_slopes(6), [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3])


def expand(bias_by_distance, n_q, n_k):
    """A per-distance bias `[H, n_q + n_k - 1]` as the `[H, n_q, n_k]` score bias it stands for."""
    return toeplitz(bias_by_distance, np.arange(n_q), np.arange(n_k), n_k)


def test_alibi_bias_is_symmetric_negative_distance():
    by_distance = positions.alibi_bias(3, 4, 4)
    assert by_distance.shape == (4, 3 + 4 - 1)
    bias = np.asarray(expand(by_distance, 3, 4))
    np.testing.assert_array_equal(bias[0], -0.25 * np.array([[0, 1, 2, 3], [1, 0, 1, 2], [2, 1, 0, 1]]))
    np.testing.assert_array_equal(bias[3, 2], -(2**-8) * np.array([2, 1, 0, 1]))


def test_t5_buckets_both_directions():
    # 32 buckets, max_distance 128: 16 per direction, exact below 8, then 8 + floor(log(d/8)/log(16) * 8).
    rel = np.array([0, 3, 7, 10, 20, 50, 100, 200, 10_000, -1, -3, -10, -20, -200])
    expected = [0, 3, 7, 8, 10, 13, 15, 15, 15, 17, 19, 24, 26, 31]
    np.testing.assert_array_equal(positions.t5_relative_bucket(rel, 32, 128), expected)


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (64, 256)])
def test_t5_buckets_equal_transformers_t5(num_buckets, max_distance):
    import torch
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = np.subtract.outer(np.arange(300), np.arange(300))  # i - j; T5 takes memory - context = j - i
    expected = T5Attention._relative_position_bucket(torch.tensor(-rel), bidirectional=True,
                                                     num_buckets=num_buckets, max_distance=max_distance)
    np.testing.assert_array_equal(positions.t5_relative_bucket(rel, num_buckets, max_distance), expected.numpy())


def test_random_positions_are_ordered_distinct_and_keyed():
    a = np.asarray(positions.random_positions(jax.random.key(0), 3, 10, 50))
    assert a.shape == (3, 10) and a.min() >= 0 and a.max() < 50
    assert (np.diff(a, axis=-1) > 0).all()  # increasing, hence without repeats
    assert not np.array_equal(a[0], a[1])  # each sequence draws its own sample
    np.testing.assert_array_equal(a, positions.random_positions(jax.random.key(0), 3, 10, 50))
    assert not np.array_equal(a, positions.random_positions(jax.random.key(1), 3, 10, 50))
    with pytest.raises(ValueError, match="random_position_max"):
        positions.random_positions(jax.random.key(0), 1, 10, 8)


def _scores(variant, q, k):
    """Scores of a relative scheme for tokens at positions 0..N-1."""
    n, h = q.shape[-2], q.shape[1]
    if variant == "rope":
        pos = np.arange(n)
        terms = ScoreTerms(q=positions.apply_rope(q, pos, 10000.0), k=positions.apply_rope(k, pos, 10000.0), key_len=n)
    else:
        cfg = ModelConfig(**dict(SCHEMES[variant], num_heads=h, hidden_size=h * q.shape[-1]))
        bias = biases.SCHEMES[variant].bias(bias_params(cfg, seed=1), cfg, n, 1.0, np.ones((1, n)))
        terms = ScoreTerms(q=q, k=k, bias=bias, key_len=n)
    return terms.scores(np.arange(n))


@pytest.mark.parametrize("variant", ["rope", *biases.SCHEMES])
def test_relative_scores_depend_only_on_distance(variant):
    # Shift the same tokens right by s positions (s new tokens in front): their scores must not change.
    rng = np.random.default_rng(0)
    s, n = 7, 40
    q, k = (jnp.asarray(rng.normal(size=(1, 4, s + n, 8)), jnp.float32) for _ in range(2))
    shifted = _scores(variant, q, k)[..., s:, s:]
    np.testing.assert_allclose(shifted, _scores(variant, q[..., s:, :], k[..., s:, :]), atol=2e-5)


# --------------------------------------------------------------------------- every scheme in a model
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_appending_padding_does_not_change_real_tokens(name):
    assert_padding_invariant(build(name), ids(2, 12))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_finite_at_eight_times_the_training_length(name):
    # Only the learned table needs a policy (clip, set in SCHEMES); sinusoids are defined everywhere.
    out = build(name).mlm_logits(ids(1, 8 * TRAIN_LEN))
    assert out.shape == (1, 8 * TRAIN_LEN, 60) and np.isfinite(np.asarray(out)).all()


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_training_gradients_are_finite(name):
    model = build(name)
    x = ids(2, TRAIN_LEN)

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(x, rngs=nnx.Rngs(dropout=0)))[..., 7])

    grads = nnx.state(nnx.jit(nnx.grad(loss))(model), nnx.Param)
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    for parameter in biases.parameters_of(model.cfg):  # a bias scheme's shared parameters are trained
        assert float(jnp.abs(grads["encoder"][parameter][...]).max()) > 0, parameter


def test_sinusoidal_has_no_table_and_ignores_the_policy():
    model = build("sinusoidal", absolute_position_policy="strict")
    assert model.embeddings.position_embeddings is None and not model.cfg.uses_absolute_table
    assert np.isfinite(np.asarray(model.mlm_logits(ids(1, 40)))).all()  # 40 > max_position_embeddings


def test_nope_is_permutation_equivariant():
    # No position information anywhere: permuting the tokens permutes the outputs.
    model = build("nope")
    x = ids(1, 10)
    perm = np.random.default_rng(0).permutation(10)
    np.testing.assert_allclose(model.mlm_logits(x[:, perm]), model.mlm_logits(x)[:, perm], atol=2e-5)
    assert model.embeddings.position_embeddings is None


# --------------------------------------------------------------------------- randomized positions
@pytest.mark.parametrize("name", ["learned_randomized", "sinusoidal_randomized", "rope_randomized"])
def test_randomized_positions_in_training_and_plain_positions_in_evaluation(name):
    # No dropout: in training mode, only the sampled positions can make outputs differ. Larger initial
    # weights than BERT's 0.02 make RoPE's effect on the scores (q . k ~ 0 at init) visible.
    kw = dict(hidden_dropout=0.0, attention_dropout=0.0, initializer_range=0.2)
    model, plain = build(name, **kw), build(name, **kw, randomized_positions=False)
    x = ids(2, 12)
    train = lambda seed: np.asarray(model(x, rngs=nnx.Rngs(dropout=seed)))  # noqa: E731
    np.testing.assert_array_equal(train(1), train(1))
    assert not np.allclose(train(1), train(2), atol=1e-4)
    np.testing.assert_array_equal(model.mlm_logits(x), plain.mlm_logits(x))  # same weights, positions 0..N-1
    assert not np.allclose(train(1), plain(x, rngs=nnx.Rngs(dropout=1)), atol=1e-4)

    ctx = model.encoder.position_context(2, 12, rngs=nnx.Rngs(dropout=1))
    sampled = np.asarray(ctx.position_ids)
    assert ctx.sampled and sampled.shape == (2, 12) and (np.diff(sampled, axis=-1) > 0).all()
    assert sampled.max() < model.cfg.random_position_max
    np.testing.assert_array_equal(model.encoder.position_context(2, 12).position_ids, np.arange(12)[None])


def test_randomized_learned_table_is_trained_up_to_random_position_max():
    # Rows below random_position_max receive gradient in training, so the policy starts there.
    model = build("learned_randomized", absolute_position_policy="strict")
    assert model.cfg.trained_positions == 32
    assert np.isfinite(np.asarray(model.mlm_logits(ids(1, 24)))).all()  # 24 > trained_length 16


# --------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("field,changes,fix", [
    ("attention", dict(attention="rotary"), "'rope', 'alibi', 't5_bias'"),
    ("num_heads", dict(attention="rope", hidden_size=20), "even head_dim"),
    ("rope_theta", dict(attention="rope", rope_theta=0.0), "must be > 0"),
    ("t5_num_buckets", dict(attention="t5_bias", t5_num_buckets=5), "even integer >= 4"),
    ("t5_max_distance", dict(attention="t5_bias", t5_max_distance=8), "must exceed t5_num_buckets // 4 = 8"),
    ("absolute_embedding", dict(absolute_embedding="rotary"), "choose one of"),
    ("absolute_embedding", dict(absolute_embedding="sinusoidal"), "set position_biased_input=True"),
    ("absolute_embedding", dict(position_biased_input=True, absolute_embedding="sinusoidal", hidden_size=33,
                                num_heads=3), "even hidden_size"),
    ("randomized_positions", dict(attention="alibi", randomized_positions=True), "enable one"),
    ("random_position_max", dict(position_biased_input=True, randomized_positions=True, random_position_max=64),
     "must be <= max_position_embeddings=32"),
    ("random_position_max", dict(attention="rope", randomized_positions=True, random_position_max=8),
     "must be >= trained_length=16"),
])
def test_bad_config_names_field_and_fix(field, changes, fix):
    with pytest.raises(ConfigError, match=rf"model\.{field}=.*{fix}"):
        ModelConfig(**dict(BASE, **changes))


def test_knobs_of_other_variants_are_ignored():
    # DeBERTa's bucket count and RoPE's base would be invalid for their variants; elsewhere they are unused.
    cfg = ModelConfig(**dict(BASE, attention="alibi", position_buckets=1, rope_theta=-1.0, t5_num_buckets=3))
    assert cfg.attention == "alibi"
    # The table bound only applies to a learned table: sinusoids and RoPE can sample any range.
    ModelConfig(**dict(BASE, attention="rope", randomized_positions=True, random_position_max=4096))
