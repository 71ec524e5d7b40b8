"""Fixed evaluation targets and the windows of the two length protocols.

Targets are drawn once per *token position of the evaluation stream* from a fixed seed, and every
selected token is replaced by `[MASK]`. Because the decision belongs to the stream position, not to a
window, every model (with the same tokenizer) and every length scores exactly the same tokens, so all
comparisons are paired. Training's periodic evaluation uses the same `chunked_windows` at the training
length (`batches.eval_batches`), which is why the length study at 1x reproduces the logged eval loss.

Protocols:
  - chunked: the stream cut into consecutive `[CLS] ... [SEP]` windows of each length (the packing
    used for training), every target scored once per length;
  - fixed-target: the same spans of target tokens placed at controlled offsets inside windows of every
    length; at a fixed length the offset isolates "unseen positions", at a fixed offset the length
    isolates "more context".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from deberta_jax.data.packing import check_seq_len, pack_stream, token_stream
from deberta_jax.data.tokenizer import SpecialIds

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
    """The stream cut into windows exactly as training packs it (`packing.pack_stream`)."""
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
            f"{2 * max_len + span + 1} for length {max_len}. Pass more eval text or smaller lengths.")
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
