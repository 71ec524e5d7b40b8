"""WordPiece tokenizer (HF `tokenizers`) with BERT normalization and fixed special-token ids.

The special tokens always get ids 0..4 in the order of `SPECIAL_TOKENS`, so model code may
rely on `[PAD]` being 0, and masking can tell special tokens apart by id.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from deberta_jax import storage

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CONTINUATION_PREFIX = "##"
# Always in the vocabulary, so text from another domain (WikiText's "@-@", "<unk>", "=") does not
# turn into [UNK] just because the training corpus (Brown) never used those characters.
ASCII_ALPHABET = string.ascii_letters + string.digits + string.punctuation


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens, looked up once so hot loops compare integers, not strings."""

    pad: int
    unk: int
    cls: int
    sep: int
    mask: int

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer) -> SpecialIds:
        """Looks up every special token; a tokenizer lacking one cannot feed BERT-style training."""
        ids = []
        for token in SPECIAL_TOKENS:
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise ValueError(
                    f"tokenizer has no {token} token; train it with deberta_jax.data.tokenizer.train_tokenizer, "
                    f"which adds {', '.join(SPECIAL_TOKENS)}"
                )
            ids.append(token_id)
        return cls(*ids)

    @property
    def all(self) -> tuple[int, ...]:
        """All special ids, for excluding them from masking or random replacement."""
        return (self.pad, self.unk, self.cls, self.sep, self.mask)


def configure(tokenizer: Tokenizer, lowercase: bool) -> Tokenizer:
    """Sets BERT's normalizer, pre-tokenizer, decoder and `[CLS] A [SEP]` template in place."""
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece(prefix=CONTINUATION_PREFIX)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", SPECIAL_TOKENS.index("[CLS]")), ("[SEP]", SPECIAL_TOKENS.index("[SEP]"))],
    )
    return tokenizer


def _initial_alphabet(tokenizer: Tokenizer) -> list[str]:
    """Printable ASCII as the normalizer leaves it (no capitals when lowercasing)."""
    return sorted(set(tokenizer.normalizer.normalize_str(ASCII_ALPHABET)))


def _continuation_tokens(documents: Iterable[str], tokenizer: Tokenizer) -> list[str]:
    """Returns `##c` for every character c that can occur inside a word, sorted by code point (one pass over
    `documents`; an empty corpus is refused here).

    Works around a `tokenizers` bug (huggingface/tokenizers#1794): the trainer numbers `##c`
    tokens in hash-map order, which changes from run to run, and those numbers break ties between
    equally frequent merges, so two trainings on the same text give different vocabularies.
    Registering the `##c` tokens up front fixes their ids and makes training deterministic.
    """
    raw_chars, count = set(), 0
    for document in documents:
        raw_chars.update(document)
        count += 1
    if not count:
        raise ValueError("cannot train a tokenizer on zero documents")
    alphabet = set(tokenizer.normalizer.normalize_str("".join(raw_chars))) | set(_initial_alphabet(tokenizer))
    # A character can continue a word unless the pre-tokenizer splits it off (spaces,
    # punctuation) or the normalizer isolates it (CJK ideographs).
    inner = [
        c
        for c in alphabet
        if len(tokenizer.pre_tokenizer.pre_tokenize_str(tokenizer.normalizer.normalize_str(c + c))) == 1
    ]
    return [CONTINUATION_PREFIX + c for c in sorted(inner)]


def train_tokenizer(documents: Iterable[str], vocab_size: int, lowercase: bool = True) -> Tokenizer:
    """Trains a BERT-style WordPiece tokenizer; the same documents always give the same vocabulary.

    `documents` is read twice (its characters, then its words), so it must be a collection, not a one-shot
    iterator: a list, or `text.DocumentStream(spec)` for a corpus larger than memory, of which only the word
    counts are then held.

    The vocabulary always holds the special tokens, printable ASCII and every character seen, so
    on a tiny corpus or with a tiny `vocab_size` its size may differ from `vocab_size`: size the
    model's embedding with `tokenizer.get_vocab_size()`.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} leaves no room besides the {len(SPECIAL_TOKENS)} special tokens")
    if iter(documents) is documents:
        raise TypeError("train_tokenizer reads its documents twice; pass a list or text.DocumentStream(spec), "
                        "not an iterator or generator")
    scratch = configure(Tokenizer(models.WordPiece(unk_token="[UNK]")), lowercase)
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=[*SPECIAL_TOKENS, *_continuation_tokens(documents, scratch)],
        initial_alphabet=_initial_alphabet(scratch),
        continuing_subword_prefix=CONTINUATION_PREFIX,
        show_progress=False,
    )
    scratch.train_from_iterator(documents, trainer=trainer)
    # The trainer registered the `##c` tokens as special (unsplittable, skipped when decoding);
    # rebuild from the learned vocabulary so that only the five real ones are special.
    model = models.WordPiece(
        vocab=scratch.get_vocab(), unk_token="[UNK]", continuing_subword_prefix=CONTINUATION_PREFIX
    )
    tokenizer = configure(Tokenizer(model), lowercase)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer


def save_tokenizer(tokenizer: Tokenizer, path: str | Path) -> None:
    """Writes the tokenizer as one JSON file (as `Tokenizer.save` lays it out), whole or not at all, creating
    parent folders; `path` may be in object storage."""
    path = storage.path(path)
    try:
        storage.write_text(path, tokenizer.to_str(pretty=True))
    except storage.StorageError:
        raise
    except Exception as err:
        raise OSError(f"cannot write the tokenizer to {path} ({err}); is {path.parent} writable?") from None


def load_tokenizer(path: str | Path, fix: str | None = None) -> Tokenizer:
    """Reads a tokenizer JSON written by `save_tokenizer` (locally or from object storage) and checks its special
    tokens. `fix`: what to do about a missing or unreadable file, in place of the general advice (train one; point
    config.data.tokenizer at an intact one)."""
    path = storage.path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file {path} not found; "
            + (fix or "train one with deberta_jax.data.tokenizer.train_tokenizer and save it with save_tokenizer"))
    try:
        tokenizer = Tokenizer.from_str(storage.read_text(path))
    except storage.StorageError:
        raise
    except Exception as err:  # the Rust parser raises a bare Exception for a truncated or foreign file
        raise ValueError(f"tokenizer file {path} cannot be read ({err}): it is truncated or not a tokenizers JSON; "
                         + (fix or "restore it, or point config.data.tokenizer at an intact tokenizer.json")) from None
    SpecialIds.from_tokenizer(tokenizer)
    return tokenizer
