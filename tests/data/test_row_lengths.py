"""The training-side length recipes' rows: cut to mixed lengths, and the long phase's schedule."""

import numpy as np
import pytest

from deberta_jax.data import batches, packing, row_lengths
from deberta_jax.data.tokenizer import SpecialIds

SPECIAL = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)
SEQ_LEN, BATCH = 32, 16


@pytest.fixture(scope="module")
def packed():
    stream = np.random.default_rng(0).integers(5, 100, size=SEQ_LEN * 40, dtype=np.int32)
    input_ids, attention_mask = packing.pack_stream(stream, SPECIAL, SEQ_LEN)
    return packing.PackedData(input_ids, attention_mask, np.ones_like(input_ids, dtype=bool))


def masked_batch(packed, min_row_length, step=3, process_index=0, process_count=1):
    masker = batches.Masker(SPECIAL, vocab_size=100, mask_prob=0.3, whole_word_masking=False)
    return batches.train_batch(packed, masker, batch_size=BATCH, step=step, seed=7, process_index=process_index,
                               process_count=process_count, min_row_length=min_row_length)


def test_mixed_rows_end_with_sep_and_predict_nothing_past_their_end(packed):
    batch = masked_batch(packed, min_row_length=10)
    lengths = batch["attention_mask"].sum(axis=1)
    assert lengths.min() >= 10 and lengths.max() <= SEQ_LEN and len(set(lengths)) > 4  # the key counts vary
    for row, length in zip(batch["input_ids"], lengths):
        assert row[0] == SPECIAL.cls and row[length - 1] == SPECIAL.sep and (row[length:] == SPECIAL.pad).all()
    past_end = np.arange(SEQ_LEN)[None, :] >= lengths[:, None]
    assert not batch["weights"][past_end].any() and batch["weights"][~past_end].any()
    full = masked_batch(packed, min_row_length=0)
    kept = ~past_end
    kept[np.arange(BATCH), lengths - 1] = False  # where [SEP] replaced a token
    # Labels hold every position's original token: the kept ones are the full rows' own.
    np.testing.assert_array_equal(np.where(kept, batch["labels"], 0), np.where(kept, full["labels"], 0))


def test_mixed_rows_are_a_function_of_the_step_whatever_the_process_split(packed):
    one = masked_batch(packed, min_row_length=10)
    halves = [masked_batch(packed, 10, process_index=p, process_count=2) for p in range(2)]
    for name in one:
        np.testing.assert_array_equal(one[name], np.concatenate([h[name] for h in halves]))
    np.testing.assert_array_equal(one["input_ids"], masked_batch(packed, min_row_length=10)["input_ids"])
    assert not np.array_equal(one["attention_mask"], masked_batch(packed, 10, step=4)["attention_mask"])


def test_a_padded_last_row_is_not_lengthened(packed):
    stream = np.arange(5, 5 + SEQ_LEN + 5, dtype=np.int32)  # the second row holds 7 tokens, then padding
    input_ids, mask = packing.pack_stream(stream, SPECIAL, SEQ_LEN)
    rows = packing.PackedData(input_ids, mask, np.ones_like(input_ids, dtype=bool))
    cut = row_lengths.cut_short(rows, np.array([20, 20]), SPECIAL)
    assert cut.attention_mask.sum(axis=1).tolist() == [20, mask[1].sum()]
    np.testing.assert_array_equal(cut.input_ids[1], input_ids[1])


def test_the_long_phase_is_the_last_long_steps():
    short, long = row_lengths.Phase(None, 32), row_lengths.Phase(None, 8)
    chosen = [row_lengths.phase_at(step, 10, 3, short, long).batch_size for step in range(10)]
    assert chosen == [32] * 7 + [8] * 3
    assert row_lengths.phase_at(9, 10, 0, short, None) is short
    assert row_lengths.long_batch_size(32, 64, 256) == 8


@pytest.mark.parametrize("long_steps,share,phase", [(4, 0.5, "SLSL"), (4, 0.75, "SLLL"), (4, 0.25, "SSSL"),
                                                     (6, 1 / 3, "SSLSSL"), (5, 1.0, "LLLLL")])
def test_a_shared_long_phase_spreads_its_long_steps_evenly_and_ends_on_one(long_steps, share, phase):
    short, long = row_lengths.Phase(None, 32), row_lengths.Phase(None, 8)
    chosen = "".join("L" if row_lengths.phase_at(step, 10, long_steps, short, long, share) is long else "S"
                     for step in range(10))
    assert chosen == "S" * (10 - long_steps) + phase


def test_the_long_step_count_is_kept_at_any_share():
    short, long = row_lengths.Phase(None, 32), row_lengths.Phase(None, 8)
    for long_steps in (1, 5, 7, 100, 1000):
        for share in (0.01, 0.3, 0.5, 0.77, 1.0):
            count = sum(row_lengths.phase_at(step, 2000, long_steps, short, long, share) is long
                        for step in range(2000))
            assert count == row_lengths.long_step_count(long_steps, share)
    # Half a step rounds up at every count (Python's round would give 2 of 5 and 2 of 3).
    assert [row_lengths.long_step_count(n, 0.5) for n in (3, 5, 1000)] == [2, 3, 500]
    assert row_lengths.long_step_count(1000, 0.77) == 770
