"""Reading corpora into whole documents, from local text files or the Hugging Face Hub.

A document is one string whose paragraphs are joined by newlines. Document boundaries are
kept because packing puts a `[SEP]` between documents.

Local files come in two layouts, told apart by their first non-blank line:
  * Brown style: one paragraph per line, documents separated by a blank line.
  * WikiText style (first line is a top-level heading ` = Title = `): every top-level heading
    starts a new article; blank lines are dropped and heading lines are kept verbatim
    (` = = Section = = ` included), as WikiText language-modelling evaluations do.
Hub datasets (`hf:...`) use their `text` column: WikiText's line-per-row layout is regrouped
into articles the same way; for any other dataset each non-empty row is one document.
"""

from __future__ import annotations

import glob
import os
import re
import urllib.error
import urllib.request
from collections.abc import Iterable
from pathlib import Path

HF_PREFIX = "hf:"
# How a local data spec looks, for error messages (the command line that carries it is the caller's).
LOCAL_FILES_EXAMPLE = "corpus/train.txt,more/*.txt"
HUB_PROBE_TIMEOUT_S = 3.0

# Top-level WikiText heading: exactly one "=" on each side (sections have "= =").
_WIKITEXT_TITLE = re.compile(r"^ = [^=].* = $")
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}


def is_hf_spec(spec: str) -> bool:
    """True for `hf:NAME[:CONFIG][:SPLIT]` specs, which name a Hub dataset instead of files."""
    return spec.startswith(HF_PREFIX)


def resolve_files(spec: str) -> list[Path]:
    """Expands a comma-separated list of paths and globs into files, in the order given.

    Glob matches are sorted so the document order (and hence the packed data) never depends on
    the file system's listing order.
    """
    parts = [part.strip() for part in spec.split(",") if part.strip()]
    if not parts:
        raise ValueError(f"data spec {spec!r} names no files; give paths or globs, e.g. {LOCAL_FILES_EXAMPLE!r}")
    files: list[Path] = []
    for part in parts:
        if any(ch in part for ch in "*?["):
            matches = sorted(Path(p) for p in glob.glob(part, recursive=True) if Path(p).is_file())
            if not matches:
                raise FileNotFoundError(_missing_message(spec, part, "glob matched no files"))
            files.extend(matches)
        else:
            path = Path(part)
            if path.is_dir():
                raise ValueError(f"data spec {spec!r}: {part} is a directory; use a glob such as {part}/*.txt")
            if not path.is_file():
                raise FileNotFoundError(_missing_message(spec, part, "no such file"))
            files.append(path)
    return files


def _missing_message(spec: str, part: str, what: str) -> str:
    return (
        f"data spec {spec!r}: {part}: {what} (relative paths are resolved from {os.getcwd()}); "
        f"give existing text files or globs, e.g. {LOCAL_FILES_EXAMPLE!r}"
    )


def read_text_file(path: Path) -> str:
    """Reads a UTF-8 file, rejecting empty files and naming the first undecodable byte."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"{path} is not valid UTF-8 (byte offset {err.start}: {err.reason}); "
            f"convert it first, e.g. `iconv -f latin1 -t utf-8 {path} > {path.stem}.utf8.txt`"
        ) from err
    if not text.strip():
        raise ValueError(f"{path} is empty (no text besides whitespace); remove it from the data spec")
    return text


def split_documents(lines: Iterable[str]) -> list[str]:
    """Groups lines into documents, choosing Brown or WikiText rules from the first non-blank line."""
    lines = [line.rstrip("\r\n") for line in lines]
    first = next((line for line in lines if line.strip()), "")
    if _WIKITEXT_TITLE.match(first):
        return _split_wikitext(lines)
    return _split_blank_lines(lines)


def _split_blank_lines(lines: list[str]) -> list[str]:
    documents, current = [], []
    for line in lines:
        if line.strip():
            current.append(line.strip())
        elif current:
            documents.append("\n".join(current))
            current = []
    if current:
        documents.append("\n".join(current))
    return documents


def _split_wikitext(lines: list[str]) -> list[str]:
    documents, current = [], []
    for line in lines:
        if _WIKITEXT_TITLE.match(line) and current:
            documents.append("\n".join(current))
            current = []
        if line.strip():
            current.append(line.strip())
    if current:
        documents.append("\n".join(current))
    return documents


def load_documents(spec: str) -> list[str]:
    """Loads all documents named by `spec`: local files/globs (comma-separated) or `hf:NAME[:CONFIG][:SPLIT]`."""
    if is_hf_spec(spec):
        documents = _load_hf(spec)
    else:
        documents = []
        for path in resolve_files(spec):
            documents.extend(split_documents(read_text_file(path).split("\n")))
    if not documents:
        raise ValueError(f"data spec {spec!r} yielded no documents")
    return documents


def parse_hf_spec(spec: str) -> tuple[str, str | None, str]:
    """Splits `hf:NAME[:CONFIG][:SPLIT]` into (name, config or None, split, default "train")."""
    parts = spec[len(HF_PREFIX) :].split(":")
    if not parts[0] or len(parts) > 3:
        raise ValueError(
            f"bad Hub data spec {spec!r}; expected hf:NAME[:CONFIG][:SPLIT], e.g. hf:wikitext:wikitext-103-raw-v1:train"
        )
    config = parts[1] if len(parts) > 1 and parts[1] else None
    split = parts[2] if len(parts) > 2 and parts[2] else "train"
    return parts[0], config, split


def _offline_requested() -> bool:
    """Reads the offline switches now, as `datasets` does at import (HF_DATASETS_OFFLINE wins)."""
    value = os.environ.get("HF_DATASETS_OFFLINE", os.environ.get("HF_HUB_OFFLINE", ""))
    return value.upper() in _TRUE_VALUES


def _hub_probe_error(timeout: float = HUB_PROBE_TIMEOUT_S) -> str | None:
    """Probes the Hub once with a short timeout; None if it answered, else why not.

    Without this, `datasets` retries an unreachable Hub for about 25 s before failing.
    """
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout)
    except urllib.error.HTTPError:
        return None  # the server answered, just not with 2xx
    except OSError as err:  # URLError, DNS failure, refused connection, timeout
        return f"HEAD {endpoint} failed within {timeout:g} s: {err}"
    return None


def _unreachable_message(spec: str, reason: str) -> str:
    return (
        f"data spec {spec!r}: the Hugging Face Hub is unreachable ({reason}). "
        f"Give local text files as the data spec instead (comma-separated paths or globs, e.g. "
        f"{LOCAL_FILES_EXAMPLE!r}); if the dataset is already in the local "
        "Hugging Face cache, set HF_HUB_OFFLINE=1 to read it from there."
    )


def _load_hf(spec: str) -> list[str]:
    """Loads a Hub dataset's `text` column as documents (see the module docstring)."""
    name, config, split = parse_hf_spec(spec)
    offline = _offline_requested()
    probe_error = None if offline else _hub_probe_error()
    if probe_error:
        raise ConnectionError(_unreachable_message(spec, probe_error))
    import datasets  # heavy import, and it reads the offline switches at import time

    try:
        dataset = datasets.load_dataset(name, config, split=split)
    except ConnectionError as err:
        raise ConnectionError(_unreachable_message(spec, str(err))) from err
    except FileNotFoundError as err:
        if not offline:
            raise  # a real "no such dataset" answer from the Hub
        raise ConnectionError(_unreachable_message(spec, f"offline mode, not cached: {err}")) from err
    if "text" not in dataset.column_names:
        raise ValueError(f"Hub dataset {spec!r} has no 'text' column (columns: {dataset.column_names})")
    rows = list(dataset["text"])
    first = next((row for row in rows if row.strip()), "")
    if _WIKITEXT_TITLE.match(first.rstrip("\n")):
        return _split_wikitext([row.rstrip("\n") for row in rows])
    return [row.strip() for row in rows if row.strip()]
