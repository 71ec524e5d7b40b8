"""Model behaviour: padding invariance, long sequences, EMD, precision and input validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.model.config import OPTION_FIELDS, ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM, with_options
from deberta_jax.model.positions import PositionRangeError
from tests.helpers import assert_padding_invariant

BASE = dict(vocab_size=60, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, max_position_embeddings=32)
VARIANTS = {
    "bert": dict(BASE, attention="entangled", position_biased_input=True, layer_norm_eps=1e-12),
    "deberta": dict(BASE, position_buckets=8, max_relative_positions=16),
    "deberta_emd": dict(BASE, position_buckets=8, max_relative_positions=16, use_emd=True),
    "deberta_no_buckets_separate": dict(BASE, position_buckets=0, max_relative_positions=8, share_att_key=False),
    "bert_pre_ln": dict(BASE, attention="entangled", position_biased_input=True, layer_norm_placement="pre"),
    "deberta_emd_pre_ln": dict(BASE, position_buckets=8, max_relative_positions=16, use_emd=True,
                               layer_norm_placement="pre"),
}


def build(name, **kw):
    return MaskedLM(ModelConfig(**dict(VARIANTS[name], **kw)), rngs=nnx.Rngs(0))


def ids(b, n, seed=0):
    return np.random.default_rng(seed).integers(5, 60, size=(b, n)).astype(np.int32)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_appending_padding_does_not_change_real_tokens(name):
    assert_padding_invariant(build(name), ids(2, 12))


@pytest.mark.parametrize("clamp", [True, False])
def test_disentangled_runs_far_beyond_max_relative_positions(clamp):
    model = build("deberta", clamp_relative_positions=clamp, max_position_embeddings=16)
    out = model.mlm_logits(ids(1, 100), np.ones((1, 100), np.int32))
    assert out.shape == (1, 100, 60) and np.isfinite(np.asarray(out)).all()


def test_absolute_table_beyond_training_length_follows_policy():
    model = build("bert", trained_length=16)
    x = ids(1, 24)
    with pytest.raises(PositionRangeError, match="policy"):
        model.mlm_logits(x)
    for policy in ("untrained", "clip", "interpolate"):
        out = with_options(model, absolute_position_policy=policy)(x)
        assert np.isfinite(np.asarray(out)).all()
    with pytest.raises(PositionRangeError, match="table"):
        with_options(model, absolute_position_policy="untrained")(ids(1, 40))
    assert np.isfinite(np.asarray(with_options(model, absolute_position_policy="clip")(ids(1, 40)))).all()


def test_with_options_shares_parameters_and_refuses_changing_them():
    model = build("bert", trained_length=16)
    clipped = with_options(model, absolute_position_policy="clip", attention_kernel="blockwise")
    assert clipped.cfg.absolute_position_policy == "clip" and model.cfg.absolute_position_policy == "strict"
    assert clipped.embeddings.word_embeddings is model.embeddings.word_embeddings
    np.testing.assert_allclose(clipped.mlm_logits(ids(1, 12)), model.mlm_logits(ids(1, 12)), atol=1e-5)
    with pytest.raises(ConfigError, match=r"\['hidden_size', 'num_heads'\] cannot be changed on a trained model"):
        with_options(model, hidden_size=64, num_heads=4)


# A value other than the default for every field a trained model may be run under.
OTHER_OPTION_VALUES = dict(attention_kernel="blockwise", attention_block_size=8, remat="full", scan_layers=True,
                           relative_terms="shift", absolute_position_policy="clip", clamp_relative_positions=False,
                           attention_temperature="log_length", attention_window=8, window_global_tokens=True,
                           relative_position_policy="interpolate")
# Options that only mean something together with another one.
NEEDS = dict(window_global_tokens=dict(attention_window=8))


def test_every_option_field_leaves_the_parameters_as_they_are():
    assert set(OTHER_OPTION_VALUES) == set(OPTION_FIELDS)
    for scheme in ("bert", "deberta_emd"):
        base = build(scheme, trained_length=16)
        for field, value in OTHER_OPTION_VALUES.items():
            if field == "relative_position_policy" and base.cfg.attention == "entangled":
                continue
            other = MaskedLM(base.cfg.with_options(**{field: value}, **NEEDS.get(field, {})), rngs=nnx.Rngs(0))
            shapes = lambda m: jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(nnx.state(m)))  # noqa: E731
            assert shapes(other) == shapes(base), (scheme, field)


def test_emd_changes_outputs_and_uses_the_absolute_table():
    plain, emd = build("deberta"), build("deberta_emd")
    assert plain.embeddings.position_embeddings is None
    assert emd.embeddings.position_embeddings is not None
    x = ids(1, 10)
    # Same seed, same parameters apart from the extra table, different head input.
    assert not np.allclose(plain.mlm_logits(x), emd.mlm_logits(x))
    with pytest.raises(PositionRangeError):
        build("deberta_emd", trained_length=16).mlm_logits(ids(1, 20))


def test_pre_layer_norm_normalizes_sublayer_inputs_and_the_output():
    """x + attention(norm(x)), then + mlp(norm(.)), and one final norm before the head: composed by hand."""
    model = build("bert_pre_ln")
    # Non-trivial norm parameters, so a norm applied in the wrong place or skipped changes the logits.
    rng = np.random.default_rng(1)
    layer_norms = [n for layer in model.encoder.layers for n in (layer.attention_norm, layer.output_norm)]
    for norm in [model.final_norm] + layer_norms:
        norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
        norm.bias[...] = jnp.asarray(rng.normal(0, 0.3, norm.bias.shape), jnp.float32)
    x, mask = ids(2, 12), np.ones((2, 12), np.int32)
    ctx = model.encoder.position_context(2, 12)
    h = model.embeddings(jnp.asarray(x), jnp.asarray(mask), jnp.zeros_like(x), ctx, None)
    for layer in model.encoder.layers:
        h = h + layer.attention_out(layer.attention(layer.attention_norm(h), jnp.asarray(mask), ctx))
        h = h + layer.output(jax.nn.gelu(layer.intermediate(layer.output_norm(h)), approximate=False))
    np.testing.assert_allclose(model.mlm_logits(x, mask), model.head(model.final_norm(h)), atol=2e-5)
    assert build("bert").final_norm is None  # post-LN (the default) keeps the published parameter tree


@pytest.mark.slow
def test_dropout_only_with_rngs_and_gradients_finite():
    model = build("deberta")
    x = ids(2, 10)

    @nnx.jit  # one compile instead of dispatching every op of three forwards
    def forwards(m):
        return m(x), m(x), m(x, rngs=nnx.Rngs(dropout=1))

    plain, again, dropped = forwards(model)
    np.testing.assert_array_equal(plain, again)
    assert not np.allclose(dropped, plain)

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(x, rngs=nnx.Rngs(dropout=0)))[..., 7])

    grads = nnx.jit(nnx.grad(loss))(model)
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert all(np.isfinite(np.asarray(g)).all() for g in leaves)


@pytest.mark.parametrize("name", ["bert", "deberta"])
def test_bfloat16_compute_is_close_to_float32(name):
    f32 = build(name)
    bf16 = build(name, dtype="bfloat16")
    x = ids(2, 16)
    a, b = f32.mlm_logits(x), bf16.mlm_logits(x)
    assert b.dtype == jnp.float32
    assert float(jnp.abs(a - b).max()) < 0.1
    assert jax.tree.leaves(nnx.state(bf16, nnx.Param))[0].dtype == jnp.float32


def test_bad_inputs_name_the_argument():
    model = build("deberta")
    x = ids(2, 8)
    with pytest.raises(TypeError, match="input_ids must be an integer"):
        model.mlm_logits(x.astype(np.float32))
    with pytest.raises(ValueError, match=r"input_ids\[None\]"):
        model.mlm_logits(x[0])
    with pytest.raises(ValueError, match="attention_mask must have the shape"):
        model.mlm_logits(x, np.ones((2, 9), np.int32))
    with pytest.raises(TypeError, match="attention_mask must be int or bool"):
        model.mlm_logits(x, np.ones((2, 8), np.float32))
    with pytest.raises(ValueError, match="vocab_size=60"):
        model.mlm_logits(x + 100)
    with pytest.raises(ValueError, match="only 0"):
        model.mlm_logits(x, np.full((2, 8), 2, np.int32))


@pytest.mark.parametrize("field,value,fix", [
    ("num_heads", 5, "must divide hidden_size"),
    ("pos_att_type", ("c2p", "p2p"), "subset of"),
    ("attention", "sparse", "choose one of"),
    ("absolute_position_policy", "wrap", "choose one of"),
    ("norm_rel_ebd", "rms", "choose one of"),
    ("dtype", "float16", "choose one of"),
    ("layer_norm_placement", "sandwich", "choose one of"),
])
def test_bad_config_names_field_and_fix(field, value, fix):
    with pytest.raises(ConfigError, match=rf"model\.{field}=.*{fix}"):
        ModelConfig(**dict(VARIANTS["deberta"], **{field: value}))


def test_pos_att_type_spellings_are_equivalent():
    a = ModelConfig(**dict(VARIANTS["deberta"], pos_att_type="p2c|c2p"))
    b = ModelConfig(**dict(VARIANTS["deberta"], pos_att_type=["c2p", "p2c"]))
    assert a == b and a.pos_att_type == ("c2p", "p2c")
    with pytest.raises(ConfigError, match="unknown model field"):
        ModelConfig.from_dict(dict(dataclasses.asdict(a), heads=3))


def test_relative_embeddings_get_dropout_in_training():
    """DeBERTa drops out the relative table's rows before projecting them (the reference's `pos_dropout`): with a
    dropout stream the position keys differ from draw to draw and from the deterministic ones."""
    cfg = ModelConfig(vocab_size=40, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
                      hidden_dropout=0.3, attention_dropout=0.0, position_buckets=4, max_relative_positions=8)
    model = MaskedLM(cfg, rngs=nnx.Rngs(params=0))
    ctx = model.encoder.position_context(1, 10)
    attention = model.encoder.layers[0].attention
    plain = attention._relative_projections(ctx, None)[1]
    first, second = (attention._relative_projections(ctx, nnx.Rngs(dropout=s))[1] for s in (1, 2))
    assert not np.allclose(first, plain) and not np.allclose(first, second)
    np.testing.assert_allclose(attention._relative_projections(ctx, None)[1], plain)
