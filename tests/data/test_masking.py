"""BERT masking: rates, what may never be selected or inserted, determinism, whole words, validation.

Tolerances: with N candidates and k ~ 0.15 N selected, a rate p has standard error
sqrt(p (1 - p) / n). For N ~ 200k: selection 0.0008, [MASK] share (k ~ 30k) 0.0023, random and
unchanged shares 0.0017. The bounds below are about 6 standard errors, so they never fail by
chance, yet catch any real bias (e.g. 0.8 vs 0.85, or 0.10 vs 0.12).
"""

import numpy as np
import pytest

from deberta_jax.data.masking import MaskedBatch, mask_tokens, masking_rngs
from deberta_jax.data.tokenizer import SpecialIds

SPECIAL = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)
VOCAB = 1000


def rngs(ids, seed=0, step=0):
    """One generator per row of `ids`, as training draws them."""
    return masking_rngs(seed, step, range(len(ids)))


def make_batch(rows=400, seq_len=512, seed=0):
    """~200k tokens of packed-looking rows, with separators, [UNK]s and a padded tail row."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, VOCAB, size=(rows, seq_len)).astype(np.int32)
    ids[rng.random(ids.shape) < 0.01] = SPECIAL.sep
    ids[rng.random(ids.shape) < 0.01] = SPECIAL.unk
    ids[:, 0], ids[:, -1] = SPECIAL.cls, SPECIAL.sep
    mask = np.ones_like(ids)
    ids[-1, 100:], mask[-1, 100:] = SPECIAL.pad, 0
    ids[-1, 99] = SPECIAL.sep
    return ids, mask


@pytest.fixture(scope="module")
def batch():
    ids, mask = make_batch()
    return ids, mask, mask_tokens(ids, mask, SPECIAL, VOCAB, rngs(ids))


def test_types_and_labels(batch):
    ids, _, out = batch
    assert isinstance(out, MaskedBatch)
    assert out.input_ids.dtype == np.int32 and out.labels.dtype == np.int32 and out.weights.dtype == np.float32
    np.testing.assert_array_equal(out.labels, ids)
    assert set(np.unique(out.weights)) == {0.0, 1.0}


def test_selection_rate(batch):
    ids, mask, out = batch
    candidates = mask.astype(bool) & (ids >= 5)
    assert candidates.sum() > 190_000
    assert abs(out.weights[candidates].mean() - 0.15) < 0.005


def test_never_selects_special_or_padding(batch):
    ids, mask, out = batch
    assert not out.weights[np.isin(ids, SPECIAL.all) | (mask == 0)].any()


def test_80_10_10_split(batch):
    ids, _, out = batch
    selected = out.weights > 0
    masked = out.input_ids[selected] == SPECIAL.mask
    unchanged = out.input_ids[selected] == ids[selected]
    # A random draw equals the original with chance 1/995, so "random" ~ 0.1 * 994/995.
    randomized = ~masked & ~unchanged
    assert abs(masked.mean() - 0.8) < 0.015
    assert abs(randomized.mean() - 0.1) < 0.01
    assert abs(unchanged.mean() - 0.1) < 0.01


def test_only_selected_tokens_change_and_random_ones_are_ordinary(batch):
    ids, _, out = batch
    selected = out.weights > 0
    np.testing.assert_array_equal(out.input_ids[~selected], ids[~selected])
    replaced = out.input_ids[selected & (out.input_ids != SPECIAL.mask)]
    assert replaced.min() >= 5 and replaced.max() < VOCAB
    assert len(np.unique(replaced)) > 900  # drawn across the whole ordinary vocabulary


def test_random_replacements_avoid_specials_anywhere_in_vocab():
    # Specials scattered through the vocabulary, not just 0..4.
    special = SpecialIds(pad=7, unk=3, cls=11, sep=0, mask=19)
    ids = np.full((200, 100), 5, dtype=np.int32)
    out = mask_tokens(ids, np.ones_like(ids), special, 20, rngs(ids), replace_prob=0.0, random_prob=1.0)
    drawn = out.input_ids[out.weights > 0]
    assert drawn.size > 2000 and not np.isin(drawn, special.all).any()
    assert set(np.unique(drawn)) == set(range(20)) - set(special.all)


def test_input_is_not_modified():
    ids, mask = make_batch(rows=4)
    before = ids.copy()
    mask_tokens(ids, mask, SPECIAL, VOCAB, rngs(ids))
    np.testing.assert_array_equal(ids, before)


def test_masks_are_a_function_of_seed_step_and_global_row():
    ids, mask = make_batch(rows=8)

    def run(seed, step, rows=range(8)):
        return mask_tokens(ids, mask, SPECIAL, VOCAB, masking_rngs(seed, step, rows))

    a, b = run(0, 5), run(0, 5)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.weights, b.weights)
    for other in (run(0, 6), run(1, 5), run(0, 5, rows=range(8, 16))):
        assert (other.weights != a.weights).any()
    # A row's masks do not depend on the rows batched with it: masking the two halves of the batch
    # separately (two processes) gives the masks of the whole batch (one process).
    halves = [mask_tokens(ids[rows], mask[rows], SPECIAL, VOCAB, masking_rngs(0, 5, range(8)[rows]))
              for rows in (slice(0, 4), slice(4, 8))]
    for field in ("input_ids", "weights"):
        np.testing.assert_array_equal(np.concatenate([getattr(h, field) for h in halves]), getattr(a, field))


def test_one_generator_per_row_is_required():
    ids, mask = make_batch(rows=4)
    with pytest.raises(ValueError, match="got 3 generators for 4 rows"):
        mask_tokens(ids, mask, SPECIAL, VOCAB, masking_rngs(0, 0, range(3)))


def make_words(rows=400, seq_len=512, seed=0):
    """make_batch rows plus word starts: each token begins a new word with probability 1/2."""
    ids, mask = make_batch(rows, seq_len, seed)
    rng = np.random.default_rng(seed + 1)
    word_start = rng.random(ids.shape) < 0.5
    word_start[:, :2] = True
    return ids, mask, word_start


def test_whole_word_masking_selects_words_together():
    ids, mask, word_start = make_words()
    out = mask_tokens(ids, mask, SPECIAL, VOCAB, rngs(ids), word_start=word_start)
    selected = out.weights > 0
    candidates = mask.astype(bool) & (ids >= 5)
    # Inside a run of candidates, a continuation piece shares its predecessor's fate.
    continuation = candidates[:, 1:] & candidates[:, :-1] & ~word_start[:, 1:]
    assert continuation.sum() > 50_000
    np.testing.assert_array_equal(selected[:, 1:][continuation], selected[:, :-1][continuation])
    assert not selected[~candidates].any()
    # Every piece of a word is selected with probability mask_prob, so the token rate is unchanged;
    # words (~2 pieces) make it noisier than token-level selection, hence the wider bound.
    assert abs(selected[candidates].mean() - 0.15) < 0.01


def test_whole_words_do_not_cross_special_tokens():
    # "a ##b [SEP] ##c": ##c follows a special token, so it is a word of its own.
    ids = np.tile(np.array([[SPECIAL.cls, 10, 11, SPECIAL.sep, 12, SPECIAL.sep]], dtype=np.int32), (20000, 1))
    word_start = np.tile(np.array([[True, True, False, True, False, True]]), (20000, 1))
    out = mask_tokens(ids, np.ones_like(ids), SPECIAL, VOCAB, rngs(ids), word_start=word_start)
    selected = out.weights > 0
    np.testing.assert_array_equal(selected[:, 1], selected[:, 2])
    assert (selected[:, 2] != selected[:, 4]).any()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mask_prob=1.5), r"mask_prob=1.5 must be a probability in \[0, 1\]"),
        (dict(replace_prob=-0.1), r"replace_prob=-0.1 must be a probability"),
        (dict(replace_prob=0.9, random_prob=0.2), r"replace_prob \+ random_prob .* must be at most 1"),
    ],
)
def test_bad_probabilities(kwargs, message):
    ids, mask = make_batch(rows=2)
    with pytest.raises(ValueError, match=message):
        mask_tokens(ids, mask, SPECIAL, VOCAB, rngs(ids), **kwargs)


def test_bad_shapes_and_vocab():
    ids, mask = make_batch(rows=2)
    generators = rngs(ids)
    with pytest.raises(ValueError, match="same shape"):
        mask_tokens(ids, mask[:, :-1], SPECIAL, VOCAB, generators)
    with pytest.raises(ValueError, match="word_start has shape"):
        mask_tokens(ids, mask, SPECIAL, VOCAB, generators, word_start=np.ones(3, dtype=bool))
    with pytest.raises(ValueError, match="vocab_size=100 but the batch holds token id"):
        mask_tokens(ids, mask, SPECIAL, 100, generators)
