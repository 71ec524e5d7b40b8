"""Download the public corpora the studies train and evaluate on, into the folder the commands call `$DATA`.

    python -m deberta_jax.data.fetch --out data      # needs network access; then --sweep.data_dir=data

Without network access, give NLTK's brown.zip downloaded elsewhere (`--brown_zip`) and WikiText-2's original
`wiki.valid.tokens` and `wiki.test.tokens` as `wikitext-2/valid.txt` and `wikitext-2/test.txt` under `--out`.

Writes
  - `brown/train.txt`, `brown/valid.txt`: the Brown Corpus (Francis and Kucera 1961/1979, 500 samples of edited
    American English) from NLTK's data repository, part-of-speech tags stripped, one paragraph per line, a blank
    line between documents, every 10th document (in the corpus' file order) in `valid.txt`;
  - `wikitext-2/valid.txt`, `wikitext-2/test.txt`: WikiText-2 (Merity et al. 2016), the tokenized version (`<unk>`
    for rare words), from the Hugging Face hub, each split's lines as the original `wiki.*.tokens` files hold them.
Each file is written whole or not at all, and an existing file is kept (delete it to fetch it again).
"""

from __future__ import annotations

import io
import os
import re
import urllib.error
import urllib.request
import zipfile

from absl import app, flags

from deberta_jax.data import errors
from deberta_jax.data.text import hub_probe_error
from deberta_jax.storage import atomic

BROWN_URL = "https://raw.githubusercontent.com/nltk/nltk_data/gh-pages/packages/corpora/brown.zip"
# A Brown file name: genre letter a-r, then the sample number (ca01 ... cr09); the archive also holds CONTENTS etc.
BROWN_FILE = re.compile(r"^brown/c[a-r]\d\d$")
WIKITEXT = ("Salesforce/wikitext", "wikitext-2-v1")
VALID_EVERY = 10


def brown_document(tagged: str) -> str:
    """One tagged Brown sample (`word/TAG` tokens, a sentence per indented line, paragraphs between blank lines) as
    plain text: tags stripped, one paragraph per line."""
    paragraphs = []
    for block in re.split(r"\n\s*\n", tagged.strip()):
        words = [token.rsplit("/", 1)[0] for token in block.split()]
        if words:
            paragraphs.append(" ".join(words))
    return "\n".join(paragraphs)


def brown_splits(archive: bytes) -> tuple[str, str]:
    """(train, valid) text from NLTK's brown.zip: documents in file order, every `VALID_EVERY`-th to valid."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        names = sorted(n for n in z.namelist() if BROWN_FILE.match(n))
        if not names:
            raise ValueError("the Brown archive holds no brown/c?NN sample files; has NLTK's layout changed?")
        documents = [brown_document(z.read(n).decode("utf-8")) for n in names]
    valid = [d for i, d in enumerate(documents) if i % VALID_EVERY == VALID_EVERY - 1]
    train = [d for i, d in enumerate(documents) if i % VALID_EVERY != VALID_EVERY - 1]
    return "\n\n".join(train) + "\n", "\n\n".join(valid) + "\n"


def wikitext_split(split: str) -> str:
    """One WikiText-2 split as its original text file: the dataset's lines, each ending in a newline. The Hub is
    probed first: `datasets` would retry an unreachable one for about 25 s before raising the same ConnectionError."""
    unreachable_hub = hub_probe_error()
    if unreachable_hub:
        raise ConnectionError(unreachable_hub)
    import datasets

    rows = datasets.load_dataset(*WIKITEXT, split=split)["text"]
    return "".join(line if line.endswith("\n") else line + "\n" for line in rows)


def unreachable(what: str, err: OSError, instead: str) -> OSError:
    """A failed download as one line: `what` could not be fetched, why, and `instead`, the local files to give."""
    if isinstance(err, urllib.error.HTTPError):  # the host answered: the network is fine
        reason = f"the server answered HTTP {err.code} {err.reason}"
    else:
        reason = f"{getattr(err, 'reason', err)}: the network or the host is unreachable from here"
    return OSError(f"cannot download {what} ({reason}); {instead}")


def brown_archive(brown_zip: str | None) -> bytes:
    """NLTK's brown.zip: the file `brown_zip`, or downloaded from `BROWN_URL`."""
    if brown_zip:
        if not zipfile.is_zipfile(brown_zip):  # also False for a file that does not exist
            raise ValueError(f"--brown_zip={brown_zip} is not a zip file: give NLTK's brown.zip, from {BROWN_URL}")
        with open(brown_zip, "rb") as f:
            return f.read()
    print("downloading", BROWN_URL, flush=True)
    try:
        with urllib.request.urlopen(BROWN_URL, timeout=120) as response:
            return response.read()
    except OSError as err:  # urllib's URLError, or a timeout while reading
        raise unreachable(BROWN_URL, err, "download it where it can be reached and give the file with "
                          "--brown_zip=PATH/brown.zip") from None


def fetch(out: str, brown_zip: str | None = None) -> list[str]:
    """Writes every missing file under `out` (Brown from `brown_zip` if given); returns the paths written."""
    written = []

    def write(path: str, text: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic.write_text(path, text)
        written.append(path)

    brown = [os.path.join(out, "brown", f"{split}.txt") for split in ("train", "valid")]
    if not all(os.path.isfile(p) for p in brown):
        for path, text in zip(brown, brown_splits(brown_archive(brown_zip))):
            write(path, text)
    for split, name in (("validation", "valid"), ("test", "test")):
        path = os.path.join(out, "wikitext-2", f"{name}.txt")
        if not os.path.isfile(path):
            print("downloading", "/".join(WIKITEXT), split, flush=True)
            try:
                text = wikitext_split(split)
            except ConnectionError as err:  # what `datasets` raises when the hub cannot be reached
                raise unreachable(f"WikiText-2 ({'/'.join(WIKITEXT)}) from the Hugging Face hub", err, (
                    "give its original wiki.valid.tokens and wiki.test.tokens as valid.txt and test.txt in "
                    f"{os.path.dirname(path)} instead (files already there are kept)")) from None
            write(path, text)
    return written


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("out", "data", "Folder to write brown/ and wikitext-2/ into (the $DATA of the commands).")
    flags.DEFINE_string("brown_zip", None, f"NLTK's brown.zip, downloaded elsewhere (default: download {BROWN_URL}).")


def main(argv):
    del argv
    written = fetch(FLAGS.out, FLAGS.brown_zip)
    print("wrote", ", ".join(written) if written else f"nothing: every file is already in {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.data.fetch"))
