"""`model.flops.model_flops`, the count MFU divides by: a hand count for tiny configs, and training at exactly three
forwards (the backward pass is two: one product for the inputs' gradient and one for the weights')."""

import pytest

from deberta_jax.model.config import ModelConfig
from deberta_jax.model.flops import model_flops

TINY = dict(vocab_size=32, hidden_size=8, num_layers=2, num_heads=2, intermediate_size=16, max_position_embeddings=8)
ROWS, N, PREDICTED = 2, 4, 3


def hand_count(h, i, v, layers, position_terms=0, reachable_rows=0, keys=N):
    """2 FLOPs per multiply-add, per layer: q/k/v/out projections (4 N h^2 per row), the MLP (2 N h i), scores and
    context (2 N K h, K the keys each query sees); per position term, every query against the reachable rows
    (N R h per row) and those rows' projection (R h^2, once); the head's dense transform and tied decoder at the
    predicted positions."""
    per_layer = ROWS * 2 * (4 * N * h * h + 2 * N * h * i + 2 * N * keys * h)
    per_layer += position_terms * 2 * (ROWS * N * reachable_rows * h + reachable_rows * h * h)
    return layers * per_layer + 2 * PREDICTED * (h * h + h * v)


@pytest.mark.parametrize("changes,expected", [
    # BERT-style attention: no position terms.
    (dict(attention="entangled", pos_att_type=()), hand_count(8, 16, 32, 2)),
    # DeBERTa, exact distances: 4 tokens reach the 7 rows of distances -3..3, through c2p and p2c.
    (dict(position_buckets=0, max_relative_positions=8), hand_count(8, 16, 32, 2, 2, 7)),
    # EMD runs the last layer emd_layers times: 1 + 3 layers.
    (dict(position_buckets=0, max_relative_positions=8, use_emd=True, emd_layers=3), hand_count(8, 16, 32, 4, 2, 7)),
    # A window of 2: each query's scores and context over 2 keys, not 4 (the pairs a windowed kernel computes).
    (dict(attention="entangled", pos_att_type=(), attention_window=2), hand_count(8, 16, 32, 2, keys=2)),
])
def test_forward_flops_match_a_hand_count(changes, expected):
    cfg = ModelConfig(**TINY, **changes)
    assert model_flops(cfg, ROWS, N, PREDICTED, train=False) == expected


def test_a_training_step_is_exactly_three_forwards():
    cfg = ModelConfig(**TINY, position_buckets=0, max_relative_positions=8)
    forward = model_flops(cfg, ROWS, N, PREDICTED, train=False)
    assert forward == 27520  # = hand_count(8, 16, 32, 2, 2, 7), written out
    assert model_flops(cfg, ROWS, N, PREDICTED, train=True) == 3 * forward == 82560
