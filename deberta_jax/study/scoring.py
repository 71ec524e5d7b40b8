"""Scoring windows with a model: per-document and per-position-bucket metric sums, bootstrap intervals.

Results are sums (loss, correct, count) per document and per position bucket, divided only when
reported, so bootstrap intervals over documents are cheap and exact. The windows and their targets
come from `deberta_jax.data.targets`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from deberta_jax.data.targets import EVAL_MASK_PROB, EvalCorpus, Windows
from deberta_jax.study.report import CONFIDENCE
from deberta_jax.train import steps
from deberta_jax.train.sharding import sum_across_processes

Scorer = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def score_function(graphdef: nnx.GraphDef):
    """The pure `(state, ids, mask, positions, labels) -> (nll, correct)` that `make_scorer` jits: the length
    study's forward pass (`deberta_jax.aot` compiles it for TPU slices).

    Only the flat positions `positions` of the `[B, N]` batch go through the MLM head (`MaskedLM.head_at`, as in
    training): evaluation scores about 15% of positions (chunked) or fewer (centred-target).
    """
    def score(state, ids, mask, positions, labels):
        model = nnx.merge(graphdef, state)
        logits = model.head_at(model.encode(ids, mask), positions)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # as in training
        return nll, jnp.argmax(logits, axis=-1) == labels
    return score


def make_scorer(model) -> Scorer:
    """`score_function` of `model`, jitted, as a function of numpy arrays; compiles once per batch shape and
    target count."""
    graphdef, state = nnx.split(model)
    score = jax.jit(score_function(graphdef))

    def run(ids, mask, positions, labels):
        nll, correct = score(state, ids, mask, positions, labels)
        return np.asarray(nll), np.asarray(correct)

    return run


def scored_count(num_tokens: int, num_targets: int) -> int:
    """How many positions the head scores in a batch of `num_tokens` holding `num_targets` targets.

    A bound fixed by the batch shape (training's `prediction_budget` at the evaluation masking rate,
    far above what any batch holds), so one compile serves every batch of a length, chunked or
    centred-target; a batch past it (a corpus masked at a higher rate) rounds up to a multiple of 64.
    """
    budget = steps.prediction_budget(num_tokens, EVAL_MASK_PROB)
    return budget if num_targets <= budget else -(-num_targets // 64) * 64


@dataclasses.dataclass
class Sums:
    """Loss / correct / count per document and per position bucket."""

    loss_doc: np.ndarray
    correct_doc: np.ndarray
    count_doc: np.ndarray
    loss_bucket: np.ndarray
    correct_bucket: np.ndarray
    count_bucket: np.ndarray
    bucket_width: int

    @classmethod
    def zeros(cls, num_docs: int, seq_len: int, bucket_width: int) -> Sums:
        nb = -(-seq_len // bucket_width)
        z = lambda n: np.zeros(n, np.float64)  # noqa: E731
        return cls(z(num_docs), z(num_docs), z(num_docs), z(nb), z(nb), z(nb), bucket_width)

    def across_processes(self) -> Sums:
        """These sums added over every process (themselves in a single-process run)."""
        fields = ("loss_doc", "correct_doc", "count_doc", "loss_bucket", "correct_bucket", "count_bucket")
        arrays = [getattr(self, name) for name in fields]
        total = sum_across_processes(np.concatenate(arrays))
        parts = np.split(total, np.cumsum([len(a) for a in arrays])[:-1])
        return Sums(*parts, bucket_width=self.bucket_width)

    @property
    def loss(self) -> float:
        return float(self.loss_doc.sum() / max(self.count_doc.sum(), 1))

    @property
    def accuracy(self) -> float:
        return float(self.correct_doc.sum() / max(self.count_doc.sum(), 1))

    @property
    def count(self) -> int:
        return int(self.count_doc.sum())


def score_windows(scorer: Scorer, corpus: EvalCorpus, windows: Windows, batch_size: int, bucket_width: int,
                  desc: str = "") -> Sums:
    """Score all windows in fixed-size batches (the last one padded) and accumulate sums.

    In a multi-process run each process scores a contiguous share of the batches and the sums are added
    across processes, so every process returns the sums a single process computes (to float64 rounding).
    """
    n, seq_len = windows.input_ids.shape
    sums = Sums.zeros(corpus.num_docs, seq_len, bucket_width)
    share = np.array_split(np.arange(0, n, batch_size), jax.process_count())[jax.process_index()]
    for start in share:
        rows = slice(start, min(start + batch_size, n))
        ids, mask, labels = (_pad_rows(a[rows], batch_size) for a in
                             (windows.input_ids, windows.attention_mask, windows.labels))
        # Flat, row-major target positions; padding rows come last, so they index the padded batch too.
        positions = np.flatnonzero(windows.weights[rows] > 0)
        count = len(positions)
        padded = np.zeros(scored_count(ids.size, count), np.int32)
        padded[:count] = positions
        nll, correct = scorer(ids, mask, padded, labels.reshape(-1)[padded])
        nll, correct = nll[:count], correct[:count]
        docs = corpus.doc_ids[windows.stream_pos[rows].reshape(-1)[positions]]
        buckets = positions % seq_len // bucket_width
        np.add.at(sums.loss_doc, docs, nll)
        np.add.at(sums.correct_doc, docs, correct)
        np.add.at(sums.count_doc, docs, 1)
        np.add.at(sums.loss_bucket, buckets, nll)
        np.add.at(sums.correct_bucket, buckets, correct)
        np.add.at(sums.count_bucket, buckets, 1)
    sums = sums.across_processes()
    if not np.isfinite(sums.loss_doc).all():
        raise FloatingPointError(f"non-finite loss while scoring {desc or 'windows'}")
    return sums


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """Pad a batch with all-padding rows so every batch of a length has one shape (one compile)."""
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)])


def bootstrap_ratio_ci(num: np.ndarray, den: np.ndarray, resamples: np.ndarray,
                       transform: Callable[[np.ndarray], np.ndarray] = lambda x: x
                       ) -> tuple[float | None, float | None]:
    """`CONFIDENCE` percentile interval of `transform(sum(num) / sum(den))` over document resamples.

    `resamples` is `[B, D]` document indices shared by all models, so intervals are paired. With fewer than
    two documents that hold targets every resample is the same text and the interval would have zero width,
    which reads as certainty: there is no interval then, (None, None).
    """
    if np.count_nonzero(den) < 2:
        return None, None
    den_b = den[resamples].sum(axis=1)
    stat = transform(num[resamples].sum(axis=1) / np.maximum(den_b, 1))
    tail = 50 * (1 - CONFIDENCE)  # percent in each tail
    lo, hi = np.percentile(stat[den_b > 0], [tail, 100 - tail]) if (den_b > 0).any() else (np.nan, np.nan)
    return float(lo), float(hi)


def document_resamples(num_docs: int, num_resamples: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, num_docs]).integers(0, num_docs, size=(num_resamples, num_docs))
