"""Host-side masked-LM batches: the training batch of a step, and the fixed evaluation batches.

Training batches are a pure function of (seed, step): rows from `packing.get_batch`, and each row's
masks from `masking.masking_rngs(seed, step, global row)`. Every process builds its own share of the
global batch, and a row comes out the same whichever process builds it, so 1 process and N processes
(1 device or many) train on identical batches. Nothing needs checkpointing besides the step.

Evaluation scores fixed targets drawn once per position of the evaluation text (`EVAL_MASK_SEED`,
independent of the training seed, step, batch size and process count), so eval loss is comparable
across steps and across runs that share eval_files, seq_len and tokenizer.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from deberta_jax.data import packing, row_lengths, targets
from deberta_jax.data.masking import mask_tokens, masking_rngs
from deberta_jax.data.tokenizer import SpecialIds

EVAL_MASK_SEED = 0
Batch = dict[str, np.ndarray]  # input_ids, attention_mask, labels (int32), weights (float32): [rows, seq_len]


@dataclasses.dataclass(frozen=True)
class Masker:
    """BERT corruption settings; `vocab_size` is the tokenizer's, so random replacements are real tokens."""

    special: SpecialIds
    vocab_size: int
    mask_prob: float
    whole_word_masking: bool

    def __call__(self, rows: packing.PackedData, rngs: list[np.random.Generator]) -> Batch:
        masked = mask_tokens(
            rows.input_ids, rows.attention_mask, self.special, self.vocab_size, rngs,
            mask_prob=self.mask_prob, word_start=rows.word_start if self.whole_word_masking else None,
        )
        return dict(input_ids=masked.input_ids, attention_mask=rows.attention_mask.astype(np.int32),
                    labels=masked.labels, weights=masked.weights)


def train_batch(packed: packing.PackedData, masker: Masker, *, batch_size: int, step: int, seed: int,
                process_index: int, process_count: int, min_row_length: int = 0) -> Batch:
    """This process's share of global training batch `step`, masked: its rows are the same, and masked
    the same, as those rows of the batch a single process builds. With `min_row_length` each row is first cut
    to a length drawn from `[min_row_length, seq_len]` (`row_lengths`)."""
    rows = packing.get_batch(packed, batch_size, step, seed, process_index, process_count)
    global_rows = packing.process_share(np.arange(batch_size), process_index, process_count)
    if min_row_length:
        lengths = row_lengths.mixed_lengths(seed, step, global_rows, min_row_length, packed.seq_len)
        rows = row_lengths.cut_short(rows, lengths, masker.special)
    return masker(rows, masking_rngs(seed, step, global_rows))


def eval_batches(packed: packing.PackedData, special: SpecialIds, *, batch_size: int, max_batches: int | None,
                 process_index: int, process_count: int) -> list[Batch]:
    """This process's share of every evaluation batch: the first `max_batches * batch_size` rows (all if None).

    Targets are the fixed per-stream-position ones of `targets` (seed `EVAL_MASK_SEED`, every
    target replaced by [MASK]), laid out by `targets.chunked_windows` exactly as `eval.py` lays
    out its chunked protocol at the training length: the eval loss logged here is the 1x point of the
    length evaluation. The last batch is filled up with copies of real rows whose weights are 0, so
    every batch has the same shape (one compilation) and the padding contributes nothing to the sums.
    """
    corpus = targets.corpus_from_stream(packed_stream(packed), special, seed=EVAL_MASK_SEED)
    windows = targets.chunked_windows(corpus, packed.seq_len)
    masked = dict(input_ids=windows.input_ids, attention_mask=windows.attention_mask, labels=windows.labels,
                  weights=windows.weights)
    num_rows = len(windows) if max_batches is None else min(len(windows), max_batches * batch_size)
    masked = {name: x[:num_rows] for name, x in masked.items()}
    num_batches = -(-num_rows // batch_size)
    filler = np.arange(num_batches * batch_size - num_rows) % num_rows
    padded = {name: np.concatenate([x, x[filler]]) for name, x in masked.items()}
    padded["weights"][num_rows:] = 0.0
    batches = []
    for b in range(num_batches):
        rows = packing.process_share(np.arange(b * batch_size, (b + 1) * batch_size), process_index, process_count)
        batches.append({name: x[rows] for name, x in padded.items()})
    return batches


def packed_stream(packed: packing.PackedData) -> np.ndarray:
    """The token stream that `packing.pack_stream` cut into `packed`'s rows.

    Content cells are columns 1..N-2; in the padded last row a cell holds content exactly when the
    cell after it is still real (the [SEP] closing that row is the last real cell).
    """
    rows = packed.take(np.arange(packed.num_rows))  # cut once (a memory-mapped store builds rows on request)
    content = rows.input_ids[:, 1:-1]
    return content[rows.attention_mask[:, 2:] == 1]
