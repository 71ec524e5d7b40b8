"""Tokenizer training, packing, the on-disk cache and resumable batching."""

import logging

import numpy as np
import pytest
from tokenizers import Tokenizer, models

from deberta_jax.data import packing
from deberta_jax.data.masking import mask_tokens, masking_rngs
from deberta_jax.data.packing import PackedData, batch_indices, get_batch, load_or_pack, pack_documents, process_share
from deberta_jax.data.text import DocumentStream, load_documents
from deberta_jax.data.tokenizer import SPECIAL_TOKENS, SpecialIds, load_tokenizer, save_tokenizer, train_tokenizer
from tests.helpers import REPO

BROWN_TRAIN = REPO.parent / "shared" / "data" / "brown" / "train.txt"
SPECIAL = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)


@pytest.fixture(scope="module")
def documents():
    return load_documents(str(BROWN_TRAIN))[:40]  # a subset keeps training under a second


@pytest.fixture(scope="module")
def tokenizer(documents):
    return train_tokenizer(documents, vocab_size=2000)


# --- tokenizer ---


def test_special_ids_are_fixed(tokenizer):
    assert SpecialIds.from_tokenizer(tokenizer) == SPECIAL
    assert [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tokenizer.get_vocab_size() == 2000
    assert tokenizer.encode("The jury said").tokens == ["[CLS]", "the", "jury", "said", "[SEP]"]


def test_ascii_is_never_unknown(tokenizer):
    # Brown has no "@", "<" or "="; WikiText (the out-of-domain set) is full of them.
    ids = tokenizer.encode("a @-@ b <unk> = = c = = ~^|", add_special_tokens=False).ids
    assert SPECIAL.unk not in ids


def test_training_is_deterministic(documents, tokenizer):
    # Plain `tokenizers` training differs between runs on this very subset (huggingface/tokenizers#1794).
    assert train_tokenizer(documents, vocab_size=2000).to_str() == tokenizer.to_str()


def test_training_from_a_stream_equals_training_from_a_list(documents, tokenizer, tmp_path):
    """train.py trains on `DocumentStream`, read twice from disk, so the corpus is never held; same vocabulary."""
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(documents) + "\n")
    stream = DocumentStream(str(path))
    assert list(stream) == documents  # the file holds exactly the fixture's documents
    assert train_tokenizer(stream, vocab_size=2000).to_str() == tokenizer.to_str()
    with pytest.raises(TypeError, match="reads its documents twice"):
        train_tokenizer(iter(documents), vocab_size=2000)
    with pytest.raises(ValueError, match="zero documents"):
        train_tokenizer([], vocab_size=2000)


def test_only_real_special_tokens_are_special(tokenizer):
    assert sorted(tokenizer.get_added_tokens_decoder()) == [0, 1, 2, 3, 4]
    ids = tokenizer.encode("unbelievably", add_special_tokens=False).ids
    assert len(ids) > 1 and tokenizer.decode(ids) == "unbelievably"


def test_save_and_load(tmp_path, tokenizer):
    path = tmp_path / "sub" / "tokenizer.json"
    save_tokenizer(tokenizer, path)
    assert load_tokenizer(path).to_str() == tokenizer.to_str()
    with pytest.raises(FileNotFoundError, match="train_tokenizer"):
        load_tokenizer(tmp_path / "missing.json")


def test_missing_special_token_is_named():
    bare = Tokenizer(models.WordPiece({"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "a": 4}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match=r"no \[MASK\] token"):
        SpecialIds.from_tokenizer(bare)


def test_vocab_size_too_small(documents):
    with pytest.raises(ValueError, match="vocab_size=5"):
        train_tokenizer(documents, vocab_size=5)


# --- packing ---


@pytest.fixture(scope="module")
def packed(documents, tokenizer):
    return pack_documents(documents, tokenizer, seq_len=64)


def encode(tokenizer, documents):
    return [enc.ids for enc in tokenizer.encode_batch(documents, add_special_tokens=False)]


def test_rows_are_cls_content_sep(packed):
    assert packed.input_ids.dtype == np.int32 and packed.attention_mask.dtype == np.int32
    assert packed.word_start.dtype == bool
    assert packed.input_ids.shape == packed.attention_mask.shape == packed.word_start.shape
    assert packed.seq_len == 64
    assert (packed.input_ids[:, 0] == SPECIAL.cls).all()
    assert (packed.input_ids[:-1, -1] == SPECIAL.sep).all()
    assert packed.attention_mask[:-1].all()
    # The tail row: [CLS] tokens [SEP], then padding that the attention mask hides.
    last_ids, last_mask = packed.input_ids[-1], packed.attention_mask[-1]
    length = int(last_mask.sum())
    assert (last_mask[:length] == 1).all() and (last_mask[length:] == 0).all()
    assert last_ids[length - 1] == SPECIAL.sep and (last_ids[length:] == SPECIAL.pad).all()


def test_content_is_the_document_stream(packed, documents, tokenizer):
    content = np.concatenate([row[1 : mask.sum() - 1] for row, mask in zip(packed.input_ids, packed.attention_mask)])
    encoded = encode(tokenizer, documents)
    expected = sum(([SPECIAL.sep, *ids] for ids in encoded[1:]), encoded[0])
    np.testing.assert_array_equal(content, expected)
    assert (content == SPECIAL.sep).sum() == len(documents) - 1  # one separator between documents
    assert not np.isin(content, [SPECIAL.pad, SPECIAL.cls]).any()


def test_word_start_marks_non_continuation_tokens(packed, tokenizer):
    real = packed.attention_mask.astype(bool)
    continuation = np.vectorize(lambda i: tokenizer.id_to_token(int(i)).startswith("##"))(packed.input_ids)
    np.testing.assert_array_equal(packed.word_start, real & ~continuation)
    assert 0 < (~packed.word_start[real]).mean() < 0.5


def test_exact_multiple_has_no_padding(tokenizer):
    text = "the grand jury said friday that the election was conducted well ."
    stream_len = len(encode(tokenizer, [text])[0])
    packed = pack_documents([text], tokenizer, seq_len=stream_len + 2)
    assert packed.num_rows == 1 and packed.attention_mask.all() and packed.input_ids[0, -1] == SPECIAL.sep


@pytest.mark.parametrize("seq_len", [4, 7, 10**6])
def test_bad_seq_len(tokenizer, seq_len):
    with pytest.raises(ValueError, match=rf"sequence length {seq_len} is out of range"):
        pack_documents(["some text"], tokenizer, seq_len)


def test_whole_word_masking_on_packed_rows(packed):
    batch = mask_tokens(
        packed.input_ids, packed.attention_mask, SPECIAL, 2000, masking_rngs(0, 0, range(packed.num_rows)),
        word_start=packed.word_start,
    )
    selected = batch.weights > 0
    # A selected continuation piece implies its predecessor (same word) is selected too,
    # unless the predecessor is [CLS], i.e. packing cut the word at a row start.
    continuation = selected & ~packed.word_start
    previous_selected = np.roll(selected, 1, axis=1)
    previous_is_cls = np.roll(packed.input_ids, 1, axis=1) == SPECIAL.cls
    assert continuation.any()
    assert (previous_selected | previous_is_cls)[continuation].all()


# --- cache ---


@pytest.fixture
def corpus(tmp_path):
    return tmp_path / "corpus.txt"


def write_corpus(path, documents):
    path.write_text("\n\n".join(documents) + "\n", encoding="utf-8")


def counting_packer(monkeypatch):
    """Records the directory of every store built (every cache miss)."""
    calls = []
    real = packing.store.build

    def build(path, *args, **kwargs):
        calls.append(path.name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(packing.store, "build", build)
    return calls


def assert_same(a: PackedData, b: PackedData):
    for name in ("input_ids", "attention_mask", "word_start"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
        assert getattr(a, name).dtype == getattr(b, name).dtype


def test_second_call_hits_cache(tmp_path, corpus, documents, tokenizer, monkeypatch, caplog):
    write_corpus(corpus, documents[:5])
    cache = tmp_path / "cache"
    caplog.set_level(logging.INFO, logger="deberta_jax.data.packing")
    first = load_or_pack(str(corpus), tokenizer, 32, cache)
    assert "cache miss" in caplog.text
    assert_same(first, pack_documents(documents[:5], tokenizer, 32))

    def fail(*args, **kwargs):
        raise AssertionError("tokenized again despite a cached result")

    monkeypatch.setattr(packing, "iter_documents", fail)
    monkeypatch.setattr(packing.parallel_encode, "encode_stream", fail)
    assert_same(load_or_pack(str(corpus), tokenizer, 32, cache), first)
    assert "cache hit" in caplog.text
    assert [p.name for p in cache.iterdir()] == [packing.cache_path(str(corpus), tokenizer, cache).name]  # no temps


def test_cache_is_shared_by_every_length_and_invalidated_by_the_file(tmp_path, corpus, documents, tokenizer,
                                                                      monkeypatch):
    write_corpus(corpus, documents[:3])
    calls = counting_packer(monkeypatch)
    load_or_pack(str(corpus), tokenizer, 32, tmp_path)
    longer = load_or_pack(str(corpus), tokenizer, 48, tmp_path)  # the same token stream, cut into longer rows
    assert len(calls) == 1
    assert_same(longer, pack_documents(documents[:3], tokenizer, 48))
    write_corpus(corpus, documents[:4])
    changed = load_or_pack(str(corpus), tokenizer, 32, tmp_path)
    assert len(calls) == 2 and calls[1] != calls[0]
    assert_same(changed, pack_documents(documents[:4], tokenizer, 32))


def test_cache_key_includes_tokenizer(tmp_path, corpus, documents, tokenizer):
    write_corpus(corpus, documents[:2])
    other = train_tokenizer(documents[:5], vocab_size=500)
    assert packing.cache_path(str(corpus), tokenizer, tmp_path) != packing.cache_path(str(corpus), other, tmp_path)


def test_interrupted_write_leaves_no_cache(tmp_path, corpus, documents, tokenizer, monkeypatch):
    write_corpus(corpus, documents[:2])
    cache = tmp_path / "cache"

    def interrupted_encoding(*args, **kwargs):
        yield np.arange(5, 50, dtype=np.uint16)  # half a stream written
        raise KeyboardInterrupt

    monkeypatch.setattr(packing.parallel_encode, "encode_stream", interrupted_encoding)
    with pytest.raises(KeyboardInterrupt):
        load_or_pack(str(corpus), tokenizer, 32, cache)
    assert list(cache.iterdir()) == []
    monkeypatch.undo()
    calls = counting_packer(monkeypatch)
    load_or_pack(str(corpus), tokenizer, 32, cache)
    assert len(calls) == 1


# --- batching ---


def straight_run(num_rows, batch_size, steps, seed):
    return [batch_indices(num_rows, batch_size, step, seed) for step in range(steps)]


def test_each_epoch_covers_every_row_once():
    num_rows, batch_size = 103, 16  # batches straddle epoch boundaries
    order = np.concatenate(straight_run(num_rows, batch_size, 20, seed=7))
    epochs = order[: 3 * num_rows].reshape(3, num_rows)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(num_rows))
    assert not (epochs[0] == epochs[1]).all()  # a fresh shuffle per epoch


def test_batch_larger_than_dataset():
    indices = batch_indices(5, 12, step=1, seed=0)  # positions 12..23: epochs 2, 3 and 4
    epoch = [np.random.default_rng([0, e]).permutation(5) for e in (2, 3, 4)]
    np.testing.assert_array_equal(indices, np.concatenate([epoch[0][2:], epoch[1], epoch[2][:4]]))


def test_batches_are_deterministic_and_seeded():
    a = straight_run(50, 8, 10, seed=1)
    assert all((x == y).all() for x, y in zip(a, straight_run(50, 8, 10, seed=1)))
    assert any((x != y).any() for x, y in zip(a, straight_run(50, 8, 10, seed=2)))


def test_resume_equals_straight_run():
    straight = straight_run(37, 8, 10, seed=3)
    packing._epoch_permutation.cache_clear()  # a resumed process starts with nothing cached
    resumed = [batch_indices(37, 8, step, seed=3) for step in range(5, 10)]
    for step, indices in zip(range(5, 10), resumed):
        np.testing.assert_array_equal(indices, straight[step])


def test_process_shares_partition_the_global_batch():
    global_indices = batch_indices(100, 24, step=4, seed=0)
    shares = [process_share(global_indices, index, 4) for index in range(4)]
    assert all(len(share) == 6 for share in shares)
    np.testing.assert_array_equal(np.concatenate(shares), global_indices)
    with pytest.raises(ValueError, match="multiple of the process count"):
        process_share(global_indices, 0, 5)
    with pytest.raises(ValueError, match="process_index=4"):
        process_share(global_indices, 4, 4)


def test_get_batch_takes_this_process_rows(packed):
    batch = get_batch(packed, batch_size=8, step=2, seed=0, process_index=1, process_count=2)
    rows = batch_indices(packed.num_rows, 8, 2, 0)[4:]
    np.testing.assert_array_equal(batch.input_ids, packed.input_ids[rows])
    np.testing.assert_array_equal(batch.word_start, packed.word_start[rows])


def test_bad_batch_arguments():
    with pytest.raises(ValueError, match="batch_size > 0"):
        batch_indices(10, 0, 0, 0)
