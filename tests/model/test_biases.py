"""The bias-scheme registry (`deberta_jax.model.biases`): what registering one entry gives a scheme (a config name as
an attention variant and as a score bias, its parameters on the encoder with their declared weight decay, the
kernels, the docs), what the fused kernels refuse, and each scheme's values by hand."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.kernels import dispatch
from deberta_jax.kernels.dense import dense_attention
from deberta_jax.kernels.pallas_tpu import pallas_tpu_attention
from deberta_jax.kernels.scores import ScoreTerms
from deberta_jax.model import biases
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.train import optim
from tests.helpers import bias_params
from tests.kernels.test_kernels import assert_trees_close, outputs_and_grads

BASE = dict(vocab_size=60, hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64,
            max_position_embeddings=64, trained_length=16, position_buckets=8, max_relative_positions=16)
MODELS_DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def test_kerple_log_values_by_hand():
    """`-r1_h * log(1 + r2_h * |i - j|)` per distance, with r = softplus(parameter), at distances -3..3."""
    cfg = ModelConfig(**dict(BASE, attention="kerple_log"))
    params = {"kerple_strength": jnp.array([0.0, 1.0, -1.0, 2.0]), "kerple_rate": jnp.array([1.0, 0.0, 0.5, -2.0])}
    got = np.asarray(biases.SCHEMES["kerple_log"].bias(params, cfg, 4, 1.0, np.ones((1, 4))))
    softplus = lambda x: np.log1p(np.exp(x))  # noqa: E731
    distance = np.abs(np.arange(-3, 4))
    want = -softplus(np.asarray(params["kerple_strength"]))[:, None] * np.log1p(
        softplus(np.asarray(params["kerple_rate"]))[:, None] * distance)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    half = np.asarray(biases.SCHEMES["kerple_log"].bias(params, cfg, 4, 0.5, np.ones((1, 4))))
    np.testing.assert_allclose(half[:, 3 + 2], want[:, 3 + 1], rtol=1e-6)  # distance 2 at scale 0.5 reads 1


def test_every_registered_scheme_has_its_line_in_docs_models():
    text = MODELS_DOC.read_text()
    missing = [name for name in biases.SCHEMES if f"`{name}`" not in text]
    assert not missing, f"docs/models.md has no line for the bias scheme(s) {missing}"


@pytest.mark.parametrize("name", sorted(biases.SCHEMES))
def test_a_registered_name_is_an_attention_variant_and_a_score_bias(name):
    fields = dict(t5_num_buckets=8, t5_max_distance=20)
    alone = ModelConfig(**dict(BASE, attention=name, **fields))
    added = ModelConfig(**dict(BASE, attention="disentangled", score_bias=name, **fields))
    assert alone.bias_scheme == added.bias_scheme == name
    model = MaskedLM(added, rngs=nnx.Rngs(0))
    for parameter in biases.parameters_of(added):  # created on the encoder, under the registered name
        assert isinstance(getattr(model.encoder, parameter), nnx.Param)
    ids = np.random.default_rng(0).integers(5, 60, size=(2, 20))
    assert np.isfinite(np.asarray(model.mlm_logits(ids))).all()
    # The bias changes the scores: the same parameters without it give other logits.
    plain = MaskedLM(ModelConfig(**dict(BASE, attention="disentangled")), rngs=nnx.Rngs(0))
    assert not np.allclose(plain.mlm_logits(ids), model.mlm_logits(ids), atol=1e-4)


@pytest.mark.parametrize("changes, field, fix", [
    (dict(score_bias="sandwich"), "score_bias", "choose 'none' or one of"),
    (dict(attention="alibi", score_bias="kerple_log"), "score_bias", "already adds its own bias"),
    (dict(attention="entangled", score_bias="alibi", attention_kernel="cudnn"), "attention_kernel",
     "score_bias='alibi'"),
])
def test_bad_bias_configs_name_the_field_and_the_fix(changes, field, fix):
    with pytest.raises(ConfigError, match=rf"model\.{field}=.*{fix}"):
        ModelConfig(**dict(BASE, **changes))


def _row_scaled_alibi(params, cfg, length, scale, key_mask):
    """A bias with a row axis: ALiBi's, steeper on shorter rows (by the row's real length)."""
    real = jnp.asarray(key_mask, jnp.float32).sum(-1)[:, None, None]
    return biases.SCHEMES["alibi"].bias(params, cfg, length, scale, key_mask)[None] * length / real


@pytest.fixture
def row_scheme(monkeypatch):
    """A scheme registered for one test, with a row axis and a decayed parameter (a per-head gain on its bias)."""
    def bias(params, cfg, length, scale, key_mask):
        return params["row_gain"][None, :, None] * _row_scaled_alibi(params, cfg, length, scale, key_mask)
    gain = biases.Parameter(lambda cfg, key: jnp.ones((cfg.num_heads,)), weight_decay=True)
    monkeypatch.setitem(biases.SCHEMES, "row_alibi", biases.BiasScheme(bias, parameters={"row_gain": gain},
                                                                       per_row=True))
    return "row_alibi"


def test_a_bias_with_a_row_axis_is_carried_by_dense_and_blockwise_and_refused_by_the_fused_kernels(row_scheme):
    cfg = ModelConfig(**dict(BASE, attention=row_scheme))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 4, 21, 8)), jnp.float32) for _ in range(3))
    key_mask = jnp.asarray(np.arange(21)[None] < np.array([[21], [13]]), jnp.int32)
    bias = biases.SCHEMES[row_scheme].bias(bias_params(cfg), cfg, 21, 1.0, key_mask)
    assert bias.shape == (2, 4, 41)
    terms = ScoreTerms(q=q, k=k, key_len=21, bias=bias)
    want = outputs_and_grads(dense_attention, terms, v, key_mask)
    assert_trees_close(outputs_and_grads(dispatch.attention_kernel("blockwise", 8), terms, v, key_mask), want, 1e-5)
    # The rows differ: row 1's bias is steeper than row 0's.
    assert not np.allclose(bias[0], bias[1])
    for kernel in ("pallas", "pallas_tpu"):
        with pytest.raises(ConfigError, match=rf"attention_kernel='{kernel}'.*'{row_scheme}'.*per_row"):
            ModelConfig(**dict(BASE, attention=row_scheme, attention_kernel=kernel))
    with pytest.raises(ValueError, match="one bias per head and distance"):
        pallas_tpu_attention(terms, v, key_mask)


def test_weight_decay_is_what_each_parameter_declares(row_scheme):
    """A scheme's parameter declared decayed is decayed; KERPLE's rates, declared undecayed, are not."""
    decayed = optim.weight_decay_mask(ModelConfig(**dict(BASE, attention=row_scheme)))
    assert decayed["encoder"]["row_gain"] is True
    kerple = optim.weight_decay_mask(ModelConfig(**dict(BASE, attention="disentangled", score_bias="kerple_log")))
    assert kerple["encoder"]["kerple_rate"] is False and kerple["encoder"]["kerple_strength"] is False
    assert kerple["encoder"]["layers"][0]["attention"]["query_proj"]["kernel"] is True


def test_a_parameter_that_declares_no_decay_is_refused_by_name():
    class Undeclared(nnx.Module):
        def __init__(self):
            self.declared = nnx.Param(jnp.zeros(2), weight_decay=False)
            self.rate = nnx.Param(jnp.zeros(2))

    with pytest.raises(ValueError, match=r"\['rate'\] declare no weight decay"):
        optim.declared_decay(nnx.state(Undeclared()))


def test_kerple_gradients_reach_both_rates():
    cfg = ModelConfig(**dict(BASE, attention="disentangled", score_bias="kerple_log", hidden_dropout=0.0,
                             attention_dropout=0.0))
    model = MaskedLM(cfg, rngs=nnx.Rngs(0))
    ids = np.random.default_rng(1).integers(5, 60, size=(2, 16))

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m.mlm_logits(ids))[..., 7])
    grads = nnx.state(nnx.grad(loss)(model), nnx.Param)
    for name in ("kerple_strength", "kerple_rate"):
        g = np.asarray(grads["encoder"][name][...])
        assert g.shape == (4,) and np.all(np.abs(g) > 0), name


def test_the_flop_count_adds_what_a_scheme_declares(monkeypatch):
    from deberta_jax.model.flops import model_flops
    cfg = ModelConfig(**dict(BASE, attention="alibi"))
    before = model_flops(cfg, 2, 16, 4, train=False)
    monkeypatch.setitem(biases.SCHEMES, "alibi", dataclasses.replace(biases.SCHEMES["alibi"],
                                                                     flops=lambda cfg, n: 1000.0 * n))
    assert model_flops(cfg, 2, 16, 4, train=False) == before + 16_000
