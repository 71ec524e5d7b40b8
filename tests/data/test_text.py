"""Reading corpora into documents: file layouts, specs, and the errors that tell users how to fix them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deberta_jax.data import text
from deberta_jax.data.text import load_documents, parse_hf_spec, resolve_files, split_documents
from tests.helpers import REPO

DATA = REPO.parent / "shared" / "data"
FIX = re.escape(text.LOCAL_FILES_EXAMPLE)


def write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def test_brown_documents_are_blank_line_separated():
    documents = load_documents(str(DATA / "brown" / "train.txt"))
    assert len(documents) == 450  # 449 blank separator lines in the file
    assert documents[0].startswith("The Fulton County Grand Jury")
    assert all(doc and "\n\n" not in doc and doc == doc.strip() for doc in documents)


def test_blank_line_split_keeps_paragraphs_and_crlf(tmp_path):
    path = write(tmp_path / "a.txt", "p1 .\r\np2 .\r\n\r\n\r\np3 .\r\n")
    assert load_documents(str(path)) == ["p1 .\np2 .", "p3 ."]


def test_wikitext_split_at_top_level_headings():
    lines = [" ", " = First = ", " ", " Intro .", " ", " = = Part = = ", " Body .", " = Second = ", " Text ."]
    assert split_documents(lines) == ["= First =\nIntro .\n= = Part = =\nBody .", "= Second =\nText ."]


def test_real_wikitext_articles():
    documents = load_documents(str(DATA / "wikitext-2" / "test.txt"))
    assert len(documents) == 62  # the number of " = Title = " lines in the file
    assert documents[0].startswith("= Robert <unk> =\n")
    assert all(doc.startswith("= ") and not doc.startswith("= =") for doc in documents)


def test_comma_list_and_sorted_globs(tmp_path):
    for name in ("b.txt", "a.txt", "c.md"):
        write(tmp_path / name, f"{name} text\n")
    extra = write(tmp_path / "z.txt", "first\n")
    spec = f"{extra}, {tmp_path}/*.txt"
    assert resolve_files(spec) == [extra, tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "z.txt"]
    assert load_documents(spec) == ["first", "a.txt text", "b.txt text", "first"]


def test_missing_file_names_spec_and_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no such file.*" + FIX):
        load_documents(str(tmp_path / "missing.txt"))


def test_glob_matching_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"glob matched no files.*" + FIX):
        load_documents(f"{tmp_path}/*.txt")


def test_directory_suggests_glob(tmp_path):
    with pytest.raises(ValueError, match=r"is a directory; use a glob"):
        load_documents(str(tmp_path))


@pytest.mark.parametrize("content", ["", " \n\n\t\n"])
def test_empty_file(tmp_path, content):
    path = write(tmp_path / "empty.txt", content)
    with pytest.raises(ValueError, match=rf"{path} is empty.*remove it"):
        load_documents(str(path))


def test_non_utf8_file_names_byte_offset(tmp_path):
    path = write(tmp_path / "latin1.txt", "caf\u00e9 au lait\n".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"{path} is not valid UTF-8 \(byte offset 3.*iconv"):
        load_documents(str(path))


def test_utf16_file_gets_the_utf16_conversion(tmp_path):
    path = write(tmp_path / "utf16.txt", "caf\u00e9 au lait\n".encode("utf-16"))
    with pytest.raises(ValueError, match=rf"{path} is UTF-16 .*`iconv -f UTF-16 -t UTF-8 {path}"):
        load_documents(str(path))


def test_old_mac_line_endings_are_refused_not_read_as_one_document(tmp_path):
    path = write(tmp_path / "mac.txt", b"first paragraph\r\rsecond paragraph\r\rthird\r")
    with pytest.raises(ValueError, match=r"ends its lines with \"\\r\" alone .*`tr '\\r' '\\n' <"):
        load_documents(str(path))
    windows = write(tmp_path / "crlf.txt", b"first paragraph\r\n\r\nsecond paragraph\r\n")
    assert load_documents(str(windows)) == ["first paragraph", "second paragraph"]


def test_a_line_too_long_to_tokenize_is_refused_with_its_size(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "MAX_LINE_BYTES", 2**20)  # 1 MiB instead of 16: the same code path, faster
    path = write(tmp_path / "one-line.txt", b"word " * 300_000)  # 1.5 MB, no newline
    with pytest.raises(ValueError, match=rf"{path} has a line of more than 1 MiB starting at byte 0"):
        load_documents(str(path))


def test_parse_hf_spec():
    spec = "hf:wikitext:wikitext-103-raw-v1:validation"
    assert parse_hf_spec(spec) == ("wikitext", "wikitext-103-raw-v1", "validation")
    assert parse_hf_spec("hf:user/corpus") == ("user/corpus", None, "train")
    with pytest.raises(ValueError, match="hf:NAME"):
        parse_hf_spec("hf:")


def test_unreachable_hub_fails_fast_with_local_hint(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(text, "hub_probe_error", lambda: "no route to host")
    with pytest.raises(ConnectionError, match=rf"Hub is unreachable \(no route to host\).*{FIX}"):
        load_documents("hf:wikitext:wikitext-103-raw-v1:train")


def test_offline_env_gives_clear_error(tmp_path):
    # A fresh interpreter, because `datasets` reads the offline switch when first imported;
    # an empty HF_HOME, so a dataset cached on this machine cannot satisfy the load.
    code = (
        "from deberta_jax.data.text import load_documents\n"
        "try:\n    load_documents('hf:wikitext:wikitext-103-raw-v1:train')\n"
        "except ConnectionError as err:\n    print(err)\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert "Hub is unreachable" in result.stdout, result.stderr
    assert text.LOCAL_FILES_EXAMPLE in result.stdout
