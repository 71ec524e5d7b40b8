"""Fixed evaluation targets and the windows of the two length protocols.

Targets are drawn once per *token position of the evaluation stream* from a fixed seed, and every
selected token is replaced by `[MASK]`. Because the decision belongs to the stream position, not to a
window, every model (with the same tokenizer) and every length scores exactly the same tokens, so all
comparisons are paired. Training's periodic evaluation uses the same `chunked_windows` at the training
length (`batches.eval_batches`), which is why the length study at 1x reproduces the logged eval loss.

Protocols:
  - chunked: the stream cut into consecutive `[CLS] ... [SEP]` windows of each length (the packing
    used for training), every target scored once per length;
  - centred-target: the same spans of target tokens at the centre of windows of every length, each window
    inside the span's document, so a longer window only adds context on both sides of the same targets.
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


def document_bounds(corpus: EvalCorpus) -> tuple[np.ndarray, np.ndarray]:
    """For every stream position, the first content position of its document and one past the last (its closing
    [SEP] excluded)."""
    ends = np.flatnonzero(corpus.tokens == corpus.special.sep)
    ends = np.append(ends, len(corpus.tokens)) if not len(ends) or ends[-1] != len(corpus.tokens) - 1 else ends
    firsts = np.concatenate([[0], ends[:-1] + 1])
    doc = np.minimum(corpus.doc_ids, len(ends) - 1)
    return firsts[doc], ends[doc]


def centred_spans(corpus: EvalCorpus, train_len: int, span: int, count: int) -> np.ndarray:
    """Up to `count` evenly spaced, disjoint target spans of `span` tokens, each inside one document with the
    margin a window of `train_len` centred on it leaves on both sides (`(train_len - 2 - span) // 2` tokens).

    The margin keeps every target that far from its row's [CLS] and [SEP] at every length, so the window of the
    training length is the middle of a training row rather than its edge. A text with fewer places gives fewer
    spans (the records count the targets scored); one with none is refused."""
    content = train_len - 2
    if span < 1 or span > content:
        raise ValueError(f"span={span}: a target span must fit in the {content} content tokens of the training "
                         f"length {train_len}; give 1 to {content} (0 takes half the training length)")
    margin = (content - span) // 2
    firsts, ends = document_bounds(corpus)
    pos = np.arange(len(corpus.tokens))
    fits = (pos - margin >= firsts) & (pos + span + margin <= ends)
    candidates = np.flatnonzero(fits)
    if not len(candidates):
        longest = int((ends - firsts).max()) if len(pos) else 0
        raise ValueError(f"the eval text's longest document has {longest} tokens; the centred-target protocol needs a "
                         f"document of at least {span + 2 * margin} to centre a span of {span} in a window of "
                         f"{train_len}. Pass longer documents or a shorter span.")
    # Disjoint: spans at least `span` candidates apart (candidates are increasing stream positions).
    count = max(1, min(count, len(candidates) // span))
    return candidates[np.linspace(0, len(candidates) - 1, num=count).round().astype(np.int64)]


def centred_windows(corpus: EvalCorpus, seq_len: int, starts: np.ndarray, span: int) -> Windows:
    """Windows of `seq_len` around each target span (`centred_spans`), inside the span's document.

    The window is centred on the span, so a longer window adds keys on both sides; near a document's end it is
    shifted to stay inside the document (the keys then come from one side), and a document shorter than the
    window fills the row whole, with padding after its [SEP] (a longer window adds nothing there). Only the
    targets inside the span are scored; the rest of the window is clean context."""
    check_seq_len(seq_len)
    content = seq_len - 2
    firsts, ends = document_bounds(corpus)
    first, end = firsts[starts], ends[starts]
    begin = np.clip(starts - (content - span) // 2, first, np.maximum(end - content, first))
    offsets = np.arange(content)[None, :]
    inside = begin[:, None] + offsets < end[:, None]
    stream_pos = np.full((len(starts), seq_len), -1, dtype=np.int64)
    stream_pos[:, 1:-1] = np.where(inside, begin[:, None] + offsets, -1)
    # [CLS], the document's tokens, then [SEP]; the cells after it are padding.
    mask = np.zeros((len(starts), seq_len), dtype=np.int32)
    mask[np.arange(seq_len)[None, :] <= 1 + inside.sum(axis=1)[:, None]] = 1
    pos = np.maximum(stream_pos, 0)
    in_span = (stream_pos >= starts[:, None]) & (stream_pos < starts[:, None] + span)
    scored = in_span & corpus.targets[pos] & (stream_pos >= 0)
    return _windows_from_positions(corpus, stream_pos, mask, scored)
