"""The memory-mapped token store: rows identical to the in-memory packing, the fast tokenizer path identical to
the tokenizer, bounded memory, atomic and race-safe preparation, lazy reading of files and Hub datasets."""

import itertools
import logging
import os
import pickle
import subprocess
import sys
import threading
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from deberta_jax.data import batches, packing, parallel_encode, store, text
from deberta_jax.data.packing import StreamRows, cut_rows, get_batch, load_or_pack, pack_stream
from deberta_jax.data.tokenizer import SpecialIds, configure, train_tokenizer
from tests.helpers import REPO

BROWN_TRAIN = REPO.parent / "shared" / "data" / "brown" / "train.txt"
SPECIAL = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)


# The packing as it was before the store (commit f669ecd), kept verbatim as the reference layout.
def old_token_stream(documents, tokenizer, sep_id):
    pieces = []
    for enc in tokenizer.encode_batch(list(documents), add_special_tokens=False):
        if enc.ids:
            if pieces:
                pieces.append(np.array([sep_id], dtype=np.int32))
            pieces.append(np.asarray(enc.ids, dtype=np.int32))
    return np.concatenate(pieces)


def old_pack_stream(stream, special, seq_len):
    content = seq_len - 2
    num_rows = -(-len(stream) // content)
    tail = len(stream) - (num_rows - 1) * content
    body = np.full(num_rows * content, special.pad, dtype=np.int32)
    body[: len(stream)] = stream
    input_ids = np.empty((num_rows, seq_len), dtype=np.int32)
    input_ids[:, 0] = special.cls
    input_ids[:, 1:-1] = body.reshape(num_rows, content)
    input_ids[:, -1] = special.sep
    if tail < content:
        input_ids[-1, tail + 1] = special.sep
        input_ids[-1, -1] = special.pad
    attention_mask = np.ones((num_rows, seq_len), dtype=np.int32)
    attention_mask[-1, tail + 2 :] = 0
    return input_ids, attention_mask


def old_pack_documents(documents, tokenizer, seq_len):
    input_ids, attention_mask = old_pack_stream(old_token_stream(documents, tokenizer, SPECIAL.sep), SPECIAL, seq_len)
    word_start = ~packing.continuation_table(tokenizer)[input_ids] & attention_mask.astype(bool)
    return packing.PackedData(input_ids, attention_mask, word_start)


def assert_same_rows(a, b):
    for name in ("input_ids", "attention_mask", "word_start"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        np.testing.assert_array_equal(x, y, err_msg=name)


@pytest.fixture(scope="module")
def documents():
    return text.load_documents(str(BROWN_TRAIN))[:30]


@pytest.fixture(scope="module")
def tokenizer(documents):
    return train_tokenizer(documents, vocab_size=2000)


@pytest.fixture
def corpus(tmp_path, documents):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")
    return path


# --- layout ---


@pytest.mark.parametrize("seq_len", [8, 9, 32])
@pytest.mark.parametrize("extra", [0, 1, -1])  # the stream ends exactly at a row end, just after, just before
def test_cut_rows_equal_the_old_packing(seq_len, extra):
    content = seq_len - 2
    stream = np.random.default_rng(seq_len).integers(5, 60000, 7 * content + (extra % content)).astype(np.uint16)
    old_ids, old_mask = old_pack_stream(stream, SPECIAL, seq_len)
    ids, mask = pack_stream(stream, SPECIAL, seq_len)
    np.testing.assert_array_equal(ids, old_ids)
    np.testing.assert_array_equal(mask, old_mask)
    rows = np.random.default_rng(0).integers(0, len(old_ids), 20)  # any order, repeats, the tail row included
    rows[:2] = [len(old_ids) - 1, 0]
    ids, mask = cut_rows(stream, rows, SPECIAL, seq_len)
    assert ids.dtype == mask.dtype == np.int32
    np.testing.assert_array_equal(ids, old_ids[rows])
    np.testing.assert_array_equal(mask, old_mask[rows])
    with pytest.raises(IndexError, match="packs into rows 0.."):
        cut_rows(stream, [len(old_ids)], SPECIAL, seq_len)


def test_cached_rows_and_batches_equal_the_old_packing(tmp_path, corpus, documents, tokenizer):
    reference = old_pack_documents(documents, tokenizer, 32)
    rows = load_or_pack(str(corpus), tokenizer, 32, tmp_path / "cache")
    assert rows.num_rows == reference.num_rows and rows.seq_len == 32
    assert_same_rows(rows.take(np.arange(rows.num_rows)), reference)
    assert_same_rows(rows, reference)  # the whole arrays, as evaluation reads them
    for step in (0, 3, 40):  # 40 wraps past the first epoch
        for process in range(2):
            assert_same_rows(get_batch(rows, 16, step, 7, process, 2), get_batch(reference, 16, step, 7, process, 2))
    evals = batches.eval_batches(rows, SPECIAL, batch_size=8, max_batches=3, process_index=0, process_count=1)
    expected = batches.eval_batches(reference, SPECIAL, batch_size=8, max_batches=3, process_index=0, process_count=1)
    for got, want in zip(evals, expected, strict=True):
        for name in want:
            np.testing.assert_array_equal(got[name], want[name])


def test_parallel_tokenization_equals_the_tokenizer(tmp_path, corpus, documents, tokenizer, monkeypatch):
    monkeypatch.setattr(parallel_encode, "TASK_CHARS", 20_000)  # several tasks, so the worker processes run
    started = []
    real = parallel_encode._Worker.__init__

    def counted(worker, *args):
        started.append(worker)
        real(worker, *args)

    monkeypatch.setattr(parallel_encode._Worker, "__init__", counted)
    rows = load_or_pack(str(corpus), tokenizer, 32, tmp_path / "cache", workers=2)
    assert len(started) == 2 and all(worker.process.returncode == 0 for worker in started)  # ended cleanly
    assert_same_rows(rows.take(np.arange(rows.num_rows)), old_pack_documents(documents, tokenizer, 32))


def test_worker_whose_reader_is_gone_exits_quietly(tokenizer, documents):
    """Ctrl-C stops the parent reading while a worker is still writing: the worker ends at once, with no
    BrokenPipeError traceback on the terminal the two share."""
    env = dict(os.environ, PYTHONPATH=str(Path(parallel_encode.__file__).resolve().parents[2]))
    worker = subprocess.Popen([sys.executable, "-m", "deberta_jax.data.parallel_encode"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    worker.stdout.close()  # the parent stops reading
    for message in ((tokenizer.to_str(), 3, np.dtype(np.int32).str), documents[:50]):
        pickle.dump(message, worker.stdin)
    worker.stdin.close()
    assert worker.wait(timeout=60) == 0
    assert worker.stderr.read() == b""


def adversarial_documents(seed: int) -> list[str]:
    """Text that stresses the space-splitting identity: control, CJK, combining and special characters, runs of
    whitespace, words past WordPiece's 100-character limit, literal special tokens, empty documents."""
    alphabet = list("abcXYZ019.,;'\"-()$ ") + ["  ", "\t", "\r", "\n", "\u00a0", "\x01", "\x1c", "\x85", "\u2028",
                                               "\u4e2d\u6587", "e\u0301", "\u0301", "\u00c9cole", "\u0130", "\u00df",
                                               "\U0001f600", "[MASK]", "[SEP]", "a" * 120, "\ufeff", "\u200b"]
    rng = np.random.default_rng(seed)
    docs = ["".join(rng.choice(alphabet, rng.integers(0, 60))) for _ in range(60)]
    return docs + ["", " ", "\x01\x02", "[MASK]"]


def test_piece_cache_equals_the_tokenizer_on_adversarial_text(tokenizer):
    cased = configure(Tokenizer.from_str(tokenizer.to_str()), lowercase=False)
    whitespace = Tokenizer.from_str(tokenizer.to_str())
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    metaspace = Tokenizer(models.WordPiece(tokenizer.get_vocab(), unk_token="[UNK]"))  # spaces become "▁"
    metaspace.pre_tokenizer, metaspace.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    metaspace.normalizer = normalizers.Lowercase()
    cases = {"project": tokenizer, "cased": cased, "whitespace": whitespace, "metaspace": metaspace}
    assert {name: parallel_encode.splits_at_spaces(t) for name, t in cases.items()} == {
        "project": True, "cased": True, "whitespace": True, "metaspace": False}
    for name, tok in cases.items():
        for seed in range(3):
            docs = adversarial_documents(seed)
            encoder = parallel_encode.DocumentEncoder(tok, SPECIAL.sep, np.int32)
            got = np.concatenate([encoder(docs[:30]), [SPECIAL.sep], encoder(docs[30:])])  # the second call hits
            np.testing.assert_array_equal(got, old_token_stream(docs, tok, SPECIAL.sep), err_msg=f"{name} {seed}")


def test_piece_cache_starts_over_when_full(tokenizer, documents):
    cache = parallel_encode.PieceCache(tokenizer, SPECIAL.sep, max_entries=50)
    pieces = " ".join(documents[:3]).split(" ")
    for start in range(0, 600, 100):
        entries = cache.lookup(pieces[start : start + 100])
        assert cache.size <= 50 + 100  # one batch of new pieces past the bound at most
        expected = old_token_stream(pieces[start : start + 100], tokenizer, -1)
        np.testing.assert_array_equal(cache.gather(entries), expected[expected >= 0])


# --- the store on disk ---


def test_store_is_a_memory_mapped_npy_of_uint16(tmp_path, corpus, documents, tokenizer):
    rows = load_or_pack(str(corpus), tokenizer, 32, tmp_path)
    assert isinstance(rows.tokens, np.memmap) and rows.tokens.dtype == np.uint16
    path = packing.cache_path(str(corpus), tokenizer, tmp_path)
    on_disk = np.load(path / store.TOKENS_FILE, mmap_mode="r")
    np.testing.assert_array_equal(on_disk, old_token_stream(documents, tokenizer, SPECIAL.sep))
    assert isinstance(rows.take([0]).input_ids, np.ndarray) and not isinstance(rows.take([0]).input_ids, np.memmap)
    assert store.token_dtype(65536) == np.uint16 and store.token_dtype(65537) == np.int32


def resident_anonymous_mb() -> float:
    """Memory this process holds itself (file pages of a memory map are the page cache's, not counted)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("RssAnon:")[1].split()[0]) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
def test_training_batches_do_not_load_the_corpus(tmp_path):
    num_tokens = 1 << 26  # 128 MB of uint16 on disk; int32 rows in memory would take 256 MB and more
    chunk = np.random.default_rng(0).integers(5, 2000, 1 << 22).astype(np.uint16)
    tokens = store.build(tmp_path / "big", itertools.repeat(chunk, num_tokens // len(chunk)), np.uint16, {})
    before = resident_anonymous_mb()
    tracemalloc.start()  # numpy reports its allocations to it: the peak catches a copy made and freed per batch
    try:
        rows = StreamRows(tokens, SPECIAL, 512, np.zeros(2000, bool))
        for step in range(20):
            batch = get_batch(rows, 32, step, seed=0)
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    grown = resident_anonymous_mb() - before
    assert batch.input_ids.shape == (32, 512) and rows.num_rows == -(-num_tokens // 510)
    assert grown < 16, f"iterating batches grew this process by {grown:.0f} MB for a 128 MB corpus"
    assert peak_mb < 16, f"building batches allocated up to {peak_mb:.0f} MB at once for a 128 MB corpus"


def test_concurrent_preparations_write_one_store(tmp_path, corpus, documents, tokenizer, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    both_writing = threading.Barrier(2, timeout=30)
    real = parallel_encode.encode_stream

    def synchronized(*args, **kwargs):  # both threads are mid-write before either can commit
        for i, piece in enumerate(real(*args, **kwargs)):
            if i == 0:
                both_writing.wait()
            yield piece

    monkeypatch.setattr(packing.parallel_encode, "encode_stream", synchronized)
    results = [None, None]

    def prepare(i):
        results[i] = load_or_pack(str(corpus), tokenizer, 32, tmp_path / "cache")

    threads = [threading.Thread(target=prepare, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert "completed by another process meanwhile" in caplog.text
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [packing.cache_path(str(corpus), tokenizer,
                                                                                      tmp_path / "cache").name]
    expected = old_pack_documents(documents, tokenizer, 32)
    for rows in results:
        assert_same_rows(rows.take(np.arange(rows.num_rows)), expected)


def dead_pid() -> int:
    process = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                             capture_output=True, text=True, check=True)
    return int(process.stdout)


@pytest.mark.parametrize("damage", ["truncated", "no manifest", "extended", "altered"])
def test_a_damaged_store_is_rebuilt_not_read(tmp_path, corpus, documents, tokenizer, damage, caplog):
    first = load_or_pack(str(corpus), tokenizer, 32, tmp_path)
    path = packing.cache_path(str(corpus), tokenizer, tmp_path)
    size = (path / store.TOKENS_FILE).stat().st_size
    del first  # close the memory map before damaging its file
    if damage == "truncated":  # e.g. a disk that filled up under a copy of the cache
        os.truncate(path / store.TOKENS_FILE, size - 10)
    elif damage == "no manifest":
        (path / store.MANIFEST_FILE).unlink()
    elif damage == "extended":
        with open(path / store.TOKENS_FILE, "ab") as f:
            f.write(b"\0\0")
    else:  # the same size, other ids: only the digest can tell
        data = bytearray((path / store.TOKENS_FILE).read_bytes())
        data[-64:] = bytes(reversed(data[-64:]))
        (path / store.TOKENS_FILE).write_bytes(bytes(data))
    rows = load_or_pack(str(corpus), tokenizer, 32, tmp_path)
    assert "is damaged" in caplog.text
    assert_same_rows(rows.take(np.arange(rows.num_rows)), old_pack_documents(documents, tokenizer, 32))
    assert [p.name for p in tmp_path.iterdir() if p.name != "corpus.txt"] == [path.name]


def test_leftovers_of_crashed_preparations_are_removed(tmp_path, corpus, tokenizer):
    path = packing.cache_path(str(corpus), tokenizer, tmp_path / "cache")
    path.parent.mkdir()
    host = __import__("socket").gethostname()
    crashed = path.with_name(f"{path.name}.tmp-{host}-{dead_pid()}-0000")
    running = path.with_name(f"{path.name}.tmp-{host}-{os.getpid()}-0000")  # another thread's, still writing
    for temp in (crashed, running):
        temp.mkdir()
        (temp / store.TOKENS_FILE).write_bytes(b"\x93NUMPY half")
    load_or_pack(str(corpus), tokenizer, 32, tmp_path / "cache")
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, running.name])


def test_text_without_tokens_commits_nothing(tmp_path, tokenizer):
    (tmp_path / "controls.txt").write_text("\x01\x02\n\n\x03\n")
    with pytest.raises(packing.NoTokensError, match=r"controls.txt.*its 2 documents contain no tokens"):
        load_or_pack(str(tmp_path / "controls.txt"), tokenizer, 16, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


# --- lazy reading ---


def test_files_are_read_lazily(tmp_path):
    path = tmp_path / "big.txt"
    with open(path, "wb") as f:
        f.write("".join(f"line {i} of document {i // 3} .\n" + ("\n" if i % 3 == 2 else "") for i in range(3000))
                .encode())
        f.write(b"caf\xe9\n")  # invalid UTF-8 at the very end
    documents = text.iter_documents(str(path))
    assert next(documents) == "line 0 of document 0 .\nline 1 of document 0 .\nline 2 of document 0 ."
    assert len(list(itertools.islice(documents, 998))) == 998  # the bad byte not reached yet
    with pytest.raises(ValueError, match=rf"{path} is not valid UTF-8 \(byte offset {path.stat().st_size - 2}"):
        list(documents)


def test_a_bom_and_crlf_are_read_as_before(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes(b"\xef\xbb\xbf = Title = \r\n body \r\n = Next = \r\n text\r\n")
    assert text.load_documents(str(path)) == ["= Title =\nbody", "= Next =\ntext"]


@pytest.mark.parametrize("offline", [False, True])
def test_hub_datasets_are_streamed(monkeypatch, offline):
    datasets = pytest.importorskip("datasets")
    rows = [" \n", " = First = \n", " body .\n", " = = Part = = \n", " = Second = \n", " more .\n"]
    calls = []

    def load_dataset(name, config, split, streaming):
        calls.append((name, config, split, streaming))
        dataset = datasets.Dataset.from_dict({"text": rows})
        return dataset.to_iterable_dataset() if streaming else dataset

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(text, "hub_probe_error", lambda: None)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1" if offline else "0")
    documents = text.iter_documents("hf:wikitext:wikitext-103-raw-v1:validation")
    assert calls == [("wikitext", "wikitext-103-raw-v1", "validation", not offline)]
    assert list(documents) == ["= First =\nbody .\n= = Part = =", "= Second =\nmore ."]


@pytest.mark.slow  # runs the benchmark end to end (without the train step: no compilation)
def test_data_pipeline_benchmark_reports_every_phase(tmp_path):
    source = tmp_path / "source.txt"
    source.write_text("\n\n".join(text.load_documents(str(BROWN_TRAIN))[:20]) + "\n")
    script = REPO / "benchmarks" / "data_pipeline.py"
    result = subprocess.run([sys.executable, str(script), "--source", str(source), "--size-mb", "3", "--small-mb", "1",
                             "--vocab", "400", "--batches", "5", "--steps", "0", "--workdir", str(tmp_path / "work")],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["corpus", "tokenizer", "prepare (full)", "prepare (small)",
                                                      "train input (full)", "train input (small)", "train input"]
    assert " MB/s; " in lines[2] and "peak resident memory" in lines[2] and "ms/batch" in lines[4]
