"""Packing documents into fixed-length rows, caching them on disk, and deterministic batching.

Packing concatenates all documents into one token stream (a `[SEP]` between documents) and cuts
it into rows `[CLS] t_1 .. t_{L-2} [SEP]`, so no tokens are wasted on padding except in the last
row. That last, partial row is kept and padded after its `[SEP]` (its attention mask is 0 there)
rather than dropped, so evaluation sees every token of small validation sets even at long
sequence lengths.

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
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from deberta_jax.data import synthetic
from deberta_jax.data.text import is_hf_spec, load_documents, resolve_files
from deberta_jax.data.tokenizer import CONTINUATION_PREFIX, SpecialIds

logger = logging.getLogger(__name__)

# Below 8 a row is mostly [CLS]/[SEP]; above 64k a length-extrapolation run would not fit in memory.
MIN_SEQ_LEN = 8
MAX_SEQ_LEN = 65536
ENCODE_CHUNK_DOCS = 256
# Bump when the packed layout changes, so caches written by older code are not reused.
CACHE_FORMAT = 1


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


def token_stream(documents: Sequence[str], tokenizer: Tokenizer, sep_id: int) -> np.ndarray:
    """Tokenizes documents (no special tokens) into one int32 stream with `sep_id` between documents."""
    pieces: list[np.ndarray] = []
    separator = np.array([sep_id], dtype=np.int32)
    # Chunks bound the memory of live Encoding objects and drive the progress bar;
    # encode_batch parallelizes across the documents of a chunk.
    with tqdm(total=len(documents), desc="tokenizing", unit="doc", disable=None) as bar:
        for start in range(0, len(documents), ENCODE_CHUNK_DOCS):
            chunk = documents[start : start + ENCODE_CHUNK_DOCS]
            for encoding in tokenizer.encode_batch(list(chunk), add_special_tokens=False):
                if encoding.ids:  # a document the normalizer empties would leave [SEP] [SEP]
                    if pieces:
                        pieces.append(separator)
                    pieces.append(np.asarray(encoding.ids, dtype=np.int32))
            bar.update(len(chunk))
    if not pieces:
        raise NoTokensError(f"its {len(documents)} documents contain no tokens after the tokenizer's normalization")
    return np.concatenate(pieces)


def pack_stream(stream: np.ndarray, special: SpecialIds, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Cuts a token stream into `[CLS] content [SEP]` rows; returns (input_ids, attention_mask)."""
    check_seq_len(seq_len)
    content = seq_len - 2
    num_rows = -(-len(stream) // content)  # ceil: the partial tail becomes one padded row
    tail = len(stream) - (num_rows - 1) * content  # content tokens in the last row, 1..content
    body = np.full(num_rows * content, special.pad, dtype=np.int32)
    body[: len(stream)] = stream
    input_ids = np.empty((num_rows, seq_len), dtype=np.int32)
    input_ids[:, 0] = special.cls
    input_ids[:, 1:-1] = body.reshape(num_rows, content)
    input_ids[:, -1] = special.sep
    if tail < content:  # the last row closes with [SEP] right after its tokens, then padding
        input_ids[-1, tail + 1] = special.sep
        input_ids[-1, -1] = special.pad
    attention_mask = np.ones((num_rows, seq_len), dtype=np.int32)
    attention_mask[-1, tail + 2 :] = 0
    return input_ids, attention_mask


def pack_documents(documents: Sequence[str], tokenizer: Tokenizer, seq_len: int) -> PackedData:
    """Tokenizes and packs documents into `[CLS] ... [SEP]` rows of exactly `seq_len` tokens."""
    check_seq_len(seq_len)
    special = SpecialIds.from_tokenizer(tokenizer)
    stream = token_stream(documents, tokenizer, special.sep)
    input_ids, attention_mask = pack_stream(stream, special, seq_len)
    word_start = ~continuation_table(tokenizer)[input_ids] & attention_mask.astype(bool)
    return PackedData(input_ids, attention_mask, word_start)


def _source_fingerprint(spec: str) -> object:
    """What identifies the input text: the spec itself for Hub data, the canonical spec and generator version
    for synthetic data, else each file's path, size and mtime."""
    if synthetic.is_synthetic_spec(spec):
        return {"synthetic": synthetic.canonical_spec(spec), "generator": synthetic.GENERATOR_VERSION}
    if is_hf_spec(spec):
        return {"hf": spec}
    return [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in resolve_files(spec)]


def cache_path(spec: str, tokenizer: Tokenizer, seq_len: int, cache_dir: str | Path) -> Path:
    """Cache file for these inputs; any change to the files, tokenizer or seq_len gives a new name."""
    key = json.dumps({"format": CACHE_FORMAT, "source": _source_fingerprint(spec), "seq_len": seq_len})
    digest = hashlib.sha256(key.encode())
    digest.update(tokenizer.to_str().encode())
    return Path(cache_dir) / f"packed-L{seq_len}-{digest.hexdigest()[:24]}.npz"


def _save_atomic(path: Path, packed: PackedData) -> None:
    """Writes to a temporary file and renames it, so a crash never leaves a truncated cache behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **dataclasses.asdict(packed))
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_or_pack(spec: str, tokenizer: Tokenizer, seq_len: int, cache_dir: str | Path) -> PackedData:
    """Returns the packed rows for `spec`, reading them from `cache_dir` when an identical run cached them.

    Hub data is keyed by its spec only: if the dataset changes upstream, delete the cache file.
    """
    path = cache_path(spec, tokenizer, seq_len, cache_dir)
    if path.is_file():
        logger.info("data cache hit: %s -> %s", spec, path)
        with np.load(path) as arrays:
            return PackedData(**{field.name: arrays[field.name] for field in dataclasses.fields(PackedData)})
    logger.info("data cache miss: packing %s into %s", spec, path)
    try:
        packed = pack_documents(load_documents(spec), tokenizer, seq_len)
    except NoTokensError as err:
        raise NoTokensError(f"data spec {spec!r}: {err}; give text with words in it") from None
    _save_atomic(path, packed)
    return packed


@functools.lru_cache(maxsize=4)
def _epoch_permutation(num_rows: int, seed: int, epoch: int) -> np.ndarray:
    """Row order of one epoch; cached because consecutive steps almost always share an epoch."""
    permutation = np.random.default_rng([seed, epoch]).permutation(num_rows)
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
