"""How long a training step's rows are: the training-side recipes for sequences longer than the training length.

A model trained on packed rows of one length L only ever sees L keys per query, so nothing in training tells
it how to weigh more keys than that (a learned temperature's slope over log(keys) cannot even be identified).
Two recipes change what training shows it, and both keep the 1x evaluation at L:

- **Mixed row lengths** (`data.min_row_length > 0`): each training row is cut short to a length drawn uniformly
  from `[min_row_length, seq_len]` and closed with [SEP]; the cut-off tokens are padding (not attended to, not
  predicted), so the number of keys varies from row to row. It trains on fewer tokens per step
  (`mean_row_length` of every `seq_len`), which is its cost.
- **Short-then-long** (`train.long_steps > 0`): the last `long_steps` updates train on rows of
  `data.long_seq_len` tokens, as long-context encoders finish pre-training; the batch holds
  `batch_size * seq_len / long_seq_len` rows, so every step trains on the same number of tokens and only the
  attention's share of the FLOPs grows. With `train.long_share < 1` only that share of the phase's steps are long,
  spread evenly through it, and the others stay on rows of `seq_len`: the model keeps training at the length it is
  scored at most (1x) while it learns the long one.

Both are pure functions of (seed, step, global row), like the batches and masks (`batches`): a resumed run trains
on exactly the rows of an uninterrupted one, and one process or many build the same rows.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from deberta_jax.data import packing
from deberta_jax.data.tokenizer import SpecialIds

# Keeps the row-length draws independent of the masking draws, which are seeded by (seed, step, row) alone.
_LENGTH_STREAM = 1


@dataclasses.dataclass(frozen=True)
class Phase:
    """The rows of one stretch of training: packed at `rows.seq_len`, `batch_size` of them per step."""

    rows: packing.PackedData | packing.StreamRows
    batch_size: int


def long_batch_size(batch_size: int, seq_len: int, long_seq_len: int) -> int:
    """Rows per step in the long phase: the same tokens per step as the short phase."""
    return batch_size * seq_len // long_seq_len


def long_step_count(long_steps: int, long_share: float) -> int:
    """How many of the long phase's `long_steps` updates train on long rows (half a step rounds up)."""
    return math.floor(long_steps * long_share + 0.5)


def phase_at(step: int, num_steps: int, long_steps: int, short: Phase, long: Phase | None,
             long_share: float = 1.0) -> Phase:
    """The phase update `step` (0-based) trains in. The last `long_steps` of `num_steps` are the long phase; of
    those, `long_step_count` are long, each where the running count `index * count / long_steps` passes a whole
    number (integers only, so every process and every resume agrees), the phase's last step among them."""
    index = step - (num_steps - long_steps)
    if long is None or index < 0:
        return short
    count = long_step_count(long_steps, long_share)
    return long if (index + 1) * count // long_steps > index * count // long_steps else short


def mixed_lengths(seed: int, step: int, global_rows: np.ndarray, low: int, high: int) -> np.ndarray:
    """The length of each row (by its position in the global batch) of step `step`, uniform in `[low, high]`."""
    return np.array([np.random.default_rng([seed, step, int(row), _LENGTH_STREAM]).integers(low, high + 1)
                     for row in global_rows], dtype=np.int64)


def mean_row_length(min_row_length: int, seq_len: int) -> float:
    """The mean length of rows of `seq_len` under `mixed_lengths` (`min_row_length` 0: rows are not cut)."""
    return (min_row_length + seq_len) / 2 if min_row_length else seq_len


def cut_short(rows: packing.PackedData, lengths: np.ndarray, special: SpecialIds) -> packing.PackedData:
    """`rows` with row r ending at `lengths[r]`: its last kept cell becomes [SEP] (unless the row's own [SEP] or
    padding comes earlier, as in the corpus' padded last row) and every later cell is padding."""
    input_ids, attention_mask = rows.input_ids.copy(), rows.attention_mask.copy()
    columns = np.arange(rows.seq_len)[None, :]
    lengths = np.minimum(lengths, attention_mask.sum(axis=1))[:, None]
    input_ids[columns == lengths - 1] = special.sep
    dropped = columns >= lengths
    input_ids[dropped] = special.pad
    attention_mask[dropped] = 0
    return packing.PackedData(input_ids, attention_mask, rows.word_start & ~dropped)
