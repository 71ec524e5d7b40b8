"""Context-free reference: predict every masked token from training-set unigram frequencies.

A masked LM that has learned anything beats this floor; where a model falls back to it at long
lengths, it has lost the use of its context. It is scored by the same windows and targets as the
models (`extrapolation.run_study`), so its row is directly comparable.
"""

from __future__ import annotations

import numpy as np

from deberta_jax.data.tokenizer import SpecialIds


class UnigramModel:
    """Add-one-smoothed unigram distribution over the non-special vocabulary."""

    def __init__(self, train_stream: np.ndarray, vocab_size: int, special: SpecialIds):
        counts = np.bincount(train_stream, minlength=vocab_size).astype(np.float64) + 1.0
        counts[list(special.all)] = 0.0  # targets are never special tokens
        with np.errstate(divide="ignore"):  # special tokens get log 0 = -inf on purpose
            self.log_probs = np.log(counts / counts.sum())
        self.best = int(np.argmax(counts))

    def scorer(self):
        """Same signature as `evaluation.make_scorer`'s result: `(ids, mask, positions, labels) -> (nll, correct)`."""
        def run(ids, mask, positions, labels):
            return -self.log_probs[labels], labels == self.best
        return run
