"""Options for running past the training length: log-length attention temperature (fixed, or learned per head),
sliding windows (with or without global tokens), interpolated relative distances, and the length study's methods
built on them.

Each option must leave sequences of up to the training length exactly as they were (so a model trained without it
evaluates the same at 1x), and past it must do what its docstring says: checked against a naive per-(i, j) loop,
across kernels, and on hand-computed values.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.kernels.blockwise import blockwise_attention
from deberta_jax.kernels.dense import dense_attention
from deberta_jax.kernels.scores import NEG_INF, RelativeIndex, ScoreTerms, window_starts
from deberta_jax.model import positions
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM, with_options
from deberta_jax.study import length_study
from tests.helpers import sweep_variant_configs

TRAIN_LEN = 16
# Every family the sweeps train, at the micro size (learned tables clipped past the training length).
SCHEMES = sweep_variant_configs(TRAIN_LEN, hidden_dropout=0.0, attention_dropout=0.0, absolute_position_policy="clip")


def build(name):
    model = MaskedLM(ModelConfig(**SCHEMES[name]), rngs=nnx.Rngs(0))
    # Non-zero biases and LayerNorm offsets, so that no term hides behind an initial zero.
    leaves, tree = jax.tree.flatten(nnx.state(model))
    keys = jax.random.split(jax.random.key(1), len(leaves))
    noisy = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    nnx.update(model, jax.tree.unflatten(tree, noisy))
    return model


def batch(n, b=2, seed=0, pad=0):
    ids = np.random.default_rng(seed).integers(5, 60, size=(b, n)).astype(np.int32)
    mask = np.ones((b, n), np.int32)
    if pad:
        mask[-1, n - pad:] = 0
    return ids, mask


def encode(model, n, **kw):
    return np.asarray(model.encode(*batch(n, **kw)))


# --------------------------------------------------------------------------- hand-computed values
def test_window_starts_are_centered_and_shifted_inside_the_row():
    np.testing.assert_array_equal(window_starts(10, 10, 4), [0, 0, 0, 1, 2, 3, 4, 5, 6, 6])
    np.testing.assert_array_equal(window_starts(3, 3, 4), [0, 0, 0])  # a row shorter than the window: all of it


def length_temperature(key_mask, window, trained_length, with_ends=False):
    """The log-length temperature `[B, 1, N, 1]` as the encoder builds it."""
    cfg = ModelConfig(**dict(SCHEMES["bert"], trained_length=trained_length, attention_window=window,
                             window_global_tokens=with_ends, attention_temperature="log_length"))
    mask = np.asarray(key_mask)
    return MaskedLM(cfg, rngs=nnx.Rngs(0)).encoder.position_context(*mask.shape, key_mask=mask).temperature


def test_length_temperature_counts_the_real_keys_each_query_sees():
    mask = np.array([[1, 1, 1, 1, 1, 1, 0, 0]])
    full = np.asarray(length_temperature(mask, 0, 4))[0, 0, :, 0]
    np.testing.assert_allclose(full, np.full(8, math.log(6) / math.log(4)), rtol=1e-6)
    # Window 5: starts [0, 0, 0, 1, 2, 3, 3, 3]; real keys in [s, s + 5) of [1, 1, 1, 1, 1, 1, 0, 0], floored at 1.
    windowed = np.asarray(length_temperature(mask, 5, 4))[0, 0, :, 0]
    np.testing.assert_allclose(windowed, np.maximum(np.log([5, 5, 5, 5, 4, 3, 3, 3]) / math.log(4), 1), rtol=1e-6)


def test_global_tokens_are_each_rows_ends_and_count_where_outside_the_window():
    mask = np.array([[1] * 10, [1] * 7 + [0] * 3])
    np.testing.assert_array_equal(np.asarray(positions.global_keys(mask))[:, 0],
                                  [[1, 0, 0, 0, 0, 0, 0, 0, 0, 1], [1, 0, 0, 0, 0, 0, 1, 0, 0, 0]])
    # Window 4 over 10 positions: starts [0, 0, 0, 1, 2, 3, 4, 5, 6, 6]. Row 0: 4 keys in every window, plus
    # position 0 outside the windows starting at 1 or later, plus position 9 outside those starting before 6.
    visible = np.asarray(positions.visible_keys(mask, 4, with_ends=True))
    np.testing.assert_array_equal(visible[0], [5, 5, 5, 6, 6, 6, 6, 6, 5, 5])
    # Row 1 (7 real keys): real keys in each window, plus position 0 from start 1 on, plus position 6 where the
    # window ends at or before it (starts 0-2).
    np.testing.assert_array_equal(np.asarray(positions.visible_keys(mask, 4))[1], [4, 4, 4, 4, 4, 4, 3, 2, 1, 1])
    np.testing.assert_array_equal(visible[1], [5, 5, 5, 6, 6, 5, 4, 3, 2, 2])


def test_the_length_temperature_counts_the_global_keys_outside_the_window():
    """The encoder's temperature, not only `visible_keys`: a middle query sees its window's 4 keys plus both ends."""
    mask = np.ones((1, 10), np.int32)
    with_ends = np.asarray(length_temperature(mask, 4, 4, with_ends=True))[0, 0, :, 0]
    np.testing.assert_allclose(with_ends, np.log([5, 5, 5, 6, 6, 6, 6, 6, 5, 5]) / math.log(4), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(length_temperature(mask, 4, 4))[0, 0, :, 0], 1.0, rtol=1e-6)


def test_interpolated_distances_reach_only_the_rows_of_the_training_length():
    kw = dict(position_buckets=8, max_relative_positions=64, clamp=True)
    n = 4 * TRAIN_LEN
    assert positions.relative_rows_used(n, n, **kw) != positions.relative_rows_used(TRAIN_LEN, TRAIN_LEN, **kw)
    # Distances up to n - 1 times L / n round to at most L: the rows of a sequence one longer than L.
    assert (positions.relative_rows_used(n, n, **kw, scale=TRAIN_LEN / n)
            == positions.relative_rows_used(TRAIN_LEN + 1, TRAIN_LEN + 1, **kw))
    np.testing.assert_allclose(np.asarray(positions.alibi_bias(5, 5, 2, 0.5)),
                               0.5 * np.asarray(positions.alibi_bias(5, 5, 2)), rtol=1e-6)


def test_distance_scale_is_one_up_to_the_training_length():
    cfg = ModelConfig(**dict(SCHEMES["deberta"], relative_position_policy="interpolate"))
    assert cfg.distance_scale(TRAIN_LEN) == 1.0 and cfg.distance_scale(8) == 1.0
    assert cfg.distance_scale(4 * TRAIN_LEN) == 0.25
    assert ModelConfig(**SCHEMES["deberta"]).distance_scale(4 * TRAIN_LEN) == 1.0


# --------------------------------------------------------------------------- the kernels against a naive loop
def naive_attention(q, k, v, c2p, p2c, index, bias, temperature, window, key_mask, global_keys):
    """Every (b, h, i, j) score written out from the module docstring of `kernels.scores`, in float64."""
    q, k, v, c2p, p2c, bias, temperature = (np.asarray(x, np.float64) for x in (q, k, v, c2p, p2c, bias, temperature))
    b_, h_, n, d = q.shape
    starts = window_starts(n, n, window)
    out = np.zeros_like(q)
    for b in range(b_):
        for h in range(h_):
            scores = np.empty((n, n))
            for i in range(n):
                for j in range(n):
                    row = index[i - j + n - 1]
                    s = (q[b, h, i] @ k[b, h, j] + c2p[b, h, i, row] + p2c[b, h, j, row]) / math.sqrt(3 * d)
                    s = temperature[b, h % temperature.shape[1], i, 0] * (s + bias[h, i - j + n - 1])
                    visible = key_mask[b, j] and (starts[i] <= j < starts[i] + window or global_keys[b, 0, j])
                    scores[i, j] = s if visible else NEG_INF
            p = np.exp(scores - scores.max(-1, keepdims=True))
            out[b, h] = (p / p.sum(-1, keepdims=True)) @ v[b, h]
    return out


@pytest.mark.parametrize("kernel", ["dense", "blockwise"])
@pytest.mark.parametrize("learned", [False, True], ids=["fixed", "learned-with-global-tokens"])
def test_kernels_with_temperature_window_and_padding_match_a_naive_loop(kernel, learned):
    b, h, n, d, r = 2, 2, 12, 4, 9
    rng = np.random.default_rng(3)
    q, k, v = (rng.normal(size=(b, h, n, d)).astype(np.float32) for _ in range(3))
    c2p, p2c = (rng.normal(size=(b, h, n, r)).astype(np.float32) for _ in range(2))
    bias = rng.normal(size=(h, 2 * n - 1)).astype(np.float32)
    index = rng.integers(0, r, size=2 * n - 1).astype(np.int32)
    key_mask = np.ones((b, n), np.int32)
    key_mask[1, 9:] = 0
    window = 5
    if learned:  # a slope per head times log(keys seen), and each row's ends visible to every query
        global_keys = positions.global_keys(key_mask)
        slopes = jnp.asarray([0.3, 0.9])[None, :, None, None]
        temperature = positions.log_keys(positions.visible_keys(key_mask, window, with_ends=True)) * slopes
    else:
        global_keys, temperature = None, length_temperature(key_mask, window, 4)
    terms = ScoreTerms(q=jnp.asarray(q), k=jnp.asarray(k), c2p=jnp.asarray(c2p), p2c=jnp.asarray(p2c),
                       bias=jnp.asarray(bias), temperature=temperature, relative=RelativeIndex(index), key_len=n,
                       window=window, global_keys=global_keys)
    run = dense_attention if kernel == "dense" else (lambda *a: blockwise_attention(*a, block_size=5))
    expected = naive_attention(q, k, v, c2p, p2c, index, bias, temperature, window, key_mask,
                               np.zeros((b, 1, n), bool) if global_keys is None else np.asarray(global_keys))
    np.testing.assert_allclose(np.asarray(run(terms, jnp.asarray(v), jnp.asarray(key_mask))), expected, atol=2e-5)


def test_blockwise_gradients_match_dense_with_temperature_and_window():
    model = build("deberta")
    ids, mask = batch(3 * TRAIN_LEN, pad=5)

    def loss(m):
        return jnp.sum(m.encode(ids, mask) ** 2)

    options = dict(attention_temperature="log_length", attention_window=TRAIN_LEN)
    # Jitted: the same gradients, one compile each instead of op-by-op dispatch of every block's scan.
    dense_grads = nnx.jit(nnx.grad(loss))(with_options(model, **options))
    block_grads = nnx.jit(nnx.grad(loss))(with_options(model, **options, attention_kernel="blockwise",
                                                      attention_block_size=8))
    for a, g in zip(jax.tree.leaves(dense_grads), jax.tree.leaves(block_grads)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(a), rtol=2e-4, atol=2e-5)


# --------------------------------------------------------------------------- models: unchanged up to L, changed past it
OPTIONS = {
    "log_length": dict(attention_temperature="log_length"),
    "window": dict(attention_window=TRAIN_LEN),
    "window_global": dict(attention_window=TRAIN_LEN, window_global_tokens=True),
    "interpolate": dict(relative_position_policy="interpolate"),
}


def _applies(scheme, option):
    if option == "interpolate":
        return SCHEMES[scheme]["attention"] != "entangled"
    # The global tokens only add keys to the plain window's mask, which every scheme meets above; two suffice.
    return option != "window_global" or scheme in ("deberta", "rope")


@pytest.mark.parametrize("scheme, option", [(scheme, option) for option in OPTIONS for scheme in SCHEMES
                                            if _applies(scheme, option)])
def test_every_option_leaves_the_training_length_unchanged_and_acts_past_it(scheme, option):
    model = build(scheme)
    changed = with_options(model, **OPTIONS[option])
    for n in (TRAIN_LEN, TRAIN_LEN // 2):  # full rows of L tokens, and shorter ones
        np.testing.assert_array_equal(encode(changed, n), encode(model, n))
    long, expected = encode(changed, 4 * TRAIN_LEN), encode(model, 4 * TRAIN_LEN)
    assert np.isfinite(long).all()
    assert np.abs(long - expected).max() > 1e-3


@pytest.mark.parametrize("temperature", ["none", "log_length"])
def test_a_window_with_global_tokens_sees_the_ends_the_window_leaves_out(temperature):
    """One key past the window, each query's window leaves out exactly one end of the row (windows start at 0 or
    1), so the window with its global tokens sees every key, as the model without a window does, and the window
    alone does not; the log-length temperature then counts every key too."""
    model = with_options(build("deberta"), attention_temperature=temperature)
    n = TRAIN_LEN + 1
    full = encode(model, n)
    np.testing.assert_allclose(encode(with_options(model, **OPTIONS["window_global"]), n), full, rtol=1e-5, atol=1e-5)
    assert np.abs(encode(with_options(model, **OPTIONS["window"]), n) - full).max() > 1e-3


def test_log_length_scales_scores_by_the_log_ratio_in_an_entangled_model():
    """With no position term or bias, scaling every score by t equals scaling the queries by t."""
    model = build("bert")
    attention = model.encoder.layers[0].attention
    x = jax.random.normal(jax.random.key(0), (1, 4 * TRAIN_LEN, 32))
    key_mask = np.ones((1, 4 * TRAIN_LEN), np.int32)
    cfg = ModelConfig(**dict(SCHEMES["bert"], attention_temperature="log_length"))
    ctx = MaskedLM(cfg, rngs=nnx.Rngs(0)).encoder.position_context(1, 4 * TRAIN_LEN, key_mask=key_mask)
    np.testing.assert_allclose(np.asarray(ctx.temperature), math.log(4 * TRAIN_LEN) / math.log(TRAIN_LEN), rtol=1e-6)
    scaled = with_options(model, attention_temperature="log_length").encoder.layers[0].attention
    out = scaled(x, key_mask, ctx)
    by_hand = nnx.clone(attention)
    factor = math.log(4 * TRAIN_LEN) / math.log(TRAIN_LEN)
    by_hand.query_proj.kernel[...] = attention.query_proj.kernel[...] * factor
    by_hand.query_proj.bias[...] = attention.query_proj.bias[...] * factor
    plain = model.encoder.position_context(1, 4 * TRAIN_LEN)
    np.testing.assert_allclose(np.asarray(out), np.asarray(by_hand(x, key_mask, plain)), rtol=1e-5, atol=1e-6)


def test_rope_interpolation_rotates_by_the_scaled_positions():
    model = build("rope")
    n = 4 * TRAIN_LEN
    x = jax.random.normal(jax.random.key(0), (1, n, 32))
    key_mask = np.ones((1, n), np.int32)
    ctx = model.encoder.position_context(1, n)
    interpolated = with_options(model, relative_position_policy="interpolate").encoder.layers[0].attention
    by_hand = dataclasses.replace(ctx, position_ids=np.arange(n, dtype=np.float32)[None] * TRAIN_LEN / n)
    plain = model.encoder.layers[0].attention
    np.testing.assert_allclose(np.asarray(interpolated(x, key_mask, ctx)), np.asarray(plain(x, key_mask, by_hand)),
                               rtol=1e-5, atol=1e-6)
    assert not np.allclose(np.asarray(plain(x, key_mask, ctx)), np.asarray(plain(x, key_mask, by_hand)), atol=1e-3)


# --------------------------------------------------------------------------- validation and the study's methods
@pytest.mark.parametrize("fields, name", [
    (dict(attention="entangled", relative_position_policy="interpolate"), "relative_position_policy"),
    (dict(attention_window=1), "attention_window"),
    (dict(attention_temperature="cubic"), "attention_temperature"),
    (dict(window_global_tokens=True), "window_global_tokens"),
])
def test_bad_length_options_are_refused_naming_the_field(fields, name):
    with pytest.raises(ConfigError, match=f"model.{name}="):
        ModelConfig(**dict(SCHEMES["deberta"], **fields))


def test_the_study_scores_each_method_that_applies_as_its_own_model():
    models = [length_study.EvalModel(name, 0, name, build(name), None, TRAIN_LEN) for name in ("deberta", "bert")]
    labels = [em.label for em in length_study.with_methods(models, tuple(length_study.LENGTH_METHODS))]
    assert labels == ["deberta", "bert", "deberta+log_length", "deberta+window", "deberta+window_global",
                      "deberta+interpolate_distances", "bert+log_length", "bert+window", "bert+window_global"]
    with pytest.raises(ValueError, match="unknown length method"):
        length_study.StudySettings(methods=("stretch",))


def test_a_method_never_replaces_what_the_model_was_trained_with():
    """A window of L over a model trained with a window of 4 would be another model even at 1x."""
    windowed = MaskedLM(ModelConfig(**dict(SCHEMES["deberta"], attention_window=4)), rngs=nnx.Rngs(0))
    models = [length_study.EvalModel("local", 0, "local", windowed, None, TRAIN_LEN)]
    with pytest.raises(ValueError, match=r"methods: local was trained with attention_window=4, which the length "
                                         r"method 'window' would replace with 16, changing the model even at its"):
        length_study.with_methods(models, ("window",))
    assert [em.label for em in length_study.with_methods(models, ("log_length",))] == ["local", "local+log_length"]


# --------------------------------------------------------------------------- the learned temperature
def learned(scheme="deberta", kind="learned"):
    model = build(scheme)  # noisy parameters; then the learned model shares them and adds its slopes
    cfg = ModelConfig(**dict(SCHEMES[scheme], attention_temperature=kind))
    out = MaskedLM(cfg, rngs=nnx.Rngs(0))
    nnx.update(out, nnx.state(model))
    return model, out


def test_a_fresh_learned_temperature_is_the_identity_at_the_training_length():
    model, scaled = learned()
    slopes = [layer.attention.temperature_slope[...] for layer in scaled.encoder.layers]
    np.testing.assert_allclose(np.asarray(slopes), 1 / math.log(TRAIN_LEN), rtol=1e-7)
    np.testing.assert_allclose(encode(scaled, TRAIN_LEN), encode(model, TRAIN_LEN), atol=2e-6)
    # Below L the factor falls under 1 (no floor), past it above: both change the model.
    for n in (TRAIN_LEN // 2, 4 * TRAIN_LEN):
        assert np.abs(encode(scaled, n) - encode(model, n)).max() > 1e-3


def test_the_learned_slope_scales_each_heads_scores_by_log_keys():
    """With no position term, head h's factor s_h log(n) equals scaling head h's queries by it."""
    model, scaled = learned("bert")
    n = 3 * TRAIN_LEN
    attention = scaled.encoder.layers[0].attention
    attention.temperature_slope[...] = jnp.asarray([0.2, 0.5, 0.9, 1.4])
    x = jax.random.normal(jax.random.key(0), (1, n, 32))
    key_mask = np.ones((1, n), np.int32)
    ctx = scaled.encoder.position_context(1, n, key_mask=key_mask)
    by_hand = nnx.clone(model.encoder.layers[0].attention)
    factor = np.repeat(np.asarray(attention.temperature_slope[...]) * math.log(n), 32 // 4)
    by_hand.query_proj.kernel[...] = by_hand.query_proj.kernel[...] * factor
    by_hand.query_proj.bias[...] = by_hand.query_proj.bias[...] * factor
    np.testing.assert_allclose(np.asarray(attention(x, key_mask, ctx)),
                               np.asarray(by_hand(x, key_mask, model.encoder.position_context(1, n))),
                               rtol=1e-5, atol=1e-6)


def test_the_learned_slope_gets_its_gradient_in_every_kernel():
    _, scaled = learned()
    ids, mask = batch(3 * TRAIN_LEN, pad=5)
    # A random readout: a sum of squares of LayerNorm outputs would hardly move with anything.
    readout = jax.random.normal(jax.random.key(2), (*ids.shape, 32))

    def loss(m):
        return jnp.sum(m.encode(ids, mask) * readout)

    grads = {kernel: nnx.jit(nnx.grad(loss))(with_options(scaled, attention_kernel=kernel, attention_block_size=8))
             for kernel in ("dense", "blockwise")}

    def slopes(g):
        return np.asarray([g.encoder.layers[i].attention.temperature_slope[...] for i in range(len(g.encoder.layers))])

    slope = slopes(grads["dense"])
    assert np.abs(slope).min() > 0
    np.testing.assert_allclose(slopes(grads["blockwise"]), slope, rtol=2e-4, atol=1e-4)
    # And it is the derivative: a central difference along the first layer's slopes agrees.
    eps = 1e-2

    def moved(sign):
        m = nnx.clone(scaled)
        m.encoder.layers[0].attention.temperature_slope[...] += sign * eps
        return float(loss(m))
    predicted = eps * slope[0].sum()
    assert abs((moved(1) - moved(-1)) / 2 - predicted) < 0.02 * abs(predicted)


def test_a_fresh_learned_rate_is_the_log_length_temperature_without_its_floor():
    model, rate = learned(kind="learned_rate")
    np.testing.assert_allclose(encode(rate, TRAIN_LEN), encode(model, TRAIN_LEN), atol=2e-6)
    fixed = with_options(model, attention_temperature="log_length")
    np.testing.assert_allclose(encode(rate, 4 * TRAIN_LEN), encode(fixed, 4 * TRAIN_LEN), atol=2e-5)
    assert np.abs(encode(rate, TRAIN_LEN // 2) - encode(model, TRAIN_LEN // 2)).max() > 1e-3  # below L: under 1


def test_the_learned_rate_is_trained_only_by_rows_whose_key_count_is_not_the_training_length():
    """Its factor is 1 at L keys whatever the rate, so full rows of L give it no gradient (Scalable-Softmax's slope
    gets one from them all the same, as a scale the projections could carry), and rows of other lengths do."""
    readout = jax.random.normal(jax.random.key(2), (2, TRAIN_LEN, 32))

    ids = batch(TRAIN_LEN)[0]

    @nnx.jit
    def rate_gradients(model, mask):
        grads = nnx.grad(lambda m: jnp.sum(m.encode(ids, mask) * readout))(model)
        layers = grads.encoder.layers
        return jnp.stack([layers[i].attention.temperature_slope[...] for i in range(len(layers))])

    full, cut = batch(TRAIN_LEN)[1], batch(TRAIN_LEN, pad=5)[1]
    _, rate = learned(kind="learned_rate")
    on_cut = np.abs(rate_gradients(rate, cut)).max()
    assert on_cut > 1e-3 and np.abs(rate_gradients(rate, full)).max() < 1e-4 * on_cut
    _, slope = learned()
    assert np.abs(rate_gradients(slope, full)).min() > 1e-3 * on_cut


def test_the_learned_temperature_is_a_model_not_an_option():
    _, scaled = learned()
    with pytest.raises(ConfigError, match="cannot change from 'learned' to 'log_length'"):
        with_options(scaled, attention_temperature="log_length")
    with pytest.raises(ConfigError, match="cannot change from 'none' to 'learned'"):
        with_options(build("deberta"), attention_temperature="learned")
    with pytest.raises(ConfigError, match="cannot change from 'learned' to 'learned_rate'"):
        with_options(scaled, attention_temperature="learned_rate")
    # The study's log-length method does not apply to it (it already scales by log(keys)); the window does.
    models = [length_study.EvalModel("ssmax", 0, "ssmax", scaled, None, TRAIN_LEN)]
    assert [em.label for em in length_study.with_methods(models, ("log_length", "window"))] == ["ssmax", "ssmax+window"]
