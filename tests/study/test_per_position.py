"""The chunked protocol's per-position records: at every length, one loss and one accuracy record per position
bucket that holds targets, counting exactly the targets the chunked windows score there (buckets of one position
here, so one record per position)."""

import collections

import numpy as np
import pytest
from flax import nnx

from deberta_jax.data import targets
from deberta_jax.data.text import load_documents
from deberta_jax.data.tokenizer import train_tokenizer
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.study import length_study
from tests.helpers import BROWN

TRAIN_LEN = 16


@pytest.fixture(scope="module")
def scored():
    docs = load_documents(str(BROWN / "valid.txt"))[:6]
    tok = train_tokenizer(docs, 300)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                      max_position_embeddings=32, trained_length=TRAIN_LEN, position_buckets=8,
                      max_relative_positions=16)
    model = length_study.EvalModel("deb", 0, "w", MaskedLM(cfg, rngs=nnx.Rngs(0)), tok, TRAIN_LEN)
    settings = length_study.StudySettings(lengths=(TRAIN_LEN, 2 * TRAIN_LEN), protocols=("chunked",),
                                          policies=("clip",), bootstrap=10, buckets_per_train_len=TRAIN_LEN)
    records, skipped = length_study.run_study([model], {"d": docs}, settings)
    assert skipped == []
    return records, targets.build_corpus(docs, tok, seed=settings.mask_seed)


@pytest.mark.parametrize("eval_len", [TRAIN_LEN, 2 * TRAIN_LEN])
def test_chunked_records_one_loss_and_accuracy_per_position(scored, eval_len):
    records, corpus = scored
    windows = targets.chunked_windows(corpus, eval_len)
    per_column = (windows.weights > 0).sum(axis=0)
    expected = {position: int(count) for position, count in enumerate(per_column) if count}
    # [CLS] and the last cell are never targets; every position between them is, somewhere in the stream.
    assert sorted(expected) == list(range(1, eval_len - 1))
    at_length = [r for r in records if r["protocol"] == "chunked" and r["eval_len"] == eval_len]
    for metric in ("loss", "accuracy"):
        buckets = [r for r in at_length if r["metric"] == metric and r["bucket"] != "all"]
        assert collections.Counter(r["bucket"] for r in buckets) == collections.Counter(list(expected)), metric
        assert {r["bucket"]: r["n_tokens"] for r in buckets} == expected
        assert all(np.isfinite(r["value"]) for r in buckets)
        overall, = [r for r in at_length if r["metric"] == metric and r["bucket"] == "all"]
        assert sum(expected.values()) == overall["n_tokens"]
