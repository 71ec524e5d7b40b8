"""Synthetic position-diagnostic data: specs, the generator, its tokenizer, packing, and the exact oracle."""

import dataclasses
import itertools
import os
import subprocess
import sys

import numpy as np
import pytest

from deberta_jax.data import packing, synthetic, targets
from deberta_jax.data.packing import cache_path, load_or_pack, token_stream
from deberta_jax.data.text import load_documents
from deberta_jax.data.tokenizer import SPECIAL_TOKENS, SpecialIds
from deberta_jax.study import baselines, length_study
from deberta_jax.study.baselines import OracleModel, UnigramModel
from deberta_jax.study.scoring import score_windows
from tests.helpers import REPO

SMALL = "vocab=5,branch=2,doc_len=300,docs=40"


# --- specs ---


def test_defaults_are_filled_in_and_the_canonical_spec_ignores_spelling():
    task = synthetic.parse("synthetic:markov")
    assert (task.split, task.stride, task.docs * task.doc_len) == ("train", 1, pytest.approx(2_000_000, rel=0.01))
    assert synthetic.parse("synthetic:stride:test").stride == 16
    assert synthetic.parse("synthetic:markov:validation").docs * task.doc_len == pytest.approx(100_000, rel=0.03)
    same = ["synthetic:markov:train:vocab=8", "synthetic:markov:vocab=8", "synthetic:markov::seed=0, vocab=8",
            "synthetic:markov:train:vocab=8,docs=977",
            f"synthetic:markov:train:vocab=8,order={synthetic.DEFAULTS['order']}"]
    assert len({synthetic.canonical_spec(spec) for spec in same}) == 1
    assert synthetic.canonical_spec("synthetic:markov:vocab=8") != synthetic.canonical_spec("synthetic:markov:vocab=9")


@pytest.mark.parametrize("spec, named", [
    ("synthetic:lm", "markov, stride"),
    ("synthetic:markov:dev", "train, validation, test"),
    ("synthetic:markov:train:width=3", "vocab, order, branch, doc_len, docs, seed"),
    ("synthetic:markov:train:stride=3", "valid: vocab"),  # stride belongs to the stride task only
    ("synthetic:markov:train:vocab=many", "vocab='many' is not an integer"),
    ("synthetic:markov:train:vocab", "'vocab' has no value"),
    ("synthetic:markov:train:vocab=1", "vocab=1 is below its minimum 2"),
    ("synthetic:markov:train:vocab=4,branch=5", "branch=5 exceeds vocab=4"),
    ("synthetic:markov:train:vocab=64,order=4", "lower vocab or order"),
    ("synthetic:markov:train:seed=1,seed=2", "'seed' given twice"),
    ("synthetic:markov:train:test:vocab=4", "too many"),
])
def test_bad_specs_name_the_valid_choices(spec, named):
    with pytest.raises(ValueError, match="synthetic:TASK") as err:
        load_documents(spec)
    assert named in str(err.value)


# --- documents ---


def test_documents_are_deterministic_and_splits_are_independent_samples():
    spec = f"synthetic:stride:train:{SMALL},stride=4"
    docs = load_documents(spec)
    assert docs == load_documents(spec)
    assert len(docs) == 40 and all(len(doc.split()) == 300 for doc in docs)
    assert set(" ".join(docs).split()) <= set(synthetic.symbol_words(5))
    assert load_documents(spec.replace("docs=40", "docs=3")) == docs[:3]  # document i ignores `docs`
    validation = load_documents(spec.replace("train", "validation"))
    assert validation[0] != docs[0] and not set(validation) & set(docs)
    assert load_documents(spec + ",seed=1") != docs
    # The same process for every split: one chain for each seed, whatever the split or task.
    chains = [synthetic.chain(synthetic.parse(s)) for s in (spec, spec.replace("train", "test"))]
    np.testing.assert_array_equal(chains[0].probs, chains[1].probs)


@pytest.mark.parametrize("vocab, order", [(2, 5), (3, 2), (5, 3), (7, 1)])
def test_de_bruijn_holds_every_context_once(vocab, order):
    cycle = synthetic.de_bruijn(vocab, order)
    wrapped = np.concatenate([cycle, cycle[: order - 1]])
    assert len(cycle) == vocab**order == len({tuple(wrapped[i : i + order]) for i in range(len(cycle))})


def _transition_counts(seqs: np.ndarray, vocab: int, order: int) -> np.ndarray:
    """[S, V] counts of (context state, next symbol) along the rows of `seqs`."""
    state = sum(seqs[:, i : seqs.shape[1] - order + i] * vocab ** (order - 1 - i) for i in range(order))
    counts = np.zeros((vocab**order, vocab))
    np.add.at(counts, (state.ravel(), seqs[:, order:].ravel()), 1)
    return counts


@pytest.mark.parametrize("spec", ["synthetic:markov:train:vocab=4,order=2,branch=2,doc_len=200,docs=500",
                                  "synthetic:stride:train:vocab=4,branch=3,stride=3,doc_len=201,docs=500"])
def test_empirical_transitions_and_marginals_match_the_chain(spec):
    task = synthetic.parse(spec)
    chain = synthetic.chain(task)
    docs = synthetic.symbols(task)
    # Split each document into its `stride` chains: positions c, c + D, c + 2D, ...
    seqs = docs.reshape(task.docs, -1, task.stride).transpose(0, 2, 1).reshape(task.docs * task.stride, -1)
    counts = _transition_counts(seqs, task.vocab, task.order)
    seen = counts.sum(axis=1) > 500
    assert seen.sum() >= 0.5 * chain.num_states
    np.testing.assert_allclose(counts[seen] / counts[seen].sum(axis=1, keepdims=True), chain.probs[seen], atol=0.04)
    assert ((counts > 0) <= (chain.probs > 0)).all()  # only the `branch` successors ever follow a context
    # Stationary from the first symbol on: the first and the last position have the same marginal.
    marginal = chain.stationary.reshape(-1, task.vocab).sum(axis=0)
    for column in (docs[:, 0], docs[:, -1]):
        np.testing.assert_allclose(np.bincount(column, minlength=task.vocab) / task.docs, marginal, atol=0.07)
    if task.stride > 1:  # neighbours carry nothing: x_t and x_{t+1} are independent
        joint = _transition_counts(docs, task.vocab, 1)
        np.testing.assert_allclose(joint / joint.sum(), np.outer(marginal, marginal), atol=0.02)


def test_each_symbol_is_one_token_after_the_special_tokens():
    tok = synthetic.tokenizer("synthetic:markov:validation:vocab=12")
    words = synthetic.symbol_words(12)
    assert tok.get_vocab_size() == len(SPECIAL_TOKENS) + 12
    assert SpecialIds.from_tokenizer(tok) == SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)
    encoding = tok.encode(" ".join(reversed(words)))
    assert encoding.tokens == ["[CLS]", *reversed(words), "[SEP]"]
    np.testing.assert_array_equal(synthetic.symbol_ids(tok, 12), np.arange(5, 17))
    assert tok.decode(encoding.ids) == " ".join(reversed(words))


def test_train_uses_the_symbol_tokenizer_for_synthetic_train_files(tmp_path):
    import train  # jax and flax: imported only here
    from configs import bert

    config = bert.get_config("micro")
    config.data.train_files = "synthetic:markov:train:vocab=7"
    expected = synthetic.tokenizer("synthetic:markov:vocab=7")
    assert train.prepare_tokenizer(config, tmp_path).to_str() == expected.to_str()


def test_packing_caches_by_canonical_spec_and_generator_version(tmp_path, monkeypatch):
    spec = f"synthetic:markov:validation:{SMALL}"
    tok = synthetic.tokenizer(spec)
    packed = load_or_pack(spec, tok, 32, tmp_path)
    assert packed.num_rows == -(-(40 * 300 + 39) // 30)  # every symbol one token, [SEP] between documents
    assert not np.isin(packed.input_ids, [SpecialIds.from_tokenizer(tok).unk]).any()
    monkeypatch.setattr(packing, "iter_documents", lambda spec: pytest.fail("cache miss"))
    respelled = f"synthetic:markov:validation:seed=0,{SMALL}"
    np.testing.assert_array_equal(load_or_pack(respelled, tok, 32, tmp_path).input_ids, packed.input_ids)
    assert cache_path(spec + ",seed=1", tok, tmp_path) != cache_path(spec, tok, tmp_path)
    before = cache_path(spec, tok, tmp_path)
    monkeypatch.setattr(synthetic, "GENERATOR_VERSION", synthetic.GENERATOR_VERSION + 1)
    assert cache_path(spec, tok, tmp_path) != before


# --- the oracle ---


def _brute_force_posteriors(task, ids, mask, hidden, tok) -> dict[int, np.ndarray]:
    """Posterior of every hidden cell by enumerating all its assignments with the generator's joint law.

    A segment (between [CLS]/[SEP]/padding) splits into `stride` chains; a chain of n symbols has
    probability stationary(first `order` symbols) * product of transitions, summed over unseen symbols.
    """
    chain, vocab, order = synthetic.chain(task), task.vocab, task.order
    symbol_of = {int(t): s for s, t in enumerate(synthetic.symbol_ids(tok, vocab))}
    is_boundary = ~np.isin(ids, list(symbol_of) + [SpecialIds.from_tokenizer(tok).mask]) | (mask == 0)
    cells = np.flatnonzero(hidden)

    def chain_prob(seq):
        padded = list(seq) + [None] * max(order - len(seq), 0)  # short chains: marginal of the start state
        total = 0.0
        for fill in itertools.product(range(vocab), repeat=sum(x is None for x in padded)):
            it = iter(fill)
            xs = [next(it) if x is None else x for x in padded]
            state = sum(x * vocab ** (order - 1 - i) for i, x in enumerate(xs[:order]))
            p = chain.stationary[state]
            for x in xs[order:]:
                p *= chain.probs[state, x]
                state = state % vocab ** (order - 1) * vocab + x
            total += p
        return total

    def row_prob(values):
        p, start = 1.0, 0
        for end in [*np.flatnonzero(is_boundary), len(values)]:
            segment = values[start:end]
            for c in range(task.stride):
                if segment[c :: task.stride]:
                    p *= chain_prob(segment[c :: task.stride])
            start = end + 1
        return p

    post = {int(c): np.zeros(vocab) for c in cells}
    base = [None if (hidden[i] or is_boundary[i]) else symbol_of.get(int(ids[i])) for i in range(len(ids))]
    for fill in itertools.product(range(vocab), repeat=len(cells)):
        values = list(base)
        for c, x in zip(cells, fill):
            values[c] = x
        p = row_prob(values)
        for c, x in zip(cells, fill):
            post[int(c)][x] += p
    return {c: v / v.sum() for c, v in post.items()}


@pytest.mark.parametrize("spec", ["synthetic:markov:validation:vocab=3,branch=2,doc_len=40,docs=4",
                                  "synthetic:markov:validation:vocab=3,order=2,branch=2,doc_len=40,docs=4",
                                  "synthetic:stride:validation:vocab=3,branch=2,stride=2,doc_len=40,docs=4"])
def test_oracle_equals_brute_force_enumeration(spec, monkeypatch):
    task = synthetic.parse(spec)
    tok = synthetic.tokenizer(spec)
    sp = SpecialIds.from_tokenizer(tok)
    stream = token_stream(load_documents(spec), tok, sp.sep)
    rng = np.random.default_rng(0)
    rows, hidden = [], []
    # Rows cut mid-document, with document boundaries ([SEP]) inside, and segments shorter than `order`.
    for start, n, sep_at in [(3, 9, None), (36, 10, 4), (80, 11, 1), (120, 8, 5)]:
        row = np.concatenate([[sp.cls], stream[start : start + n], [sp.sep], [sp.pad] * (12 - n)])
        if sep_at is not None:
            row[sep_at] = sp.sep  # a document boundary inside the row
        content = np.flatnonzero(~np.isin(row, sp.all))
        chosen = rng.choice(content, size=4, replace=False)
        row[chosen[:1]] = sp.mask  # a [MASK] that is not a target: unobserved, not scored
        rows.append(row)
        hidden.append(np.isin(np.arange(len(row)), chosen[1:]))
    ids, hidden = np.array(rows), np.array(hidden)
    mask = (ids != sp.pad).astype(np.int32)
    oracle = OracleModel(spec, tok)
    positions = np.flatnonzero(hidden)
    labels = ids.reshape(-1)[positions]  # targets keep their symbol in these rows: the oracle must not look
    nll, _ = oracle.scorer()(ids, mask, positions, labels)
    post = oracle.posteriors(ids, mask, hidden)
    for r in range(len(ids)):
        expected = _brute_force_posteriors(task, ids[r], mask[r], hidden[r] | (ids[r] == sp.mask), tok)
        for c in np.flatnonzero(hidden[r]):
            np.testing.assert_allclose(post[r, c], expected[c], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(nll, -np.log(post.reshape(-1, task.vocab)[positions, oracle.symbol_of[labels]]))
    monkeypatch.setattr(baselines, "MESSAGE_BUDGET", 1)  # one row at a time
    np.testing.assert_allclose(oracle.posteriors(ids, mask, hidden), post, rtol=1e-12)


def test_oracle_is_below_the_unigram_floor_and_rejects_foreign_windows():
    spec = "synthetic:stride:validation:vocab=8,branch=2,stride=4,doc_len=500,docs=20"
    tok = synthetic.tokenizer(spec)
    corpus = targets.build_corpus(load_documents(spec), tok, seed=0)
    windows = targets.chunked_windows(corpus, 48)
    unigram = UnigramModel(corpus.tokens[~np.isin(corpus.tokens, corpus.special.all)], tok.get_vocab_size(),
                           corpus.special)
    oracle = OracleModel(spec, tok)
    floor = score_windows(unigram.scorer(), corpus, windows, batch_size=16, bucket_width=8)
    best = score_windows(oracle.scorer(), corpus, windows, batch_size=16, bucket_width=8)
    assert best.count == floor.count > 1000
    assert best.loss < floor.loss - 0.5 and best.accuracy > floor.accuracy
    with pytest.raises(ValueError, match="cannot produce"):  # the chain of another seed
        score_windows(OracleModel(spec + ",seed=1", tok).scorer(), corpus, windows, batch_size=16, bucket_width=8)
    with pytest.raises(ValueError, match=r"lacks the symbol tokens \['s4'"):
        OracleModel(spec, synthetic.tokenizer("synthetic:markov:vocab=4"))


def test_generation_benchmark_reports_rates():
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "synthetic_data.py"), "--split",
                             "validation", "--params", "doc_len=256,docs=8"], capture_output=True, text=True,
                            timeout=300, cwd=REPO, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:]] == list(synthetic.TASKS)
    assert all("docs/s" in line and "tokens/s" in line and "pack" in line for line in lines[1:])


def test_a_task_without_an_exact_oracle_gets_none(monkeypatch):
    noisy = dataclasses.replace(synthetic.TASKS["markov"], name="noisy", exact_oracle=False)
    monkeypatch.setitem(synthetic.TASKS, "noisy", noisy)
    spec = "synthetic:noisy:validation:docs=2,doc_len=64"
    assert synthetic.has_exact_oracle("synthetic:markov") and not synthetic.has_exact_oracle(spec)
    tok = synthetic.tokenizer(spec)
    em = length_study.EvalModel("m", 0, "w", None, tok, 16)
    oracles = length_study.oracle_references(em, {"a": "synthetic:markov:validation", "b": spec})
    assert [o.dataset for o in oracles] == ["a"]
    with pytest.raises(ValueError, match="registers no exact oracle"):
        OracleModel(spec, tok)
