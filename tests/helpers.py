"""Checks and fixtures shared by several test modules."""

import os

import numpy as np

from deberta_jax.data.text import load_documents
from deberta_jax.data.tokenizer import save_tokenizer, train_tokenizer

BROWN = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "data", "brown")


def write_brown_slices(root, train_chars: int, valid_chars: int, vocab_size: int):
    """The first whole documents of Brown train/valid as `root/{train,valid}.txt` plus a small tokenizer."""
    for name, size in (("train.txt", train_chars), ("valid.txt", valid_chars)):
        with open(os.path.join(BROWN, name), encoding="utf-8") as f:
            text = f.read(size)
        (root / name).write_text(text[: text.rfind("\n\n")] + "\n")
    save_tokenizer(train_tokenizer(load_documents(str(root / "train.txt")), vocab_size), root / "tokenizer.json")
    return root


def assert_padding_invariant(model, ids: np.ndarray, pad: int = 7, atol: float = 2e-5):
    """Appending `pad` padding tokens must not change the logits at the real tokens."""
    b, n = ids.shape
    base = model.mlm_logits(ids, np.ones_like(ids))
    padded = np.concatenate([ids, np.zeros((b, pad), np.int32)], axis=1)
    mask = np.concatenate([np.ones_like(ids), np.zeros((b, pad), np.int32)], axis=1)
    np.testing.assert_allclose(model.mlm_logits(padded, mask)[:, :n], base, atol=atol)
