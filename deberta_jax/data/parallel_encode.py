"""Documents to one token-id stream, `[SEP]` between documents: fast, in parallel and in bounded memory.

The tokenizers pipeline (BERT normalization, pre-tokenization, WordPiece) encodes about 2 MB of text per second
on one core of the 2-core development machine (3 MB/s on both). Natural text repeats itself, though: almost
every space-separated piece ("word") of a large corpus has been seen before. For tokenizers whose pipeline
cuts the text at every space anyway (`splits_at_spaces`: per-character normalizers, whitespace-splitting
pre-tokenizers, WordPiece), the ids of a document are the ids of its pieces one after the other, so
`PieceCache` encodes each distinct piece once and assembles documents from cached ids with numpy (17 MB/s
on one core once the frequent pieces are in). Any other tokenizer (SentencePiece's Metaspace, byte-level BPE,
a truncating one) is encoded document by document, exactly as `Tokenizer.encode_batch` does.

`encode_stream` cuts the documents into tasks of about `TASK_CHARS` characters and, when there is more than
one, hands them round-robin to worker processes (`python -m deberta_jax.data.parallel_encode`, which import only
numpy and tokenizers, not the caller's main module), keeping one task in flight per worker: memory stays a
few tasks plus each worker's cache, whatever the corpus size, and the pieces come back in document order.
"""

from __future__ import annotations

import collections
import itertools
import json
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

TASK_CHARS = 1 << 21  # characters of text per worker task (about 2 MB)
# Bounds each worker's cache to about 200 MB (measured: 400 bytes per entry for 7-letter words of 4 tokens,
# key, dict slot and arrays included); when full it starts over, and the frequent pieces are back within a task.
MAX_CACHE_ENTRIES = 1 << 19
WORKER_TIMEOUT_S = 30.0  # for a worker to exit once its input is closed

# Normalizers that map each character on its own (or decompose it), and pre-tokenizers that split at every
# whitespace character: under both, encoding a text equals encoding its space-separated pieces one by one.
_PER_CHARACTER_NORMALIZERS = {"BertNormalizer", "Lowercase", "NFD", "NFKD", "StripAccents"}
_WHITESPACE_PRE_TOKENIZERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}


def _all_of(node: dict | None, allowed: set[str], children: str) -> bool:
    if node is None:
        return True
    if node["type"] == "Sequence":
        return all(_all_of(child, allowed, children) for child in node[children])
    return node["type"] in allowed


def splits_at_spaces(tokenizer: Tokenizer) -> bool:
    """True when encoding a text gives the ids of its space-separated pieces, encoded one by one, in order.

    Holds for WordPiece behind per-character normalizers and whitespace-splitting pre-tokenizers (BERT's and
    this project's tokenizers), without truncation or padding, and with added tokens that contain no
    whitespace and do not strip it; `tests/data/test_data_store.py` checks the identity on adversarial text.
    """
    config = json.loads(tokenizer.to_str())
    added_ok = all(not token["lstrip"] and not token["rstrip"] and not any(c.isspace() for c in token["content"])
                   for token in config["added_tokens"])
    return (config["model"]["type"] == "WordPiece" and config["truncation"] is None and config["padding"] is None
            and added_ok and _all_of(config["normalizer"], _PER_CHARACTER_NORMALIZERS, "normalizers")
            and config["pre_tokenizer"] is not None
            and _all_of(config["pre_tokenizer"], _WHITESPACE_PRE_TOKENIZERS, "pretokenizers"))


class PieceCache:
    """Token ids of space-separated pieces of text, each piece encoded by the tokenizer once.

    Entry e holds ids `flat[starts[e] : starts[e] + lengths[e]]`; entry 0 is the document separator.
    """

    def __init__(self, tokenizer: Tokenizer, sep_id: int, max_entries: int = MAX_CACHE_ENTRIES):
        self.tokenizer, self.sep_id, self.max_entries = tokenizer, sep_id, max_entries
        self._reset()

    def _reset(self) -> None:
        self.index: dict[str, int] = {}
        self.starts = np.zeros(1024, np.int64)
        self.lengths = np.zeros(1024, np.int64)
        self.flat = np.zeros(4096, np.int32)
        self.size = self.used = 0
        self._append([[self.sep_id]])

    def _append(self, ids: list[list[int]]) -> None:
        lengths = np.fromiter(map(len, ids), np.int64, len(ids))
        total = int(lengths.sum())
        if self.size + len(ids) > len(self.starts):
            capacity = max(2 * len(self.starts), self.size + len(ids))
            self.starts, self.lengths = np.resize(self.starts, capacity), np.resize(self.lengths, capacity)
        if self.used + total > len(self.flat):
            self.flat = np.resize(self.flat, max(2 * len(self.flat), self.used + total))
        new = slice(self.size, self.size + len(ids))
        self.starts[new] = self.used + np.cumsum(lengths) - lengths
        self.lengths[new] = lengths
        self.flat[self.used : self.used + total] = np.fromiter(itertools.chain.from_iterable(ids), np.int32, total)
        self.size += len(ids)
        self.used += total

    def lookup(self, pieces: list[str]) -> np.ndarray:
        """The entry of every piece, encoding (and adding) the pieces not seen yet."""
        if self.size > self.max_entries:
            self._reset()
        get = self.index.get
        entries = np.fromiter(map(get, pieces, itertools.repeat(-1)), np.int64, len(pieces))
        missing = np.flatnonzero(entries < 0)
        if len(missing):
            positions = missing.tolist()
            new = list(dict.fromkeys([pieces[i] for i in positions]))
            encodings = self.tokenizer.encode_batch(new, add_special_tokens=False)
            self.index.update(zip(new, range(self.size, self.size + len(new))))
            self._append([encoding.ids for encoding in encodings])
            entries[missing] = [get(pieces[i]) for i in positions]
        return entries

    def gather(self, entries: np.ndarray) -> np.ndarray:
        """The ids of `entries`, one after the other."""
        lengths = self.lengths[entries]
        ends = np.cumsum(lengths)
        offsets = np.repeat(self.starts[entries] - (ends - lengths), lengths)
        return self.flat[np.arange(int(ends[-1]) if len(ends) else 0) + offsets]


class DocumentEncoder:
    """Encodes a list of documents into one id array (`dtype`), `sep_id` between non-empty documents."""

    def __init__(self, tokenizer: Tokenizer, sep_id: int, dtype: np.dtype):
        self.tokenizer, self.sep_id, self.dtype = tokenizer, sep_id, np.dtype(dtype)
        self.cache = PieceCache(tokenizer, sep_id) if splits_at_spaces(tokenizer) else None

    def __call__(self, documents: list[str]) -> np.ndarray:
        if self.cache is None:
            return self._encode_whole(documents)
        pieces, counts = [], []
        for document in documents:
            # "\n" (between a document's lines) is whitespace to every tokenizer `splits_at_spaces` admits.
            split = document.replace("\n", " ").split(" ")
            pieces += split
            counts.append(len(split))
        entries = self.cache.lookup(pieces)
        firsts = np.cumsum(counts) - counts  # every document has at least one piece, maybe ""
        tokens = np.add.reduceat(self.cache.lengths[entries], firsts)
        nonempty = np.flatnonzero(tokens)  # a document the normalizer empties would leave [SEP] [SEP]
        entries = np.insert(entries, firsts[nonempty[1:]], 0)  # entry 0: the separator
        return self.cache.gather(entries).astype(self.dtype)

    def _encode_whole(self, documents: list[str]) -> np.ndarray:
        ids: list[list[int]] = []
        for encoding in self.tokenizer.encode_batch(documents, add_special_tokens=False):
            if encoding.ids:
                if ids:
                    ids.append([self.sep_id])
                ids.append(encoding.ids)
        return np.fromiter(itertools.chain.from_iterable(ids), self.dtype, sum(map(len, ids)))


def _tasks(documents: Iterable[str], task_chars: int) -> Iterator[list[str]]:
    task, size = [], 0
    for document in documents:
        task.append(document)
        size += len(document)
        if size >= task_chars:
            yield task
            task, size = [], 0
    if task:
        yield task


class _Worker:
    """A `python -m deberta_jax.data.parallel_encode` process: pickled document lists in, id arrays out."""

    def __init__(self, tokenizer: Tokenizer, sep_id: int, dtype: np.dtype):
        root = str(Path(__file__).resolve().parents[2])  # where `deberta_jax` imports from, installed or not
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
                   TOKENIZERS_PARALLELISM="false")  # the processes are the parallelism
        self.process = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env)
        self.send((tokenizer.to_str(), sep_id, np.dtype(dtype).str))

    def send(self, message: object) -> None:
        pickle.dump(message, self.process.stdin, protocol=pickle.HIGHEST_PROTOCOL)
        self.process.stdin.flush()

    def receive(self) -> np.ndarray:
        try:
            return pickle.load(self.process.stdout)
        except EOFError:
            code = self.process.wait()
            raise RuntimeError(f"tokenizer worker process {self.process.pid} exited with code {code} "
                               "(its error, if any, is printed above)") from None

    def close(self, kill: bool) -> None:
        """Ends the process: by closing its input once all results are in, else (an error upstream) by killing it."""
        try:
            if not kill:
                self.process.stdin.close()
                self.process.wait(timeout=WORKER_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired):
            kill = True
        if kill:
            self.process.kill()
            self.process.wait()


def encode_stream(documents: Iterable[str], tokenizer: Tokenizer, sep_id: int, dtype: np.dtype,
                  workers: int) -> Iterator[np.ndarray]:
    """The token stream of `documents` in consecutive pieces (concatenated, they are the whole stream).

    With `workers` > 1 and more than one task of text, tasks are encoded by that many worker processes;
    otherwise in this process.
    """
    tasks = _tasks(documents, TASK_CHARS)
    head = list(itertools.islice(tasks, 2))
    tasks = itertools.chain(head, tasks)
    if workers > 1 and len(head) > 1:
        results = _parallel(tasks, tokenizer, sep_id, dtype, workers)
    else:
        encoder = DocumentEncoder(tokenizer, sep_id, dtype)
        results = map(encoder, tasks)
    separator = np.array([sep_id], dtype)
    started = False
    for ids in results:
        if len(ids):
            if started:
                yield separator
            started = True
            yield ids


def _parallel(tasks: Iterator[list[str]], tokenizer: Tokenizer, sep_id: int, dtype: np.dtype,
              workers: int) -> Iterator[np.ndarray]:
    """Results of `tasks` in order; task k goes to worker k % workers, which holds at most one task at a time."""
    pool = [_Worker(tokenizer, sep_id, dtype) for _ in range(workers)]
    finished = False
    try:
        pending: collections.deque[_Worker] = collections.deque()
        for k, task in enumerate(tasks):  # the next task is read before waiting for the oldest result
            if len(pending) == workers:
                yield pending.popleft().receive()  # that is worker k % workers, now idle
            pool[k % workers].send(task)
            pending.append(pool[k % workers])
        while pending:
            yield pending.popleft().receive()
        finished = True
    finally:
        for worker in pool:
            worker.close(kill=not finished)


def _serve() -> None:
    """Worker loop: the first message is (tokenizer JSON, sep id, dtype), then document lists until EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent ends us
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print in a library must not corrupt the pickled replies
    source = sys.stdin.buffer
    tokenizer_json, sep_id, dtype = pickle.load(source)
    encoder = DocumentEncoder(Tokenizer.from_str(tokenizer_json), sep_id, np.dtype(dtype))
    while True:
        try:
            documents = pickle.load(source)
        except EOFError:
            return
        try:
            pickle.dump(encoder(documents), out, protocol=pickle.HIGHEST_PROTOCOL)
            out.flush()
        except BrokenPipeError:
            # The parent stopped reading (interrupted, or gone): end now, without a traceback on its terminal and
            # without the interpreter flushing the dead pipe again at exit.
            os._exit(0)


if __name__ == "__main__":
    _serve()
