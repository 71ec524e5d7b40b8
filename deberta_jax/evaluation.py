"""Length-extrapolation evaluation: fixed targets, the two protocols, and per-document metric sums.

Targets are drawn once per *token position of the evaluation stream* from a fixed seed, and every
selected token is replaced by `[MASK]`. Because the decision belongs to the stream position, not to a
window, every model (with the same tokenizer) and every length scores exactly the same tokens, so all
comparisons are paired. Training's periodic evaluation uses the same `chunked_windows` at the training
length, which is why `eval.py` at 1x reproduces the eval loss logged during training.

Protocols:
  - chunked: the stream cut into consecutive `[CLS] ... [SEP]` windows of each length (the packing
    used for training), every target scored once per length;
  - fixed-target: the same spans of target tokens placed at controlled offsets inside windows of every
    length; at a fixed length the offset isolates "unseen positions", at a fixed offset the length
    isolates "more context".

Results are sums (loss, correct, count) per document and per position bucket, divided only when
reported, so bootstrap intervals over documents are cheap and exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from deberta_jax import train_lib
from deberta_jax.data import check_seq_len, pack_stream, token_stream
from deberta_jax.tokenizer import SpecialIds

EVAL_MASK_PROB = 0.15
_NO_SPECIALS = SpecialIds(pad=-1, unk=-1, cls=-1, sep=-1, mask=-1)


@dataclasses.dataclass(frozen=True)
class EvalCorpus:
    """A tokenized evaluation text with its fixed prediction targets."""

    tokens: np.ndarray  # int32 stream, [SEP] between documents
    doc_ids: np.ndarray  # int32 document index of every stream position
    targets: np.ndarray  # bool, True where the token is to be predicted
    special: SpecialIds

    @property
    def num_docs(self) -> int:
        return int(self.doc_ids[-1]) + 1


def build_corpus(documents: Sequence[str], tokenizer, seed: int = 0, mask_prob: float = EVAL_MASK_PROB) -> EvalCorpus:
    """Tokenize `documents` and draw the targets once per stream position from `seed`."""
    special = SpecialIds.from_tokenizer(tokenizer)
    tokens = token_stream(documents, tokenizer, special.sep)
    return corpus_from_stream(tokens, special, seed, mask_prob)


def corpus_from_stream(tokens: np.ndarray, special: SpecialIds, seed: int = 0,
                       mask_prob: float = EVAL_MASK_PROB) -> EvalCorpus:
    is_sep = tokens == special.sep
    doc_ids = (np.cumsum(is_sep) - is_sep).astype(np.int32)  # a [SEP] closes the document before it
    draws = np.random.default_rng(seed).random(len(tokens))
    targets = (draws < mask_prob) & ~np.isin(tokens, special.all)
    return EvalCorpus(tokens.astype(np.int32), doc_ids, targets, special)


@dataclasses.dataclass(frozen=True)
class Windows:
    """Model inputs for one length; `stream_pos` is -1 at [CLS]/[SEP]/padding cells."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray
    weights: np.ndarray  # float32, 1 at scored targets
    stream_pos: np.ndarray

    def __len__(self) -> int:
        return self.input_ids.shape[0]


def _windows_from_positions(corpus: EvalCorpus, stream_pos: np.ndarray, attention_mask: np.ndarray,
                            scored: np.ndarray) -> Windows:
    sp = corpus.special
    real = stream_pos >= 0
    labels = np.where(real, corpus.tokens[np.maximum(stream_pos, 0)], sp.pad).astype(np.int32)
    # Rebuild the special cells from the layout: [CLS] first, [SEP] right after the last token.
    ids = labels.copy()
    ids[:, 0] = sp.cls
    is_special_cell = ~real & (attention_mask > 0)
    ids[is_special_cell & (np.arange(ids.shape[1]) > 0)] = sp.sep
    selected = real & scored
    ids = np.where(selected, sp.mask, ids).astype(np.int32)
    return Windows(ids, attention_mask.astype(np.int32), labels, selected.astype(np.float32), stream_pos)


def chunked_windows(corpus: EvalCorpus, seq_len: int) -> Windows:
    """The stream cut into windows exactly as training packs it (`data.pack_stream`)."""
    check_seq_len(seq_len)
    # Packing the stream *positions* with -1 for every special cell reuses the training layout exactly.
    stream_pos, attention_mask = pack_stream(np.arange(len(corpus.tokens), dtype=np.int32), _NO_SPECIALS, seq_len)
    pos = np.maximum(stream_pos, 0)
    return _windows_from_positions(corpus, stream_pos, attention_mask, corpus.targets[pos] & (stream_pos >= 0))


def target_starts(corpus: EvalCorpus, max_len: int, span: int, num_targets: int) -> np.ndarray:
    """Evenly spaced target spans with room for a window of `max_len` on either side."""
    lo, hi = max_len, len(corpus.tokens) - max_len - span
    if hi <= lo:
        raise ValueError(
            f"the eval text has {len(corpus.tokens)} tokens; the fixed-target protocol needs at least "
            f"{2 * max_len + span + 1} for length {max_len}. Pass more text (--data_files) or smaller lengths.")
    return np.linspace(lo, hi, num=min(num_targets, hi - lo + 1)).astype(np.int64)


def fixed_target_windows(corpus: EvalCorpus, seq_len: int, offset: int, starts: np.ndarray, span: int) -> Windows:
    """Windows of `seq_len` whose content position `offset` holds each target span.

    Only the targets inside the span are scored; the rest of the window is clean context.
    """
    check_seq_len(seq_len)
    content = seq_len - 2
    if offset < 0 or offset + span > content:
        raise ValueError(f"offset {offset} + span {span} does not fit length {seq_len}")
    begin = starts - offset
    stream_pos = np.full((len(starts), seq_len), -1, dtype=np.int64)
    stream_pos[:, 1:-1] = begin[:, None] + np.arange(content)[None, :]
    in_span = np.zeros(seq_len, dtype=bool)
    in_span[1 + offset: 1 + offset + span] = True
    pos = np.maximum(stream_pos, 0)
    scored = in_span[None, :] & corpus.targets[pos] & (stream_pos >= 0)
    mask = np.ones((len(starts), seq_len), dtype=np.int32)
    return _windows_from_positions(corpus, stream_pos, mask, scored)


def default_offsets(train_len: int, seq_len: int, span: int) -> list[int]:
    """Offsets (in content positions) at 0, L/2, L - span, L, 2L, 4L, ... that fit in `seq_len`."""
    candidates = {0, train_len // 2, max(train_len - 2 - span, 0)}
    k = train_len
    while k + span <= seq_len - 2:
        candidates.add(k)
        k *= 2
    return sorted(o for o in candidates if o + span <= seq_len - 2)


# ------------------------------------------------------------------------------------------- scoring
Scorer = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def make_scorer(model, policy: str | None = None) -> Scorer:
    """A jitted `(ids, mask, positions, labels) -> (nll, correct)` for the flat positions `positions`
    of the `[B, N]` batch (their `labels` alike); compiles once per batch shape and count.

    Only those positions go through the MLM head (`MaskedLM.head_at`, as in training): evaluation
    scores about 15% of positions (chunked) or far fewer (fixed-target).
    """
    graphdef, state = nnx.split(model)

    @jax.jit
    def score(state, ids, mask, positions, labels):
        model = nnx.merge(graphdef, state)
        logits = model.head_at(model.encode(ids, mask, absolute_position_policy=policy), positions)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, labels)  # as in training
        return nll, jnp.argmax(logits, axis=-1) == labels

    def run(ids, mask, positions, labels):
        nll, correct = score(state, ids, mask, positions, labels)
        return np.asarray(nll), np.asarray(correct)

    return run


def scored_count(num_tokens: int, num_targets: int) -> int:
    """How many positions the head scores in a batch of `num_tokens` holding `num_targets` targets.

    A bound fixed by the batch shape (training's `prediction_budget` at the evaluation masking rate,
    far above what any batch holds), so one compile serves every batch of a length, chunked or
    fixed-target; a batch past it (a corpus masked at a higher rate) rounds up to a multiple of 64.
    """
    budget = train_lib.prediction_budget(num_tokens, EVAL_MASK_PROB)
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
    def zeros(cls, num_docs: int, seq_len: int, bucket_width: int) -> "Sums":
        nb = -(-seq_len // bucket_width)
        z = lambda n: np.zeros(n, np.float64)  # noqa: E731
        return cls(z(num_docs), z(num_docs), z(num_docs), z(nb), z(nb), z(nb), bucket_width)

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
    """Score all windows in fixed-size batches (the last one padded) and accumulate sums."""
    n, seq_len = windows.input_ids.shape
    sums = Sums.zeros(corpus.num_docs, seq_len, bucket_width)
    for start in tqdm(range(0, n, batch_size), desc=desc, leave=False, disable=None):
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
    if not np.isfinite(sums.loss_doc).all():
        raise FloatingPointError(f"non-finite loss while scoring {desc or 'windows'}")
    return sums


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """Pad a batch with all-padding rows so every batch of a length has one shape (one compile)."""
    if a.shape[0] == rows:
        return a
    return np.concatenate([a, np.zeros((rows - a.shape[0],) + a.shape[1:], a.dtype)])


def bootstrap_ratio_ci(num: np.ndarray, den: np.ndarray, resamples: np.ndarray,
                       transform: Callable[[np.ndarray], np.ndarray] = lambda x: x) -> tuple[float, float]:
    """95% percentile interval of `transform(sum(num) / sum(den))` over document resamples.

    `resamples` is `[B, D]` document indices shared by all models, so intervals are paired.
    """
    den_b = den[resamples].sum(axis=1)
    stat = transform(num[resamples].sum(axis=1) / np.maximum(den_b, 1))
    lo, hi = np.percentile(stat[den_b > 0], [2.5, 97.5]) if (den_b > 0).any() else (np.nan, np.nan)
    return float(lo), float(hi)


def document_resamples(num_docs: int, num_resamples: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng([seed, num_docs]).integers(0, num_docs, size=(num_resamples, num_docs))
