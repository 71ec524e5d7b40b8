"""Reading out a learned attention temperature: each layer's slopes in order, and the factor they put on the scores."""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.study import temperatures

CONFIG = dict(vocab_size=64, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64, trained_length=16,
              max_position_embeddings=64, position_buckets=8, max_relative_positions=16)


def test_slopes_come_per_layer_and_head_and_the_table_gives_their_factors():
    model = MaskedLM(ModelConfig(**CONFIG, attention_temperature="learned"), rngs=nnx.Rngs(0))
    chosen = np.asarray([[0.1, 0.2, 0.3, 0.4], [0.05, 0.05, 0.05, 0.05], [0.5, 0.25, 0.125, 1.0]], np.float32)
    for layer, values in zip(model.encoder.layers, chosen):
        layer.attention.temperature_slope[...] = jnp.asarray(values)
    read = temperatures.slopes(model)
    np.testing.assert_array_equal(read, chosen)
    rows = temperatures.table({"run": model}, [16, 2048]).splitlines()
    assert len(rows) == 2 + 3 and rows[0].endswith("| factor at 16 keys | factor at 2048 keys |")
    last = chosen[2] * math.log(2048)
    assert rows[4] == (f"| run | learned | 2 | 0.5000, 0.2500, 0.1250, 1.0000 | {chosen[2].mean() * math.log(16):.2f} "
                       f"({0.125 * math.log(16):.2f}-{math.log(16):.2f}) | {last.mean():.2f} ({last.min():.2f}-"
                       f"{last.max():.2f}) |")


def test_the_rate_form_is_one_at_the_training_length_whatever_it_learned():
    model = MaskedLM(ModelConfig(**CONFIG, attention_temperature="learned_rate"), rngs=nnx.Rngs(0))
    model.encoder.layers[1].attention.temperature_slope[...] = jnp.asarray([0.0, 0.1, 0.5, 2.0])
    rows = temperatures.table({"run": model}, [16, 64]).splitlines()
    rate = 1 + np.asarray([0.0, 0.1, 0.5, 2.0]) * math.log(64 / 16)
    assert rows[3] == (f"| run | learned_rate | 1 | 0.0000, 0.1000, 0.5000, 2.0000 | 1.00 (1.00-1.00) | "
                       f"{rate.mean():.2f} ({rate.min():.2f}-{rate.max():.2f}) |")


def test_a_model_without_a_learned_temperature_is_refused():
    model = MaskedLM(ModelConfig(**CONFIG, attention_temperature="log_length"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="attention_temperature='log_length': no learned temperature to read"):
        temperatures.slopes(model)
