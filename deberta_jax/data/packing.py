"""Packing documents into fixed-length rows, the on-disk token cache, and deterministic batching.

Packing concatenates all documents into one token stream (a `[SEP]` between documents) and cuts
it into rows `[CLS] t_1 .. t_{L-2} [SEP]`, so no tokens are wasted on padding except in the last
row. That last, partial row is kept and padded after its `[SEP]` (its attention mask is 0 there)
rather than dropped, so evaluation sees every token of small validation sets even at long
sequence lengths.

The cache (`load_or_pack`) holds only that stream, memory-mapped (`store`), and rows are cut from it
when a batch asks for them (`StreamRows`): neither tokenizing a corpus (streamed, in parallel:
`encoding`) nor training on it holds the corpus in memory, and the rows are those `pack_stream` cuts.

Batching is a pure function of (seed, step): resuming at step s yields exactly the batches of an
uninterrupted run, with no data-loader state to checkpoint.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from deberta_jax import storage
from deberta_jax.data import parallel_encode, store, synthetic
from deberta_jax.data.text import is_hf_spec, iter_documents, resolve_files
from deberta_jax.data.tokenizer import CONTINUATION_PREFIX, SpecialIds

logger = logging.getLogger(__name__)

# Below 8 a row is mostly [CLS]/[SEP]; above 64k a length-extrapolation run would not fit in memory.
MIN_SEQ_LEN = 8
MAX_SEQ_LEN = 65536
# Bump when the cached data or its layout changes, so caches written by older code are not reused.
# 2: a memory-mapped token stream (`store`) instead of packed rows in an .npz file.
CACHE_FORMAT = 2


@dataclasses.dataclass(frozen=True, eq=False)  # arrays have no single truth value
class PackedData:
    """Packed rows; every array is [num_rows, seq_len]."""

    input_ids: np.ndarray  # int32
    attention_mask: np.ndarray  # int32, 1 for real tokens, 0 for padding in the last row
    word_start: np.ndarray  # bool, True unless the token is a `##` continuation or padding

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    def take(self, rows: np.ndarray) -> PackedData:
        """Selects rows, e.g. one batch."""
        return PackedData(self.input_ids[rows], self.attention_mask[rows], self.word_start[rows])


def check_seq_len(seq_len: int) -> None:
    """Rejects lengths that cannot hold [CLS] + content + [SEP] or that no experiment here needs."""
    if not MIN_SEQ_LEN <= seq_len <= MAX_SEQ_LEN:
        raise ValueError(
            f"sequence length {seq_len} is out of range: need {MIN_SEQ_LEN} <= length <= {MAX_SEQ_LEN} "
            "(each row is [CLS] + length-2 tokens + [SEP])"
        )


def continuation_table(tokenizer: Tokenizer) -> np.ndarray:
    """Boolean lookup by token id: True for `##` pieces that continue the previous token's word."""
    vocab = tokenizer.get_vocab()
    table = np.zeros(tokenizer.get_vocab_size(), dtype=bool)
    for token, token_id in vocab.items():
        table[token_id] = token.startswith(CONTINUATION_PREFIX)
    return table


class NoTokensError(ValueError):
    """Text that tokenizes to nothing (e.g. only control characters)."""


def token_stream(documents: Iterable[str], tokenizer: Tokenizer, sep_id: int) -> np.ndarray:
    """Tokenizes documents (no special tokens) into one int32 stream with `sep_id` between documents.

    In this process and in memory: for evaluation texts; corpora go through `load_or_pack`.
    """
    documents = list(documents)
    pieces = list(parallel_encode.encode_stream(documents, tokenizer, sep_id, np.int32, workers=1))
    if not pieces:
        raise NoTokensError(f"its {len(documents)} documents contain no tokens after the tokenizer's normalization")
    return np.concatenate(pieces)


def num_packed_rows(num_tokens: int, seq_len: int) -> int:
    """Rows of `seq_len` that a stream of `num_tokens` packs into (the partial tail is one padded row)."""
    return -(-num_tokens // (seq_len - 2))


def cut_rows(stream: np.ndarray, rows: np.ndarray, special: SpecialIds, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows `rows` of the packing of `stream` as (input_ids, attention_mask), int32 [len(rows), seq_len].

    Row r is `[CLS] stream[r*C : (r+1)*C] [SEP]` with C = seq_len - 2; the last row, if the stream ends
    inside it, closes with [SEP] right after its tokens and is padded (attention mask 0) after that. Reads
    only those rows' tokens, so `stream` may be a memory map of any size.
    """
    check_seq_len(seq_len)
    content = seq_len - 2
    rows = np.asarray(rows, dtype=np.int64)
    num_rows = num_packed_rows(len(stream), seq_len)
    if rows.size and (rows.min() < 0 or rows.max() >= num_rows):
        raise IndexError(f"rows {rows.min()}..{rows.max()} requested; the stream packs into rows 0..{num_rows - 1}")
    whole = len(stream) // content  # rows filled with stream tokens to the end
    input_ids = np.empty((len(rows), seq_len), dtype=np.int32)
    input_ids[:, 0] = special.cls
    input_ids[:, -1] = special.sep
    attention_mask = np.ones((len(rows), seq_len), dtype=np.int32)
    is_whole = rows < whole
    input_ids[is_whole, 1:-1] = stream[: whole * content].reshape(whole, content)[rows[is_whole]]
    tail = ~is_whole
    if tail.any():
        rest = stream[whole * content :]
        input_ids[tail, 1 : 1 + len(rest)] = rest
        input_ids[tail, 1 + len(rest)] = special.sep
        input_ids[tail, 2 + len(rest) :] = special.pad
        attention_mask[tail, 2 + len(rest) :] = 0
    return input_ids, attention_mask


def pack_stream(stream: np.ndarray, special: SpecialIds, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cuts a token stream into `[CLS] content [SEP]` rows; returns (input_ids, attention_mask)."""
    check_seq_len(seq_len)
    return cut_rows(stream, np.arange(num_packed_rows(len(stream), seq_len)), special, seq_len)


class StreamRows:
    """The rows `pack_stream` cuts from `tokens`, built only when asked for (`take`): `tokens` may be a memory
    map of a whole corpus.

    Reads like `PackedData` (num_rows, seq_len, take; batches come from `take`). The whole arrays
    `input_ids`, `attention_mask` and `word_start` are built on every access, for evaluation texts; the
    memory-mapped stream itself is `tokens`.
    """

    def __init__(self, tokens: np.ndarray, special: SpecialIds, seq_len: int, continuation: np.ndarray):
        check_seq_len(seq_len)
        if not len(tokens):
            raise ValueError("StreamRows needs a non-empty token stream")
        self.tokens, self.special, self.continuation = tokens, special, continuation
        self._seq_len = seq_len

    @property
    def num_rows(self) -> int:
        return num_packed_rows(len(self.tokens), self._seq_len)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    def take(self, rows: np.ndarray) -> PackedData:
        """Builds the selected rows, e.g. one batch, in memory."""
        input_ids, attention_mask = cut_rows(self.tokens, rows, self.special, self._seq_len)
        word_start = ~self.continuation[input_ids] & attention_mask.astype(bool)
        return PackedData(input_ids, attention_mask, word_start)

    @property
    def input_ids(self) -> np.ndarray:
        return cut_rows(self.tokens, np.arange(self.num_rows), self.special, self._seq_len)[0]

    @property
    def attention_mask(self) -> np.ndarray:
        return cut_rows(self.tokens, np.arange(self.num_rows), self.special, self._seq_len)[1]

    @property
    def word_start(self) -> np.ndarray:
        return self.take(np.arange(self.num_rows)).word_start


def pack_documents(documents: Iterable[str], tokenizer: Tokenizer, seq_len: int) -> PackedData:
    """Tokenizes and packs documents into `[CLS] ... [SEP]` rows of exactly `seq_len` tokens, in memory."""
    check_seq_len(seq_len)
    special = SpecialIds.from_tokenizer(tokenizer)
    rows = StreamRows(token_stream(documents, tokenizer, special.sep), special, seq_len, continuation_table(tokenizer))
    return rows.take(np.arange(rows.num_rows))


def source_fingerprint(spec: str, by_content: bool = False) -> object:
    """What identifies the input text: the spec itself for Hub data, the canonical spec and generator version
    for synthetic data, else each file's `storage.identity` (locally its resolved path, size and mtime; in a
    bucket its URL, size and generation, which every write of the object changes): cheap for a corpus larger
    than memory, but a copy or a rewrite of the same text counts as new text.

    `by_content`: each file's `storage.checksum` instead, which reads every local file once and stays the same for
    the same bytes anywhere: for keys of results that take hours to compute from small files, like the length
    study's, where a fresh copy of the data must not throw them away."""
    if synthetic.is_synthetic_spec(spec):
        return {"synthetic": synthetic.canonical_spec(spec), "generator": synthetic.GENERATOR_VERSION}
    if is_hf_spec(spec):
        return {"hf": spec}
    key = storage.checksum if by_content else storage.identity
    return [key(path) for path in resolve_files(spec)]


def same_source(a: str, b: str) -> bool:
    """Whether two data specs name the same text, however spelled (`source_fingerprint`)."""
    return a == b or source_fingerprint(a) == source_fingerprint(b)


def cache_path(spec: str, tokenizer: Tokenizer, cache_dir: str | Path) -> Path:
    """Cache directory (a `store`) of the token stream of `spec`; any change to the files or the tokenizer gives a
    new name. The stream does not depend on the row length (rows are cut from it when read), so runs at every
    `seq_len` share one store."""
    key = json.dumps({"format": CACHE_FORMAT, "source": source_fingerprint(spec)})
    digest = hashlib.sha256(key.encode())
    digest.update(tokenizer.to_str().encode())
    return Path(cache_dir) / f"tokens-{digest.hexdigest()[:24]}"


def load_or_pack(spec: str, tokenizer: Tokenizer, seq_len: int, cache_dir: str | Path,
                 workers: int | None = None) -> StreamRows:
    """The packed rows of `spec`, cut on demand from its memory-mapped token stream in `cache_dir`; on a cache
    miss the text is read lazily and tokenized by `workers` processes (default: one per CPU) into the cache.

    Hub data is keyed by its spec only: if the dataset changes upstream, delete the cache directory.
    """
    check_seq_len(seq_len)
    special = SpecialIds.from_tokenizer(tokenizer)
    path = cache_path(spec, tokenizer, cache_dir)
    tokens = store.load(path)
    if tokens is not None:
        logger.info("data cache hit: %s -> %s", spec, path)
    else:
        logger.info("data cache miss: tokenizing %s into %s", spec, path)
        documents = _Counted(tqdm(iter_documents(spec), desc="tokenizing", unit="doc", disable=None))
        vocab_size = tokenizer.get_vocab_size()
        dtype = store.token_dtype(vocab_size)
        pieces = parallel_encode.encode_stream(documents, tokenizer, special.sep, dtype, workers or os.cpu_count() or 1)
        info = {"format": CACHE_FORMAT, "spec": spec, "vocab_size": vocab_size}
        tokens = store.build(path, _nonempty(pieces, spec, documents), dtype, info)
    return StreamRows(tokens, special, seq_len, continuation_table(tokenizer))


class _Counted:
    """Counts the items passing through, for messages about them."""

    def __init__(self, items: Iterable[str]):
        self.items, self.count = items, 0

    def __iter__(self) -> Iterator[str]:
        for item in self.items:
            self.count += 1
            yield item


def _nonempty(pieces: Iterable[np.ndarray], spec: str, documents: _Counted) -> Iterator[np.ndarray]:
    """`pieces`, failing at the end (before the store is committed) if they hold no token."""
    empty = True
    for piece in pieces:
        empty = empty and not len(piece)
        yield piece
    if empty:
        raise NoTokensError(f"data spec {spec!r}: its {documents.count} documents contain no tokens after the "
                            "tokenizer's normalization; give text with words in it")


@functools.lru_cache(maxsize=2)
def _epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """Row order of one epoch; cached because consecutive steps almost always share an epoch (two: a batch may
    straddle an epoch boundary). Held as int32 when the rows allow: it is the one array of training's input
    whose size grows with the corpus (4 bytes per row)."""
    permutation = np.random.default_rng([seed, epoch]).permutation(num_rows)
    if num_rows <= np.iinfo(np.int32).max:
        permutation = permutation.astype(np.int32)
    permutation.flags.writeable = False
    return permutation


def batch_indices(num_rows: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Row indices of global batch `step`: positions step*B .. step*B+B-1 of the epoch-wise shuffled order.

    Epoch e visits every row once, in the order `default_rng([seed, e]).permutation(num_rows)`;
    a batch that straddles an epoch boundary takes the last rows of one and the first of the next.
    """
    if num_rows <= 0 or batch_size <= 0 or step < 0 or seed < 0:
        raise ValueError(
            f"batch_indices needs num_rows > 0, batch_size > 0, step >= 0, seed >= 0; "
            f"got num_rows={num_rows}, batch_size={batch_size}, step={step}, seed={seed}"
        )
    positions = step * batch_size + np.arange(batch_size, dtype=np.int64)
    epochs, offsets = np.divmod(positions, num_rows)
    indices = np.empty(batch_size, dtype=np.int64)
    for epoch in np.unique(epochs):
        in_epoch = epochs == epoch
        indices[in_epoch] = _epoch_permutation(num_rows, seed, int(epoch))[offsets[in_epoch]]
    return indices


def process_share(global_indices: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """This process's contiguous slice of a global batch; the slices of all processes partition it.

    Contiguous slices in process order match how JAX assembles a global array from
    process-local data along the batch axis.
    """
    batch_size = len(global_indices)
    if process_count <= 0 or not 0 <= process_index < process_count or batch_size % process_count:
        raise ValueError(
            f"cannot split a global batch of {batch_size} rows over {process_count} processes "
            f"(process_index={process_index}); the global batch size must be a multiple of the process count"
        )
    per_process = batch_size // process_count
    return global_indices[process_index * per_process : (process_index + 1) * per_process]


def get_batch(
    packed: PackedData, batch_size: int, step: int, seed: int, process_index: int = 0, process_count: int = 1
) -> PackedData:
    """The rows of global batch `step` that belong to this process."""
    indices = batch_indices(packed.num_rows, batch_size, step, seed)
    return packed.take(process_share(indices, process_index, process_count))
