"""The $DATA recipe without the network: Brown's archive parsed from a made-up one in NLTK's layout, WikiText's
lines written as the original files hold them, and files already present kept."""

import io
import sys
import types
import zipfile

from deberta_jax.data import fetch

TAGGED = ("\n\n\tThe/at Fulton/np-tl County/nn-tl said/vbd ./.\n\n\tA/at second/od paragraph/nn\n"
          "\tof/in two/cd lines/nns ./.\n\n")


def brown_zip(num_docs):
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("brown/CONTENTS", "not a sample")
        z.writestr("brown/README", "not a sample")
        for i in range(num_docs):
            genre, number = "abcdefghjklmnpr"[i // 10], i % 10 + 1
            z.writestr(f"brown/c{genre}{number:02d}", TAGGED.replace("second", f"doc{i}"))
    return buffer.getvalue()


def test_brown_documents_lose_their_tags_keep_paragraphs_and_every_tenth_is_valid():
    assert fetch.brown_document(TAGGED) == "The Fulton County said .\nA second paragraph of two lines ."
    train, valid = fetch.brown_splits(brown_zip(20))
    train_docs, valid_docs = train.strip().split("\n\n"), valid.strip().split("\n\n")
    assert (len(train_docs), len(valid_docs)) == (18, 2)
    assert "doc9 " in valid_docs[0] and "doc19 " in valid_docs[1]
    assert all("/" not in doc for doc in train_docs + valid_docs)


def test_fetch_writes_what_is_missing_and_keeps_what_is_there(tmp_path, monkeypatch):
    class Response(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(fetch.urllib.request, "urlopen", lambda url, timeout: Response(brown_zip(10)))
    rows = {"validation": [" = A = \n", " text <unk> .\n"], "test": [" = B = \n", ""]}
    fake = types.SimpleNamespace(load_dataset=lambda name, config, split: {"text": rows[split]})
    monkeypatch.setitem(sys.modules, "datasets", fake)
    (tmp_path / "wikitext-2").mkdir()
    (tmp_path / "wikitext-2" / "test.txt").write_text("kept")
    written = fetch.fetch(str(tmp_path))
    assert sorted(p.split(str(tmp_path))[1] for p in written) == [
        "/brown/train.txt", "/brown/valid.txt", "/wikitext-2/valid.txt"]
    assert (tmp_path / "wikitext-2" / "valid.txt").read_text() == " = A = \n text <unk> .\n"
    assert (tmp_path / "wikitext-2" / "test.txt").read_text() == "kept"
    assert fetch.fetch(str(tmp_path)) == []


def test_brown_is_read_from_a_given_archive_without_the_network(tmp_path, monkeypatch):
    def offline(url, timeout):
        raise AssertionError("downloaded")

    monkeypatch.setattr(fetch.urllib.request, "urlopen", offline)
    (tmp_path / "brown.zip").write_bytes(brown_zip(10))
    for name in ("valid", "test"):  # given as the original files, so nothing is downloaded
        (tmp_path / "wikitext-2").mkdir(exist_ok=True)
        (tmp_path / "wikitext-2" / f"{name}.txt").write_text(" = A = \n")
    written = fetch.fetch(str(tmp_path), brown_zip=str(tmp_path / "brown.zip"))
    assert sorted(p.split(str(tmp_path))[1] for p in written) == ["/brown/train.txt", "/brown/valid.txt"]
    assert "doc9 " in (tmp_path / "brown" / "valid.txt").read_text()
