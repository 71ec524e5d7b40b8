"""The protocol registry: a protocol added to it is scored by the study and shown in every report, under its layout;
results of a protocol no longer registered still get a table."""

import dataclasses

import pytest
from flax import nnx

from deberta_jax.data import targets
from deberta_jax.data.text import load_documents
from deberta_jax.data.tokenizer import train_tokenizer
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.study import length_study, protocols, report


def _halves(setting):
    """A made-up protocol: the chunked windows of the first and the second half of the stream, as two 'offsets'."""
    windows = targets.chunked_windows(setting.corpus, setting.eval_len)
    half = len(windows.input_ids) // 2
    for offset, rows in ((0, slice(0, half)), (1, slice(half, None))):
        yield offset, dataclasses.replace(windows, **{f.name: getattr(windows, f.name)[rows]
                                                      for f in dataclasses.fields(windows)})


@pytest.fixture(scope="module")
def study():
    docs = load_documents("../shared/data/brown/valid.txt")[:6]
    tok = train_tokenizer(docs, 300)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                      max_position_embeddings=32, trained_length=16, position_buckets=8, max_relative_positions=16)
    model = length_study.EvalModel("deb", 0, "w", MaskedLM(cfg, rngs=nnx.Rngs(0)), tok, 16)
    return model, {"d": docs}


@pytest.mark.parametrize("layout", protocols.LAYOUTS)
def test_a_registered_protocol_is_scored_and_appears_in_the_report(study, layout, monkeypatch, tmp_path):
    model, datasets = study
    halves = protocols.Protocol("halves", "two halves of the stream", _halves, layout=layout)
    monkeypatch.setitem(protocols.PROTOCOLS, "halves", halves)
    settings = length_study.StudySettings(multiples=(1, 2), extra=(), protocols=("chunked", "halves"),
                                          policies=("clip",), bootstrap=10)
    records, skipped = length_study.run_study([model], datasets, settings)
    scored = {(r["protocol"], r["offset"]) for r in records if r["metric"] == "loss"}
    assert scored == {("chunked", None), ("halves", 0), ("halves", 1)}
    _, summary, _ = report.write_report(records, skipped, str(tmp_path))
    heading = "## d: halves, loss by offset" if layout == "by_offset" else "## d: halves, masked-token loss"
    assert heading in summary and "## d: chunked, masked-token loss" in summary
    # Each protocol's own table: the halves' rows are not the chunked ones.
    assert summary.index("## d: chunked") < summary.index("## d: halves")


def test_results_of_an_unregistered_protocol_still_get_a_table():
    rows = [dict(model="m", seed=0, source="s", policy="none", protocol="retired", dataset="d", train_len=8,
                 eval_len=n, multiple=n / 8, offset=None, bucket="all", metric=metric, value=1.0, ci_low=None,
                 ci_high=None, n_tokens=10) for n in (8, 16) for metric in ("loss", "accuracy")]
    assert "## d: retired, masked-token loss" in report.markdown_summary(rows, [])


def test_an_unknown_protocol_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"unknown protocol 'sliding'; choose from \('chunked', 'centred_target'\)"):
        length_study.StudySettings(protocols=("sliding",))
