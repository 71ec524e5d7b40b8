"""Reference predictors scored like the models: the unigram floor, and for synthetic data the exact oracle.

`UnigramModel` predicts every masked token from training-set unigram frequencies, without context. A
masked LM that has learned anything beats this floor; where a model falls back to it at long lengths,
it has lost the use of its context. `OracleModel` is the other end for a synthetic task
(`deberta_jax.data.synthetic`): the Bayes-optimal posterior of every target given its window, which no
model can beat, so a model's share of the gap between the two is how much of the usable context it uses.
Both are scored by the same windows and targets as the models (`length_study.run_study`), so their rows
are directly comparable.
"""

from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from deberta_jax.data import synthetic
from deberta_jax.data.tokenizer import SpecialIds

# Forward messages the oracle keeps at once (float64 count): 128 MiB.
MESSAGE_BUDGET = 1 << 24
COUNT_CHUNK = 1 << 24  # tokens the unigram model counts at a time


class UnigramModel:
    """Add-one-smoothed unigram distribution over the non-special vocabulary."""

    def __init__(self, train_stream: np.ndarray, vocab_size: int, special: SpecialIds):
        # In chunks: `train_stream` may map a whole corpus, which one bincount would copy at 8 bytes a token.
        counts = np.ones(vocab_size, np.float64)
        for start in range(0, len(train_stream), COUNT_CHUNK):
            counts += np.bincount(train_stream[start:start + COUNT_CHUNK], minlength=vocab_size)
        counts[list(special.all)] = 0.0  # targets are never special tokens
        with np.errstate(divide="ignore"):  # special tokens get log 0 = -inf on purpose
            self.log_probs = np.log(counts / counts.sum())
        self.best = int(np.argmax(counts))

    def scorer(self):
        """Same signature as `scoring.make_scorer`'s result: `(ids, mask, positions, labels) -> (nll, correct)`."""
        def run(ids, mask, positions, labels):
            return -self.log_probs[labels], labels == self.best
        return run


class OracleModel:
    """The Bayes-optimal masked-symbol predictor of a synthetic task (`deberta_jax.data.synthetic`).

    For each window row, the exact posterior of every target given everything visible in that row:
    symbol tokens are observed; `[MASK]` cells and the targets themselves are not; `[CLS]`, `[SEP]` and
    padding end a segment. A segment is a stretch of a stationary chain (a window cut anywhere in a
    document, or a document's start after a `[SEP]`: both begin in the stationary distribution), so its
    posteriors follow from the forward-backward algorithm over the chain's states (contexts of `order`
    symbols); with `stride` D the D residue classes of a segment are independent chains, each run on its
    own. No model scoring the same windows can have a lower expected loss.
    """

    def __init__(self, spec: str, tokenizer: Tokenizer):
        if not synthetic.has_exact_oracle(spec):
            raise ValueError(f"{spec}: its task registers no exact oracle (synthetic.TaskKind.exact_oracle)")
        task = synthetic.parse(spec)
        self.chain = synthetic.chain(task)
        self.stride = task.stride
        self.special = SpecialIds.from_tokenizer(tokenizer)
        # Token id -> symbol index, -1 for every other token.
        self.symbol_of = np.full(tokenizer.get_vocab_size(), -1, dtype=np.int64)
        self.symbol_of[synthetic.symbol_ids(tokenizer, task.vocab)] = np.arange(task.vocab)

    def posteriors(self, ids: np.ndarray, mask: np.ndarray, hidden: np.ndarray) -> np.ndarray:
        """[B, N, V] posterior of the symbol in every cell of `ids` ([B, N]); `hidden` marks the targets.

        Cells that hold no symbol ([CLS], [SEP], padding) get meaningless rows.
        """
        sp = self.special
        boundary = np.isin(ids, [sp.cls, sp.sep, sp.pad]) | (mask == 0)
        observed = np.where(hidden | boundary, -1, self.symbol_of[ids])
        # The chains of a row are its `stride` residue classes; each is a sequence of its own.
        valid = ~_residue_classes(boundary, self.stride, fill=True)
        segment = _residue_classes(np.cumsum(boundary, axis=1), self.stride, fill=-1)
        link = np.zeros_like(valid)  # cell m continues the chain of cell m - 1 (same class and segment)
        link[:, 1:] = valid[:, 1:] & valid[:, :-1] & (segment[:, 1:] == segment[:, :-1])
        observed = _residue_classes(observed, self.stride, fill=-1)
        # Rows in chunks, so the stored forward messages ([M, rows, S] floats) stay within MESSAGE_BUDGET.
        step = max(1, MESSAGE_BUDGET // (observed.shape[1] * self.chain.num_states))
        post = np.concatenate([self._forward_backward(observed[i : i + step], link[i : i + step])
                               for i in range(0, len(observed), step)])
        batch, cells = ids.shape
        return post.reshape(batch, self.stride, -1, self.chain.vocab).transpose(0, 2, 1, 3).reshape(
            batch, -1, self.chain.vocab)[:, :cells]

    def _forward_backward(self, observed: np.ndarray, link: np.ndarray) -> np.ndarray:
        """Posterior [R, M, V] of each cell of R sequences given their observed symbols (-1: unseen).

        A chain starts afresh (stationary) at every cell not linked to the one before it. Messages are
        normalized at every cell, so long rows do not underflow.
        """
        chain, vocab = self.chain, self.chain.vocab
        rows, cells = observed.shape
        # Likelihood of each state at each cell: a state's newest symbol is (state mod V).
        emit = np.ones((cells, rows, vocab))
        seen = observed.T >= 0
        emit[seen] = np.eye(vocab)[observed.T[seen]]
        emit = np.tile(emit, chain.num_states // vocab)
        alpha = np.empty((cells, rows, chain.num_states))
        for m in range(cells):
            prior = chain.stationary if m == 0 else np.where(link[:, m, None], chain.push(alpha[m - 1]),
                                                             chain.stationary)
            alpha[m] = _normalized(prior * emit[m])
        post = np.empty((rows, cells, vocab))
        beta = np.ones((rows, chain.num_states))
        for m in reversed(range(cells)):
            post[:, m] = _normalized((alpha[m] * beta).reshape(rows, -1, vocab).sum(axis=1))
            if m:
                beta = np.where(link[:, m, None], _normalized(chain.pull(beta * emit[m])), 1.0)
        return post

    def scorer(self):
        """Same signature as `scoring.make_scorer`'s result: `(ids, mask, positions, labels) -> (nll, correct)`.

        A position holding no symbol (the zero padding of `scoring.score_windows`) scores nll = inf.
        """
        def run(ids, mask, positions, labels):
            hidden = np.zeros(ids.size, dtype=bool)
            hidden[positions] = True
            post = self.posteriors(ids, mask, hidden.reshape(ids.shape)).reshape(-1, self.chain.vocab)[positions]
            symbol = self.symbol_of[labels]
            prob = np.where(symbol >= 0, post[np.arange(len(positions)), np.maximum(symbol, 0)], 0.0)
            with np.errstate(divide="ignore"):
                return -np.log(prob), (np.argmax(post, axis=-1) == symbol)
        return run


def _residue_classes(a: np.ndarray, stride: int, fill) -> np.ndarray:
    """[B, N] -> [B * stride, ceil(N / stride)]: row b's cells c, c + stride, ... become row b * stride + c.

    The rows are first padded with `fill` to a multiple of `stride`.
    """
    width = -(-a.shape[1] // stride) * stride
    padded = np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)
    return padded.reshape(len(a), -1, stride).transpose(0, 2, 1).reshape(len(a) * stride, -1)


def _normalized(x: np.ndarray) -> np.ndarray:
    """Rows of `x` ([R, K]) scaled to sum to 1; a row of zeros means the observations are impossible."""
    total = x.sum(axis=-1, keepdims=True)
    if not (total > 0).all():
        raise ValueError("observed symbols that the task's chain cannot produce: are these windows from another "
                         "synthetic task or parameters than the oracle's spec?")
    return x / total
