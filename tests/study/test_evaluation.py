"""Length-extrapolation evaluation: fixed targets, window layouts, policies, outputs, bad input."""

import gzip
import io
import json
import math
import re

import jax
import numpy as np
import pandas as pd
import pytest
from flax import nnx

from deberta_jax.data import synthetic, targets
from deberta_jax.data.packing import pack_stream
from deberta_jax.data.text import load_documents
from deberta_jax.data.tokenizer import SpecialIds, train_tokenizer
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.study import length_study, report, scoring
from deberta_jax.study.baselines import UnigramModel


@pytest.fixture(scope="module")
def docs():
    return load_documents("../shared/data/brown/valid.txt")[:8]


@pytest.fixture(scope="module")
def tok(docs):
    return train_tokenizer(docs, 400)


@pytest.fixture(scope="module")
def corpus(docs, tok):
    return targets.build_corpus(docs, tok, seed=0)


def tiny(tok, seed=0, **kw):
    cfg = dict(vocab_size=tok.get_vocab_size(), hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
               max_position_embeddings=32, trained_length=16, position_buckets=8, max_relative_positions=16)
    return MaskedLM(ModelConfig(**dict(cfg, **kw)), rngs=nnx.Rngs(seed))


def scored_positions(windows):
    return np.sort(windows.stream_pos[windows.weights > 0])


def test_targets_are_fixed_per_position_and_identical_across_lengths(corpus, docs, tok):
    again = targets.build_corpus(docs, tok, seed=0)
    np.testing.assert_array_equal(again.targets, corpus.targets)
    assert 0.12 < corpus.targets.mean() < 0.18
    assert not corpus.targets[np.isin(corpus.tokens, corpus.special.all)].any()
    expected = np.nonzero(corpus.targets)[0]
    for n in (16, 24, 64, 128):
        np.testing.assert_array_equal(scored_positions(targets.chunked_windows(corpus, n)), expected)


def test_chunked_windows_use_the_training_packing(corpus):
    w = targets.chunked_windows(corpus, 16)
    ids, mask = pack_stream(corpus.tokens, corpus.special, 16)
    np.testing.assert_array_equal(w.attention_mask, mask)
    np.testing.assert_array_equal(np.where(w.weights > 0, ids, w.input_ids), ids)
    assert (w.input_ids[w.weights > 0] == corpus.special.mask).all()
    np.testing.assert_array_equal(w.labels[w.weights > 0], corpus.tokens[w.stream_pos[w.weights > 0]])


def test_centred_targets_are_the_same_at_every_length_with_keys_added_on_both_sides(corpus):
    span, train_len = 8, 16
    margin = (train_len - 2 - span) // 2
    starts = targets.centred_spans(corpus, train_len, span, 32)
    assert len(starts) == 32 and (np.diff(starts) >= span).all()  # disjoint spans
    firsts, ends = targets.document_bounds(corpus)
    reference, previous = None, None
    for n in (16, 32, 128):
        w = targets.centred_windows(corpus, n, starts, span)
        got = scored_positions(w)
        reference = got if reference is None else reference
        np.testing.assert_array_equal(got, reference)
        real = w.stream_pos >= 0
        lo = np.where(real, w.stream_pos, np.iinfo(np.int64).max).min(axis=1)
        hi = np.where(real, w.stream_pos, -1).max(axis=1)
        # Inside the span's document, and every target at least the margin away from [CLS] and [SEP].
        assert (lo >= firsts[starts]).all() and (hi < ends[starts]).all()
        cols = np.nonzero(w.weights)[1]
        sep_col = 1 + real.sum(axis=1)
        assert cols.min() >= 1 + margin and (sep_col[np.nonzero(w.weights)[0]] - cols > margin).all()
        if n == train_len:  # centred at the training length: the margin on both sides
            np.testing.assert_array_equal(lo, starts - margin)
        if previous is not None:  # a longer window only adds keys, on both sides where the document has them
            assert (lo <= previous[0]).all() and (hi >= previous[1]).all()
            side = (n - 2 - span) // 2
            both = (starts - side >= firsts[starts]) & (starts + span + side < ends[starts])
            assert both.any() and ((lo < previous[0]) & (hi > previous[1]))[both].all()
        previous = lo, hi
    assert len(reference) > 10


def test_centred_windows_score_every_target_of_each_span_and_nothing_else(corpus):
    """Row by row: the scored stream positions are exactly the drawn targets in `[start, start + span)`; a span
    one token short or shifted by one would drop or add one."""
    span = 8
    starts = targets.centred_spans(corpus, 16, span, 32)
    w = targets.centred_windows(corpus, 32, starts, span)
    scored = 0
    for row, start in enumerate(starts):
        want = [p for p in range(start, start + span) if corpus.targets[p]]
        assert sorted(w.stream_pos[row][w.weights[row] > 0]) == want
        scored += len(want)
    assert scored > 10


def test_a_document_shorter_than_the_window_fills_the_row_and_is_closed_by_its_sep(tok):
    """Documents of 20 and 60 tokens: a window of 64 around a span of the first holds that document whole, then
    [SEP] and padding, never the next document's tokens."""
    special = SpecialIds.from_tokenizer(tok)
    words = np.arange(10, 90, dtype=np.int32)
    tokens = np.concatenate([words[:20], [special.sep], words[:60], [special.sep]])
    corpus = targets.corpus_from_stream(tokens, special, seed=1, mask_prob=0.5)
    starts = targets.centred_spans(corpus, 16, 4, 64)
    assert starts.min() == 5 and starts.max() <= 81 - 5 - 4  # a margin of 5 inside each document
    w = targets.centred_windows(corpus, 64, starts, 4)
    first = int(np.argmax(starts > 20))  # the first span of the long document
    for row in range(len(starts)):
        real = w.stream_pos[row] >= 0
        doc = (np.arange(20) if row < first else np.arange(21, 81))
        np.testing.assert_array_equal(np.sort(w.stream_pos[row][real]), doc if len(doc) <= 62 else doc[:62])
        end = 1 + real.sum()
        assert w.input_ids[row, end] == special.sep and w.attention_mask[row, : end + 1].all()
        assert not w.attention_mask[row, end + 1:].any()


def test_centred_spans_refuse_a_span_or_a_text_they_cannot_place(corpus, tok):
    with pytest.raises(ValueError, match="span=15: a target span must fit in the 14 content tokens"):
        targets.centred_spans(corpus, 16, 15, 8)
    short = targets.corpus_from_stream(np.array([10, 11, 12], np.int32), SpecialIds.from_tokenizer(tok))
    with pytest.raises(ValueError, match="longest document has 3 tokens; the centred-target protocol needs a document "
                                         "of at least 14"):
        targets.centred_spans(short, 16, 8, 8)


def test_loss_is_the_mean_over_tokens_not_over_documents():
    """Two documents of 1 and 3 scored tokens: per token (1 + 3 * 3) / 4 = 2.5, per document (1 + 3) / 2 = 2."""
    sums = scoring.Sums.zeros(num_docs=2, seq_len=8, bucket_width=4)
    sums.loss_doc[:] = [1.0, 9.0]
    sums.count_doc[:] = [1, 3]
    sums.correct_doc[:] = [1, 0]
    assert sums.loss == 2.5 and sums.accuracy == 0.25


@pytest.mark.slow
def test_scoring_only_the_targets_equals_the_full_logits(corpus, tok):
    model = tiny(tok, attention="disentangled")
    windows = targets.chunked_windows(corpus, 16)
    sums = scoring.score_windows(scoring.make_scorer(model), corpus, windows, batch_size=5, bucket_width=4)
    logp = np.asarray(jax.nn.log_softmax(model.mlm_logits(windows.input_ids, windows.attention_mask), axis=-1))
    target = windows.weights > 0
    nll = -np.take_along_axis(logp, windows.labels[..., None], axis=-1)[..., 0][target]
    correct = (logp.argmax(-1) == windows.labels)[target]
    assert sums.count == target.sum()
    np.testing.assert_allclose(sums.loss, nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(sums.accuracy, correct.mean(), rtol=1e-6)
    by_bucket = np.bincount((np.nonzero(target)[1] // 4), weights=nll) / np.bincount(np.nonzero(target)[1] // 4)
    np.testing.assert_allclose(sums.loss_bucket / sums.count_bucket, by_bucket, rtol=1e-5)


def test_scored_counts_cover_the_targets_with_one_shape_per_batch_size():
    counts = [scoring.scored_count(16384, n) for n in range(0, 6000, 7)]
    assert all(c >= n for n, c in zip(range(0, 6000, 7), counts))
    assert len(set(counts[: 2800 // 7])) == 1  # every batch masked at the evaluation rate: one compile
    assert scoring.scored_count(16384, 5000) == 5056


@pytest.mark.slow
def test_policies_are_reported_not_silently_nan(docs, tok):
    bert = tiny(tok, attention="entangled", position_biased_input=True)
    models = [length_study.EvalModel("bert", 0, "a", bert, tok, 16)]
    settings = length_study.StudySettings(lengths=(16, 32, 64), policies=("strict", "untrained", "clip", "interpolate"),
                                          protocols=("chunked",), bootstrap=50)
    records, skipped = length_study.run_study(models, {"d": docs}, settings)
    evaluated = {(r["policy"], r["eval_len"]) for r in records if r["metric"] == "loss" and r["bucket"] == "all"}
    assert evaluated == {("strict", 16), ("untrained", 16), ("untrained", 32), ("clip", 16), ("clip", 32),
                         ("clip", 64), ("interpolate", 16), ("interpolate", 32), ("interpolate", 64)}
    reasons = {(s["policy"], s["eval_len"]): s["reason"] for s in skipped}
    assert set(reasons) == {("strict", 32), ("strict", 64), ("untrained", 64)}
    assert "32 rows" in reasons[("untrained", 64)]
    assert all(math.isfinite(r["value"]) for r in records)
    # Within the training length every policy reads the same trained rows.
    at_16 = {r["policy"]: r["value"] for r in records
             if r["eval_len"] == 16 and r["metric"] == "loss" and r["bucket"] == "all"}
    assert max(at_16.values()) - min(at_16.values()) < 1e-6


def test_models_with_different_tokenizers_are_flagged_as_unpaired(docs, tok):
    other = train_tokenizer(docs, 300)
    models = [length_study.EvalModel(label, 0, label, None, t, 16)
              for label, t in (("a", tok), ("b", tok), ("c", other))]
    labelled = [(f"{m.label} (seed {m.seed})", m.tokenizer.to_str()) for m in models]
    assert length_study.tokenizer_groups(labelled) == [["a (seed 0)", "b (seed 0)"], ["c (seed 0)"]]


def test_outputs_parse_and_hold_no_nan(tmp_path, docs, tok):
    models = [length_study.EvalModel("deb", s, f"w{s}", tiny(tok), tok, 16) for s in (0, 1)]
    models[1].model = tiny(tok, initializer_range=0.03)
    settings = length_study.StudySettings(multiples=(1, 2), extra=(8,), num_spans=8, bootstrap=50)
    records, skipped = length_study.run_study(models, {"brown/valid": docs}, settings)
    means = report.aggregate_seeds(records)
    report.write_results(pd.concat([report.records_frame(records), means]), skipped, str(tmp_path))
    loaded = report.read_results_file(tmp_path)["records"]
    assert {r["protocol"] for r in loaded} == {"chunked", "centred_target"}
    assert {r["metric"] for r in loaded} >= {"loss", "accuracy", "perplexity", "loss_change_vs_1x", "context_gain"}
    # The gain is each seed's loss of the same targets at N minus at L, with an interval around it.
    centred = {(r["seed"], r["eval_len"], r["metric"]): r for r in records
               if r["protocol"] == "centred_target" and r["bucket"] == "all"}
    for seed in (0, 1):
        for n in (24, 32):
            gain = centred[(seed, n, "context_gain")]
            assert gain["value"] == pytest.approx(centred[(seed, n, "loss")]["value"]
                                                  - centred[(seed, 16, "loss")]["value"], abs=1e-5)
            assert gain["ci_low"] <= gain["value"] <= gain["ci_high"] and gain["n_tokens"] > 0
        assert (seed, 16, "context_gain") not in centred
    mean_loss = [r for r in loaded if r["seed"] == "mean" and r["metric"] == "loss" and r["bucket"] == "all"
                 and r["protocol"] == "chunked"]
    assert mean_loss and all(r["n_seeds"] == 2 and r["ci_low"] <= r["value"] <= r["ci_high"] for r in mean_loss)
    for r in loaded:
        for field in ("value", "ci_low", "ci_high"):
            assert r[field] is None or math.isfinite(r[field])
    assert "nan" not in gzip.decompress((tmp_path / "results.json.gz").read_bytes()).decode().lower()
    summary = report.markdown_summary(means, skipped, runs=records)
    assert "| deb | none | 16 |" in summary
    gain = summary[summary.index("centred_target, context gain"):]
    assert "| model | policy | L | seed | L+8 | 2x | resolves (nats) | targets |" in gain
    assert len(report.plot_all(means, str(tmp_path))) == 2


def test_bad_settings_and_short_text_fail_clearly(tok):
    with pytest.raises(ValueError, match="lengths: 1 is too short"):
        length_study.StudySettings(lengths=(1,))
    with pytest.raises(ValueError, match="unknown policy"):
        length_study.StudySettings(policies=("wrap",))
    models = [length_study.EvalModel("deb", 0, "w", tiny(tok), tok, 16)]
    with pytest.raises(ValueError, match="shorter than the longest eval length"):
        length_study.run_study(models, {"d": ["just a few words here"]},
                               length_study.StudySettings(protocols=("chunked",)))


def test_centred_target_settings_that_give_no_targets_are_refused():
    with pytest.raises(ValueError, match="num_spans=0: the centred-target protocol needs at least one target span"):
        length_study.StudySettings(num_spans=0)
    with pytest.raises(ValueError, match="span=-2: pass a span length in tokens"):
        length_study.StudySettings(span=-2)


def test_a_span_longer_than_a_window_is_listed_as_not_evaluated(tok, docs):
    """A window of 8 cannot hold a span of 8 (with its [CLS] and [SEP]): that row is under "Not evaluated", not
    silently missing."""
    models = [length_study.EvalModel("deb", 0, "w", tiny(tok, num_layers=1), tok, 16)]
    settings = length_study.StudySettings(lengths=(8, 16, 32), protocols=("centred_target",), num_spans=2,
                                          bootstrap=10)
    records, skipped = length_study.run_study(models, {"d": docs}, settings)
    assert {r["eval_len"] for r in records} == {16, 32}
    assert [(s["eval_len"], s["reason"]) for s in skipped] == [
        (8, "centred_target: no window of 8 tokens holds a target span of 8")]
    assert "- deb / none at length 8: centred_target: no window" in report.markdown_summary(records, skipped)


def _workdir(root, name, family="deberta", tokenizer="{}", **changes):
    """A folder with what `check_labels` reads of a workdir: config.json and tokenizer.json."""
    from configs import bert, deberta

    config = {"deberta": deberta, "bert": bert}[family].get_config("micro")
    config.update_from_flattened_dict(changes)
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    (folder / "tokenizer.json").write_text(tokenizer)
    return str(folder)


def test_a_label_is_one_model_whose_runs_differ_only_in_seed(tmp_path):
    seeds = [_workdir(tmp_path, "deb-s0"), _workdir(tmp_path / "x", "deb-s1", seed=1, **{
        "data.cache_dir": "elsewhere", "train.log_every": 1, "model.attention_kernel": "blockwise"})]
    length_study.check_labels(seeds)
    with pytest.raises(ValueError, match=f"--workdir {seeds[0]}/ is given twice .*zero-width interval"):
        length_study.check_labels([seeds[0], seeds[0] + "/"])
    steps = _workdir(tmp_path / "y", "deb-s2", seed=2, **{"train.num_steps": 7})
    with pytest.raises(ValueError, match=f"--workdir {seeds[0]} and --workdir {steps} would both be reported as "
                                         r"'deb', .* differ in config.train.num_steps 100 vs 7: only runs"):
        length_study.check_labels([*seeds, steps])
    bert = _workdir(tmp_path / "z", "deb-s3", family="bert", seed=3)
    with pytest.raises(ValueError, match="config.model.attention 'disentangled' vs 'entangled'"):
        length_study.check_labels([seeds[0], bert])
    other_tokenizer = _workdir(tmp_path / "t", "deb-s4", tokenizer='{"other": 1}', seed=4)
    with pytest.raises(ValueError, match="differ in their tokenizer.json"):
        length_study.check_labels([seeds[0], other_tokenizer])
    # What the records carry: one config fingerprint for the seeds, another wherever check_labels names a difference.
    fingerprint = {w: length_study.run_identity(w, 100)["config"] for w in (*seeds, steps, bert, other_tokenizer)}
    assert fingerprint[seeds[0]] == fingerprint[seeds[1]] and len(set(fingerprint.values())) == 4
    # A repeated run has the same config: its seed is compared once the models are loaded, from their identities.
    again = _workdir(tmp_path / "copy", "deb-s0")
    length_study.check_labels([seeds[0], again])
    rows = [dict(length_study.run_identity(w, 100), model="deb", dataset="d", method="none")
            for w in (seeds[0], again)]
    with pytest.raises(ValueError, match=f"{seeds[0]} and {again} would both be reported as 'deb' on d, averaged as "
                                         "two seeds of one model, but both have seed 0: one run given twice, or a "
                                         "repeated run, is not another seed"):
        report.check_seed_groups(rows)
    with pytest.raises(ValueError, match="a transformers checkpoint has no seed"):
        length_study.check_labels([seeds[0]], [str(tmp_path / "hub" / "deb")])
    with pytest.raises(ValueError, match="'oracle', the name of a reference model"):
        length_study.check_labels([_workdir(tmp_path, "oracle")])


@pytest.mark.parametrize("fields, message", [
    (dict(methods=("window", "window")), "methods: 'window' given twice; give each once"),
    (dict(protocols=("chunked", "chunked")), "protocols: 'chunked' given twice"),
    (dict(policies=("clip", "clip")), "policies: 'clip' given twice"),
    (dict(protocols=()), "protocols: none given, so nothing would be scored; give one or more of ('chunked'"),
    (dict(policies=()), "policies: none given, so no model with a learned absolute table would be scored"),
    (dict(multiples=()), "multiples: none given, so there is no length to score"),
    (dict(max_eval_tokens=-100), "max_eval_tokens=-100: give a number of tokens to keep"),
    (dict(bootstrap=0), "bootstrap=0: the 95% intervals are percentiles over resamples"),
    (dict(mask_seed=-1), "mask_seed=-1: the seed of the fixed targets must be an integer from 0 up"),
])
def test_settings_that_would_score_something_else_than_asked_are_refused(fields, message):
    """eval.py's flags and a sweep's `eval` section alike (rows of tests/test_command_lines.py run a few as typed)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        length_study.StudySettings(**fields)


@pytest.mark.parametrize("value, message", [
    ("", "--out is empty: give a folder"),
    ("gs:/bucket/run", "--out='gs:/bucket/run' is neither a bucket URL nor a local path: write gs://bucket/run"),
    ("s3:bucket", "write s3://bucket (two slashes)"),
])
def test_a_location_that_would_name_another_folder_is_refused(value, message):
    from deberta_jax.data import errors

    with pytest.raises(ValueError, match=re.escape(message)):
        errors.check_location("--out", value)
    for fine in ("gs://bucket/run", "runs/a:b", "gs_runs/a"):
        errors.check_location("--out", fine)


def test_a_length_method_that_does_not_apply_is_listed_as_not_evaluated(tok, docs, tmp_path):
    """BERT has no relative distances to interpolate: its `+interpolate_distances` row is named under "Not evaluated",
    not silently missing; DeBERTa's is scored, and each record says which method it is."""
    models = [length_study.EvalModel("bert", 0, "b", tiny(tok, attention="entangled", position_biased_input=True,
                                                          num_layers=1), tok, 16),
              length_study.EvalModel("deb", 0, "d", tiny(tok, num_layers=1), tok, 16)]
    settings = length_study.StudySettings(lengths=(16,), protocols=("chunked",), policies=("clip",), bootstrap=10,
                                          methods=("interpolate_distances",))
    records, skipped = length_study.run_study(models, {"d": docs}, settings)
    assert {(r["model"], r["method"]) for r in records} == {
        ("bert", "none"), ("deb", "none"), ("deb+interpolate_distances", "interpolate_distances")}
    _, summary, _ = report.write_report(records, skipped, str(tmp_path))
    assert ("- bert+interpolate_distances: the length method 'interpolate_distances' does not apply to a model with "
            "attention='entangled'") in summary.split("## Not evaluated")[1]


def test_a_text_the_tokenizer_cannot_read_is_warned_about(tok, tmp_path):
    """Logged, and handed back for the report: summary.md says it at its top."""
    warnings = []
    models = [length_study.EvalModel("deb", 0, "w", tiny(tok), tok, 16)]
    settings = length_study.StudySettings(lengths=(16,), protocols=("chunked",), bootstrap=10)
    records, skipped = length_study.run_study(models, {"han": ["\u6f22\u5b57 words \u6f22\u5b57 " * 40] * 3},
                                              settings, warnings=warnings)
    assert len(warnings) == 1 and warnings[0].startswith("han: ")
    assert "% of its tokens are [UNK] under deb's tokenizer" in warnings[0]
    _, summary, _ = report.write_report(records, skipped, str(tmp_path), notes=warnings)
    assert warnings[0] in summary


def test_unigram_floor_scores_the_same_targets(corpus, docs, tok):
    from deberta_jax.study.baselines import UnigramModel

    unigram = UnigramModel(corpus.tokens, tok.get_vocab_size(), corpus.special)
    em = length_study.EvalModel("unigram", "-", "counts", unigram, tok, 16)
    settings = length_study.StudySettings(lengths=(16, 64), protocols=("chunked",), bootstrap=20)
    records, skipped = length_study.run_study([em], {"d": docs}, settings)
    labels = corpus.tokens[corpus.targets]
    expected = float(np.mean(-unigram.log_probs[labels]))
    losses = [r["value"] for r in records if r["metric"] == "loss" and r["bucket"] == "all"]
    assert not skipped and len(losses) == 2
    np.testing.assert_allclose(losses, expected, rtol=1e-9)
    assert np.isinf(unigram.log_probs[list(corpus.special.all)]).all()  # specials are never predicted


def test_transformers_checkpoint_is_evaluated_like_a_workdir(tmp_path, docs, tok):
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.DebertaV2Config(
        vocab_size=tok.get_vocab_size(), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, relative_attention=True, position_buckets=8,
        max_relative_positions=16, pos_att_type=["c2p", "p2c"], position_biased_input=False, type_vocab_size=0)
    transformers.DebertaV2ForMaskedLM(config).save_pretrained(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    notes = []
    em = length_study.load_hf_checkpoint(str(tmp_path), notes=notes)
    assert em.train_len == 32 and em.model.cfg.clamp_relative_positions
    assert notes == [f"{tmp_path.name}: the checkpoint does not record its training length, so 1x is taken to be 32 "
                     "tokens (its max_position_embeddings), and the lengths scored are multiples of that"]
    records, skipped = length_study.run_study(
        [em], {"d": docs}, length_study.StudySettings(multiples=(1, 4), extra=(), protocols=("chunked",), bootstrap=20))
    assert {r["eval_len"] for r in records if r["metric"] == "loss"} == {32, 128} and not skipped
    given = length_study.load_hf_checkpoint(str(tmp_path), trained_length=16, notes=notes)
    assert given.train_len == 16 and given.model.cfg.effective_trained_length == 16 and "(as given)" in notes[-1]


def test_an_export_carries_its_training_length_to_the_evaluation(tmp_path, tok):
    """A model trained at 16 tokens with room for 32 positions, exported: the evaluation's 1x is 16, not 32; a
    training length given against the recorded one is refused."""
    from deberta_jax.model import hf

    hf.save(tiny(tok), tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    notes = []
    em = length_study.load_hf_checkpoint(str(tmp_path), notes=notes)
    assert em.train_len == 16 and em.model.cfg.max_position_embeddings == 32 and notes == []
    with pytest.raises(ValueError, match="records its training length, 16 tokens .* not the 32 given"):
        length_study.load_hf_checkpoint(str(tmp_path), trained_length=32)


def test_oracle_scores_only_its_synthetic_dataset_and_gap_closed_is_the_share_of_the_gap():
    spec = "synthetic:markov:test:docs=3,doc_len=400"
    synth_tok = synthetic.tokenizer(spec)
    datasets = {"markov": load_documents(spec), "markov-seed1": load_documents(spec + ",seed=1")}
    model = length_study.EvalModel("deberta", 0, "w", tiny(synth_tok), synth_tok, 16)
    special = SpecialIds.from_tokenizer(synth_tok)
    stream = targets.build_corpus(datasets["markov"], synth_tok).tokens
    unigram = UnigramModel(stream[~np.isin(stream, special.all)], synth_tok.get_vocab_size(), special)
    references = [length_study.EvalModel("unigram", "-", "u", unigram, synth_tok, 16),
                  *length_study.oracle_references(model, {"markov": spec, "brown": "some/file.txt"})]
    assert [r.label for r in references] == ["unigram", "oracle"]  # no oracle for a text file
    settings = length_study.StudySettings(lengths=(16, 32), protocols=("chunked",), bootstrap=20)
    records, _ = length_study.run_study([model, *references], datasets, settings)
    loss = {(r["model"], r["dataset"], r["eval_len"]): r["value"] for r in records
            if r["metric"] == "loss" and r["bucket"] == "all"}
    assert {d for m, d, _ in loss if m == "oracle"} == {"markov"}  # the oracle knows one chain
    for n in (16, 32):
        assert loss["oracle", "markov", n] < loss["unigram", "markov", n] - 1.0
    gaps = report.add_gap_closed(records).query("metric == 'gap_closed' and model == 'deberta'")
    gaps = dict(zip(gaps["eval_len"], gaps["value"]))
    assert set(gaps) == {16, 32}  # only where both references were scored
    u, o, m = (loss[name, "markov", 16] for name in ("unigram", "oracle", "deberta"))
    assert gaps[16] == pytest.approx((u - m) / (u - o))


def test_curves_refuse_runs_that_did_not_see_the_same_batches(tmp_path, monkeypatch):
    from configs import bert, deberta
    from deberta_jax.study import curves
    from deberta_jax.train import checkpoint

    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.txt", "valid.txt", "other.txt"):
        (data / name).write_text(f"{name}\n")

    def config(family, train="train.txt", data_dir=str(data)):
        c = family.get_config("micro")
        c.data.train_files, c.data.eval_files = f"{data_dir}/{train}", f"{data_dir}/valid.txt"
        return c

    monkeypatch.chdir(tmp_path)
    checkpoint.write_config(tmp_path / "a", config(deberta))
    # Another model, the same files spelled relative to the working directory, the same schedule.
    checkpoint.write_config(tmp_path / "b", config(bert, data_dir="data"))
    curves.check_same_batches({"a": str(tmp_path / "a"), "b": str(tmp_path / "b")})
    other = config(bert)
    other.train.learning_rate = 0.5
    checkpoint.write_config(tmp_path / "c", other)
    with pytest.raises(ValueError, match=r"c .* was not trained like a: config.train.learning_rate 0.001 vs 0.5"):
        curves.check_same_batches({"a": str(tmp_path / "a"), "c": str(tmp_path / "c")})
    checkpoint.write_config(tmp_path / "d", config(bert, train="other.txt"))
    with pytest.raises(ValueError, match=r"d .* config.data.train_files '.*/train.txt' vs '.*/other.txt'"):
        curves.check_same_batches({"a": str(tmp_path / "a"), "d": str(tmp_path / "d")})


def test_a_moved_training_file_is_named_as_the_unigram_floors_with_the_ways_on(tmp_path, tok):
    """The floor's counts come from the files the workdir's config names, a path the user never gave eval.py."""
    from configs import deberta
    from deberta_jax.train import checkpoint

    config = deberta.get_config("micro")
    config.data.train_files = str(tmp_path / "moved" / "train.txt")
    checkpoint.write_config(tmp_path, config)
    with pytest.raises(FileNotFoundError) as err:
        length_study.unigram_reference(length_study.EvalModel("run", 0, str(tmp_path), None, tok, 16))
    message = str(err.value)
    assert f"{tmp_path}'s config.json" in message and config.data.train_files in message
    assert "--unigram=false" in message and "\n" not in message


def test_progress_is_one_bar_on_a_terminal_and_a_line_per_unit_elsewhere():
    units = ["deb on d at N=16", "deb on d at N=32"]

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream in (io.StringIO(), Terminal()):
        progress = length_study.Progress(len(units), stream)
        for what in units:
            progress.advance()
            progress.scoring(what)
        progress.close()
        if isinstance(stream, Terminal):  # one bar, redrawn in place, ending at 2/2 with the last unit's name
            assert stream.getvalue().count("\n") == 1 and "deb on d at N=32: 100%" in stream.getvalue()
            assert "2/2" in stream.getvalue()
        else:
            lines = stream.getvalue().splitlines()
            assert [line.split(" (")[0] for line in lines] == [f"scoring {i}/2: {u}" for i, u in enumerate(units, 1)]


def test_context_use_is_the_paired_difference_per_document(tok, docs, tmp_path):
    """Two seeds scored with full attention and with window_global: each seed's context use is its full-attention
    loss minus its windowed loss on the same targets (0 at 1x, where the window holds every key), with a bootstrap
    interval over documents; the mean over seeds resamples the documents jointly; summary.md shows both."""
    models = [length_study.EvalModel("deb", seed, f"d{seed}", tiny(tok, seed=seed), tok, 16) for seed in (0, 1)]
    settings = length_study.StudySettings(lengths=(16, 64), protocols=("chunked",), bootstrap=200,
                                          methods=("window_global",))
    records, skipped = length_study.run_study(models, {"d": docs}, settings)
    loss = {(r["model"], r["seed"], r["eval_len"]): r["value"] for r in records
            if r["metric"] == "loss" and r["bucket"] == "all"}
    paired = {(r["seed"], r["eval_len"]): r for r in records if r["metric"] == "context_use:window_global"}
    assert set(paired) == {(0, 16), (0, 64), (1, 16), (1, 64)}
    for (seed, n), r in paired.items():
        assert r["model"] == "deb" and r["method"] == "none"
        assert r["value"] == pytest.approx(loss["deb", seed, n] - loss["deb+window_global", seed, n], abs=1e-9)
        assert sum(r["doc_count"]) == r["n_tokens"] and len(r["doc_diff"]) == len(docs)
    assert paired[0, 16]["value"] == pytest.approx(0, abs=1e-6)
    assert all(paired[s, 64]["value"] != 0 for s in (0, 1))  # untrained: ~1e-5, the window still hides keys
    for seed in (0, 1):
        r = paired[seed, 64]
        assert r["ci_low"] < r["value"] < r["ci_high"]
    means, summary, _ = report.write_report(records, skipped, str(tmp_path))
    mean = means[(means["metric"] == "context_use:window_global") & (means["eval_len"] == 64)].iloc[0]
    pooled = report.pooled_interval(pd.DataFrame([paired[0, 64], paired[1, 64]]))
    assert (mean["ci_low"], mean["ci_high"]) == pytest.approx(pooled)
    assert mean["value"] == pytest.approx((paired[0, 64]["value"] + paired[1, 64]["value"]) / 2)
    table = summary.split("context use past L")[1]
    assert "| deb | none | 16 | 0 |" in table and "| deb | none | 16 | mean |" in table
    assert f"{mean['value']:.3f} [{mean['ci_low']:.3f}, {mean['ci_high']:.3f}]" in table
    rebuilt = report.rebuild_report(str(tmp_path))[0]
    again = rebuilt[(rebuilt["metric"] == "context_use:window_global") & (rebuilt["eval_len"] == 64)].iloc[0]
    assert (again["ci_low"], again["ci_high"]) == pytest.approx(pooled)


def test_context_use_refuses_losses_of_different_targets():
    em = length_study.EvalModel("deb", 0, "d", None, None, 16)
    unit = ("d", 0, "brown", "none", 64, "chunked", None)
    scored = {(*unit, "none"): (em, np.ones(3), np.array([5.0, 5.0, 5.0])),
              (*unit, "window_global"): (em, np.ones(3), np.array([5.0, 4.0, 5.0]))}
    with pytest.raises(ValueError, match="scored on different targets, so their losses do not pair"):
        length_study.context_use_records(scored, {"brown": np.zeros((4, 3), int)})
