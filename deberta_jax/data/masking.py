"""BERT masked-LM corruption in numpy, token-level or whole-word.

Selection is a Bernoulli draw per candidate (or per word), so a batch holds *about*
`mask_prob` of its candidate tokens, not an exact count; a row may even have none selected,
and the loss must be normalized by `weights.sum()`, not by a fixed count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

import numpy as np

from deberta_jax.data.tokenizer import SpecialIds


@dataclasses.dataclass(frozen=True, eq=False)  # arrays have no single truth value
class MaskedBatch:
    """Model inputs and MLM targets; every array has the shape of the input batch."""

    input_ids: np.ndarray  # int32, corrupted ids fed to the model
    labels: np.ndarray  # int32, original ids (meaningful where weights > 0)
    weights: np.ndarray  # float32, 1.0 at selected positions, else 0.0


def masking_rngs(seed: int, step: int, rows: Iterable[int]) -> list[np.random.Generator]:
    """One generator per row of a step, for the rows at positions `rows` of the global batch.

    Seeding from (seed, step, global row) rather than carrying one generator along makes the masks a
    pure function of the step (a run resumed at step s masks exactly as an uninterrupted run would) and
    of nothing else: a row is masked alike whichever process, device or topology feeds it, so one
    process and N processes train on the same batches.
    """
    return [np.random.default_rng([seed, step, int(row)]) for row in rows]


def _check_probabilities(mask_prob: float, replace_prob: float, random_prob: float) -> None:
    for name, value in (("mask_prob", mask_prob), ("replace_prob", replace_prob), ("random_prob", random_prob)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name}={value} must be a probability in [0, 1]")
    if replace_prob + random_prob > 1.0 + 1e-9:
        raise ValueError(
            f"replace_prob + random_prob = {replace_prob} + {random_prob} > 1: they split the selected tokens "
            "into [MASK] / random / unchanged, so their sum must be at most 1 (BERT: 0.8 and 0.1)"
        )


def _word_starts(word_start: np.ndarray, candidates: np.ndarray) -> np.ndarray:
    """Where the words of a batch begin; pieces of one word share one start.

    A new word begins at every word start, at every non-candidate (so a word never reaches across
    [SEP], [CLS] or padding) and at the start of every row (a word cut by packing is two words).
    """
    starts = word_start | ~candidates
    starts[:, 0] = True
    return starts


def mask_tokens(
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    special: SpecialIds,
    vocab_size: int,
    rngs: Sequence[np.random.Generator],
    mask_prob: float = 0.15,
    replace_prob: float = 0.8,
    random_prob: float = 0.1,
    word_start: np.ndarray | None = None,
) -> MaskedBatch:
    """Selects ~`mask_prob` of the non-special, non-padding tokens and corrupts them BERT-style.

    Each selected token independently becomes [MASK] with probability `replace_prob`, a random
    non-special token with probability `random_prob` (which, as in BERT, may happen to equal the
    original), and stays unchanged otherwise. All five special tokens, [UNK] included, are never
    selected. With `word_start` (whole-word masking) each word is selected with probability
    `mask_prob` and all its pieces together; the 80/10/10 choice is still made per piece, as in
    BERT's whole-word masking. `rngs` holds one generator per row (`masking_rngs`), and every draw
    for a row comes from its own generator, so a row's masks do not depend on the rows batched with it.
    """
    _check_probabilities(mask_prob, replace_prob, random_prob)
    input_ids = np.asarray(input_ids)
    if input_ids.ndim != 2 or np.shape(attention_mask) != input_ids.shape:
        raise ValueError(
            f"input_ids must be [batch, seq_len] with attention_mask of the same shape; "
            f"got {input_ids.shape} and {np.shape(attention_mask)}"
        )
    if len(rngs) != input_ids.shape[0]:
        raise ValueError(f"got {len(rngs)} generators for {input_ids.shape[0]} rows; pass one per row (masking_rngs)")
    if word_start is not None and np.shape(word_start) != input_ids.shape:
        raise ValueError(f"word_start has shape {np.shape(word_start)}, expected {input_ids.shape}")
    special_ids = np.array(special.all)
    if input_ids.max() >= vocab_size:
        raise ValueError(f"vocab_size={vocab_size} but the batch holds token id {input_ids.max()}")
    ordinary = np.ones(vocab_size, dtype=bool)
    ordinary[special_ids[special_ids < vocab_size]] = False
    ordinary_ids = np.flatnonzero(ordinary)
    if not ordinary_ids.size:
        raise ValueError(f"vocab_size={vocab_size} has no non-special tokens to draw random replacements from")

    # One draw per row and position for each of: selection, the 80/10/10 choice, the replacement id.
    select_draw, action, replace_draw = np.stack([g.random((3, input_ids.shape[1])) for g in rngs], axis=1)
    replacement = ordinary_ids[(replace_draw * ordinary_ids.size).astype(np.int64)]

    candidates = np.asarray(attention_mask).astype(bool) & ~np.isin(input_ids, special_ids)
    if word_start is None:
        selected = candidates & (select_draw < mask_prob)
    else:  # a word is selected by the draw at its first piece
        starts = _word_starts(np.asarray(word_start, dtype=bool), candidates)
        words = np.cumsum(starts.ravel()).reshape(starts.shape) - 1
        selected = candidates & (select_draw[starts] < mask_prob)[words]

    to_mask = selected & (action < replace_prob)
    to_random = selected & (action >= replace_prob) & (action < replace_prob + random_prob)
    corrupted = input_ids.astype(np.int32)  # a copy: the caller's batch stays intact
    corrupted[to_mask] = special.mask
    corrupted[to_random] = replacement[to_random]
    return MaskedBatch(
        input_ids=corrupted,
        labels=input_ids.astype(np.int32),
        weights=selected.astype(np.float32),
    )
