"""Relative-position bucketing and indexing, and the absolute-table policies past the training length."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers.models.deberta_v2 import modeling_deberta_v2 as ref

from deberta_jax.model import positions
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM


def test_log_buckets_match_hand_computed_values():
    # buckets=8 -> mid=4: exact up to 4, then ceil(log(r/4) / log(15/4) * 3) + 4.
    rel = np.arange(17)
    expected = [0, 1, 2, 3, 4, 5, 5, 6, 6, 6, 7, 7, 7, 7, 7, 7, 8]
    np.testing.assert_array_equal(positions.log_bucket_position(rel, 8, 16), expected)
    np.testing.assert_array_equal(positions.log_bucket_position(-rel, 8, 16), -np.asarray(expected))


@pytest.mark.parametrize("buckets,max_rel,n", [(256, 512, 700), (16, 32, 90), (0, 16, 40), (64, 128, 300), (6, 50, 64)])
def test_unclamped_index_equals_transformers_bit_for_bit(buckets, max_rel, n):
    x = torch.zeros(1, n, 4)
    rel = ref.build_relative_position(x, x, bucket_size=buckets if buckets else -1, max_position=max_rel)[0].numpy()
    span = buckets if buckets > 0 else max_rel
    expected = np.clip(rel + span, 0, 2 * span - 1)
    got = positions.relative_index(n, n, position_buckets=buckets, max_relative_positions=max_rel, clamp=False)
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("buckets,max_rel", [(256, 512), (0, 16), (16, 32)])
def test_clamped_index_never_leaves_the_trained_rows(buckets, max_rel):
    span = buckets if buckets > 0 else max_rel
    n = 4 * max_rel
    idx = positions.relative_index(n, n, position_buckets=buckets, max_relative_positions=max_rel, clamp=True)
    # Distances up to max_rel - 1 reach rows [1, 2k-1]; longer ones must reuse the outermost of those.
    assert idx.min() == 1 and idx.max() == 2 * span - 1
    inside = positions.relative_index(max_rel, max_rel, position_buckets=buckets, max_relative_positions=max_rel)
    np.testing.assert_array_equal(idx[:max_rel, :max_rel], inside)
    unclamped = positions.relative_index(n, n, position_buckets=buckets, max_relative_positions=max_rel, clamp=False)
    assert unclamped.min() == 0  # transformers reads the untrained row 0 at j - i >= max_rel


def test_index_is_toeplitz_and_antisymmetric():
    idx = positions.relative_index(50, 50, position_buckets=16, max_relative_positions=40)
    assert (np.diag(idx) == 16).all()
    np.testing.assert_array_equal(idx + idx.T, 32)
    np.testing.assert_array_equal(idx[1:, 1:], idx[:-1, :-1])


def test_rows_used_shrink_for_short_sequences():
    lo, hi = positions.relative_rows_used(8, 8, position_buckets=256, max_relative_positions=512)
    assert (lo, hi) == (256 - 7, 256 + 8)


TABLE = jnp.arange(10 * 3, dtype=jnp.float32).reshape(10, 3)  # 10 rows, trained on 6 positions


def test_within_training_length_every_policy_returns_the_rows():
    for policy in ("strict", "untrained", "clip", "interpolate"):
        np.testing.assert_array_equal(positions.absolute_position_embeddings(TABLE, 6, 6, policy), TABLE[:6])


def test_strict_raises_past_training_length():
    with pytest.raises(positions.PositionRangeError, match="clip"):
        positions.absolute_position_embeddings(TABLE, 7, 6, "strict")


def test_untrained_reads_allocated_rows_and_errors_past_the_table():
    np.testing.assert_array_equal(positions.absolute_position_embeddings(TABLE, 9, 6, "untrained"), TABLE[:9])
    with pytest.raises(positions.PositionRangeError, match="max_position_embeddings"):
        positions.absolute_position_embeddings(TABLE, 11, 6, "untrained")


def test_clip_repeats_last_trained_row_even_past_the_table():
    out = positions.absolute_position_embeddings(TABLE, 20, 6, "clip")
    np.testing.assert_array_equal(out[:6], TABLE[:6])
    np.testing.assert_array_equal(out[6:], np.broadcast_to(TABLE[5], (14, 3)))


def test_interpolate_stretches_trained_rows():
    out = np.asarray(positions.absolute_position_embeddings(TABLE, 11, 6, "interpolate"))
    np.testing.assert_allclose(out[0], TABLE[0])
    np.testing.assert_allclose(out[-1], TABLE[5])
    np.testing.assert_allclose(out[2], TABLE[1], atol=1e-6)  # position 2 of 11 -> row 1.0 of 6
    np.testing.assert_allclose(out[1], (TABLE[0] + TABLE[1]) / 2, atol=1e-6)
    assert np.isfinite(out).all()


def test_the_model_reads_interpolated_rows_at_the_stretched_positions():
    """Through the model (the policy reaching `Embeddings`): at 2T - 1 positions, every even one reads a trained
    row exactly, p = 2m -> row m, and the last reads the last trained row."""
    cfg = ModelConfig(vocab_size=20, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=16,
                      attention="entangled", position_biased_input=True, pos_att_type=(), max_position_embeddings=16,
                      trained_length=6, absolute_position_policy="interpolate")
    model = MaskedLM(cfg, rngs=nnx.Rngs(params=0))
    rows = np.asarray(model.embeddings.absolute(model.encoder.position_context(1, 11))[0])
    table = np.asarray(model.embeddings.position_embeddings[...])
    np.testing.assert_allclose(rows[::2], table[:6], atol=1e-6)
    np.testing.assert_allclose(rows[1], (table[0] + table[1]) / 2, atol=1e-6)


# Distances -11..11 of a 12-token sequence interpolated to a training length of 4 (scale 1/3), rounded to the
# nearest integer by hand: k/3 is never a tie, and truncation (towards zero) or flooring differs at two of every three.
THIRDS = [-4, -3, -3, -3, -2, -2, -2, -1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]


def test_interpolated_distances_are_rounded_to_the_nearest_integer():
    cfg = ModelConfig(relative_position_policy="interpolate", trained_length=4, max_position_embeddings=16)
    scale = cfg.distance_scale(12)
    assert scale == pytest.approx(1 / 3)
    np.testing.assert_array_equal(positions.scaled_distances(12, 12, scale), THIRDS)
    # The relative-table row of each distance (exact distances: row = distance + max_relative_positions) ...
    index = positions.relative_index_by_distance(12, 12, position_buckets=0, max_relative_positions=8, scale=scale)
    np.testing.assert_array_equal(index, np.asarray(THIRDS) + 8)
    # ... and T5's bucket of each (8 buckets: distances below 2 each their own bucket, then log-spaced).
    table = jnp.arange(8, dtype=jnp.float32)[:, None]  # bucket b holds b: the bias is the bucket
    bias = np.asarray(positions.t5_bias(table, 12, 12, max_distance=16, scale=scale))[0]
    np.testing.assert_array_equal(bias, positions.t5_relative_bucket(np.asarray(THIRDS), 8, 16))
    assert len(set(bias[:11])) > 1  # the left-hand distances land in more than one bucket: the test can tell
