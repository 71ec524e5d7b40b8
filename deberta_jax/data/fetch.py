"""Download the public corpora the studies train and evaluate on, into the folder the commands call `$DATA`.

    python -m deberta_jax.data.fetch --out data      # needs network access; then --sweep.data_dir=data

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
import urllib.request
import zipfile

from absl import app, flags

from deberta_jax.data import errors
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
    """One WikiText-2 split as its original text file: the dataset's lines, each ending in a newline."""
    import datasets

    rows = datasets.load_dataset(*WIKITEXT, split=split)["text"]
    return "".join(line if line.endswith("\n") else line + "\n" for line in rows)


def fetch(out: str) -> list[str]:
    """Writes every missing file under `out`; returns the paths written."""
    written = []

    def write(path: str, text: str) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic.write_text(path, text)
        written.append(path)

    brown = [os.path.join(out, "brown", f"{split}.txt") for split in ("train", "valid")]
    if not all(os.path.isfile(p) for p in brown):
        print("downloading", BROWN_URL, flush=True)
        with urllib.request.urlopen(BROWN_URL, timeout=120) as response:
            texts = brown_splits(response.read())
        for path, text in zip(brown, texts):
            write(path, text)
    for split, name in (("validation", "valid"), ("test", "test")):
        path = os.path.join(out, "wikitext-2", f"{name}.txt")
        if not os.path.isfile(path):
            print("downloading", "/".join(WIKITEXT), split, flush=True)
            write(path, wikitext_split(split))
    return written


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_string("out", "data", "Folder to write brown/ and wikitext-2/ into (the $DATA of the commands).")


def main(argv):
    del argv
    written = fetch(FLAGS.out)
    print("wrote", ", ".join(written) if written else f"nothing: every file is already in {FLAGS.out}")


if __name__ == "__main__":
    define_flags()
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.data.fetch"))
