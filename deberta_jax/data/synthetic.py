"""Synthetic corpora with known structure, for position diagnostics: `synthetic:TASK[:SPLIT][:PARAMS]`.

A synthetic spec is accepted wherever a text spec is (`text.load_documents`), e.g.

    synthetic:markov                              the markov task, train split, every parameter at its default
    synthetic:markov:validation:order=2,vocab=16  validation split, two parameters changed
    synthetic:stride:test:stride=8                (SPLIT may be left out before PARAMS: synthetic:markov:seed=3)

SPLIT is `train` (default), `validation` or `test`. PARAMS is a comma-separated list of `name=integer`.
A document is a string of whitespace-separated symbol words `s0 s13 s7 ...`, so the normal text pipeline
applies; `tokenizer(spec)` gives a tokenizer in which every symbol is exactly one token.

Tasks (every one is a sparse order-`order` Markov chain over `vocab` symbols: each context of `order`
symbols has `branch` possible successors, with probabilities drawn from a flat Dirichlet; one of them
lies on a de Bruijn cycle through all contexts, so the chain is irreducible and every symbol occurs):
  - `markov`: the chain runs along the positions of a document, so a masked symbol is predictable from its
    neighbours; what a model must learn is "look at the tokens next to me", a short relative offset.
  - `stride`: `stride` independent chains interleaved, the chain running along t, t+D, t+2D, ... (D = `stride`):
    x_t depends on x_{t-D} and x_{t+D} (for order k: x_{t-kD} .. x_{t+kD} in steps of D) and on nothing
    nearer, a longer-range *relative* dependency.

Parameters (all integers; defaults in `DEFAULTS`):
  vocab    number of symbols                              order    context length of the chain (1 = bigram)
  branch   successors per context (1 <= branch <= vocab)  stride   interleaved chains (the `stride` task only)
  doc_len  symbols per document (long, so evaluation windows rarely cross a document boundary)
  docs     documents in the split (default: about `SPLIT_TOKENS[split]` tokens)
  seed     seeds the chain and the documents
The markov defaults (32 symbols, order 1, 3 successors) leave a wide gap for models to close and are learned
by both families under the ablation recipe (2 x 128, 800 steps of 32 x 64 tokens). Measured when they were
chosen, chunked loss at length 64 on `synthetic:markov:validation`: unigram floor 3.26 nats, BERT (learned
absolute positions) 1.59, DeBERTa 0.20, oracle 0.13.

Determinism and splits: the chain (successors and probabilities) depends only on vocab, order, branch and
seed; the documents also on the split, which picks an independent random stream, so `train`,
`validation` and `test` are independent samples of the same process. Document i depends on neither
`docs` nor the documents after it. Every chain starts in its stationary distribution (`Chain.stationary`,
over contexts), so every position of a document is marginally stationary: a window cut anywhere in a
document sees the same process as one starting at a document's beginning. `reference.OracleModel` uses
exactly this to compute the Bayes-optimal prediction of every masked symbol.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from tokenizers import Tokenizer, models

from deberta_jax.data.tokenizer import SPECIAL_TOKENS, configure

SYNTHETIC_PREFIX = "synthetic:"
# Bump when the documents a spec generates change, so packed caches of older generators are not reused.
GENERATOR_VERSION = 1
SYMBOL_PREFIX = "s"
SPLITS = ("train", "validation", "test")
SPLIT_TOKENS = {"train": 2_000_000, "validation": 100_000, "test": 100_000}
DEFAULTS = {"vocab": 32, "order": 1, "branch": 3, "stride": 16, "doc_len": 2048, "seed": 0}


@dataclasses.dataclass(frozen=True)
class TaskKind:
    """A registered task: the parameters it reads (`docs` has a per-split default, see `_default_docs`), how it
    lays out symbols, and whether `study.baselines.OracleModel` computes its exact Bayes-optimal loss.

    Every task here is a stationary Markov chain (`Chain`) read along positions t, t + D, t + 2D, ... (D =
    `stride`, 1 without interleaving), which is what the oracle's forward-backward pass assumes; a task of
    another kind registers `exact_oracle=False`, and the study then scores no oracle for it.
    """

    name: str
    params: tuple[str, ...]
    interleaved: bool  # reads `stride` (else stride is 1)
    exact_oracle: bool = True


# The one list of synthetic tasks: specs, the sweep configs and the oracle read it.
TASKS = {kind.name: kind for kind in (
    TaskKind("markov", ("vocab", "order", "branch", "doc_len", "docs", "seed"), interleaved=False),
    TaskKind("stride", ("vocab", "order", "branch", "stride", "doc_len", "docs", "seed"), interleaved=True),
)}
MINIMA = {"vocab": 2, "order": 1, "branch": 1, "stride": 1, "doc_len": 1, "docs": 1, "seed": 0}
# The transition table has vocab ** (order + 1) entries (float64); this bound keeps it under 32 MiB.
MAX_TABLE_ENTRIES = 1 << 22
DIRICHLET_CONCENTRATION = 1.0
EXAMPLE_SPEC = "synthetic:markov:validation:order=2,vocab=16"


def is_synthetic_spec(spec: str) -> bool:
    """True for `synthetic:TASK[:SPLIT][:PARAMS]` specs, which name generated data instead of files."""
    return spec.startswith(SYNTHETIC_PREFIX)


@dataclasses.dataclass(frozen=True)
class Task:
    """A parsed synthetic spec with every parameter filled in; `stride` is 1 for `markov`."""

    name: str
    split: str
    vocab: int
    order: int
    branch: int
    stride: int
    doc_len: int
    docs: int
    seed: int

    @property
    def spec(self) -> str:
        """The canonical spec: the same for every way of writing this task (defaults spelled out, sorted)."""
        params = ",".join(f"{name}={getattr(self, name)}" for name in sorted(TASKS[self.name].params))
        return f"{SYNTHETIC_PREFIX}{self.name}:{self.split}:{params}"


def _spec_error(spec: str, problem: str) -> ValueError:
    return ValueError(
        f"synthetic data spec {spec!r}: {problem}. Syntax: synthetic:TASK[:SPLIT][:PARAMS], e.g. {EXAMPLE_SPEC!r}"
    )


def _default_docs(split: str, doc_len: int) -> int:
    return -(-SPLIT_TOKENS[split] // doc_len)


def _parse_params(spec: str, text: str, name: str) -> dict[str, int]:
    valid = TASKS[name].params
    params: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (s.strip() for s in item.partition("="))
        if key not in valid:
            raise _spec_error(spec, f"unknown parameter {key!r} for task {name!r}; valid: {', '.join(valid)}")
        if not sep:
            raise _spec_error(spec, f"parameter {key!r} has no value; write {key}=INTEGER")
        if key in params:
            raise _spec_error(spec, f"parameter {key!r} given twice")
        try:
            params[key] = int(value)
        except ValueError:
            raise _spec_error(spec, f"parameter {key}={value!r} is not an integer") from None
        if params[key] < MINIMA[key]:
            raise _spec_error(spec, f"parameter {key}={params[key]} is below its minimum {MINIMA[key]}")
    return params


def parse(spec: str) -> Task:
    """Parses and checks a synthetic spec, filling in defaults; errors name the valid tasks/splits/params."""
    if not is_synthetic_spec(spec):
        raise _spec_error(spec, f"does not start with {SYNTHETIC_PREFIX!r}")
    name, *rest = (part.strip() for part in spec[len(SYNTHETIC_PREFIX) :].split(":"))
    if name not in TASKS:
        raise _spec_error(spec, f"unknown task {name!r}; choose one of {', '.join(TASKS)}")
    params_text = rest.pop() if len(rest) == 2 or (rest and "=" in rest[-1]) else ""
    if len(rest) > 1:
        raise _spec_error(spec, "too many ':'-separated fields")
    split = (rest[0] if rest else "") or "train"
    if split not in SPLITS:
        raise _spec_error(spec, f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    params = {**DEFAULTS, "stride": DEFAULTS["stride"] if TASKS[name].interleaved else 1}
    params.update(_parse_params(spec, params_text, name))
    params.setdefault("docs", _default_docs(split, params["doc_len"]))
    if params["branch"] > params["vocab"]:
        raise _spec_error(spec, f"branch={params['branch']} exceeds vocab={params['vocab']}; lower branch")
    # With vocab >= 2 a long order alone is too many; checked first, so no huge power is ever computed.
    order, vocab = params["order"], params["vocab"]
    if order >= MAX_TABLE_ENTRIES.bit_length() or vocab ** (order + 1) > MAX_TABLE_ENTRIES:
        raise _spec_error(spec, f"vocab**(order+1) = {vocab}**{order + 1} transition probabilities exceed "
                                f"{MAX_TABLE_ENTRIES}; lower vocab or order")
    return Task(name=name, split=split, **params)


def has_exact_oracle(spec: str) -> bool:
    """Whether the task of `spec` registers an exact Bayes-optimal oracle (`TaskKind.exact_oracle`)."""
    return TASKS[parse(spec).name].exact_oracle


def canonical_spec(spec: str) -> str:
    """The spec with defaults filled in and parameters sorted: what identifies the generated documents."""
    return parse(spec).spec


@dataclasses.dataclass(frozen=True, eq=False)
class Chain:
    """A sparse order-k Markov chain over V symbols, on contexts (states) s = x_{t-k+1} V^{k-1} + ... + x_t.

    `probs[s, y]` is P(x_{t+1} = y | state s), nonzero for `branch` symbols y; the next state is
    (s mod V^{k-1}) V + y. `stationary[s]` is the stationary distribution over states.
    """

    vocab: int
    order: int
    successors: np.ndarray  # int64 [S, branch], the symbols that may follow each state
    cumulative: np.ndarray  # float64 [S, branch], cumulative probabilities of `successors`, last exactly 1
    probs: np.ndarray  # float64 [S, V]
    stationary: np.ndarray  # float64 [S]

    @property
    def num_states(self) -> int:
        return self.probs.shape[0]

    def push(self, dist: np.ndarray) -> np.ndarray:
        """One step forward: [R, S] (unnormalized) distributions over the state now -> over the next state."""
        rows, contexts = dist.shape[0], self.num_states // self.vocab
        # state a*K + k (a: oldest symbol, k: the rest) goes to k*V + y: a batched matmul over k.
        by_rest = dist.reshape(rows, self.vocab, contexts).transpose(2, 0, 1)  # [K, R, a]
        return (by_rest @ self._table).transpose(1, 0, 2).reshape(rows, -1)  # [K, R, y] -> [R, K*V + y]

    def pull(self, weights: np.ndarray) -> np.ndarray:
        """One step backward: [R, S] weights on the next state -> their expectation from each state now."""
        rows, contexts = weights.shape[0], self.num_states // self.vocab
        by_rest = weights.reshape(rows, contexts, self.vocab).transpose(1, 2, 0)  # [K, y, R]
        return (self._table @ by_rest).transpose(2, 1, 0).reshape(rows, -1)  # [K, a, R] -> [R, a*K + k]

    @functools.cached_property
    def _table(self) -> np.ndarray:
        """`probs` as [K, a, y]: the rest of the context, its oldest symbol, the next symbol."""
        contexts = self.num_states // self.vocab
        return np.ascontiguousarray(self.probs.reshape(self.vocab, contexts, self.vocab).transpose(1, 0, 2))


def _stationary(chain: Chain, tol: float = 1e-14, max_steps: int = 100_000) -> np.ndarray:
    """The stationary distribution, by power iteration of the lazy chain (P + I) / 2 from uniform.

    The lazy chain has the same stationary distribution and is aperiodic, so the iteration converges
    even where the successor graph is periodic.
    """
    dist = np.full((1, chain.num_states), 1.0 / chain.num_states)
    for _ in range(max_steps):
        new = 0.5 * (dist + chain.push(dist))
        new /= new.sum()
        if np.abs(new - dist).sum() < tol:
            break
        dist = new
    return new[0]


def de_bruijn(vocab: int, order: int) -> np.ndarray:
    """A de Bruijn sequence: read cyclically, every `order`-tuple of symbols appears in it exactly once.

    Built by concatenating, in lexicographic order, the Lyndon words whose length divides `order`
    (Fredricksen, Kessler and Maiorana).
    """
    sequence: list[int] = []
    word = [-1]
    while word:
        word[-1] += 1
        if order % len(word) == 0:
            sequence.extend(word)
        word = (word * (order // len(word) + 1))[:order]  # the next candidate: repeat, then trim
        while word and word[-1] == vocab - 1:
            word.pop()
    return np.asarray(sequence, dtype=np.int64)


def _cycle_successors(vocab: int, order: int, rng: np.random.Generator) -> np.ndarray:
    """For each state, the symbol after it along a de Bruijn cycle (symbols randomly relabelled), [S].

    Following these successors visits every state, so a chain that allows them is irreducible: its
    stationary distribution is unique and puts weight on every state.
    """
    cycle = rng.permutation(vocab)[de_bruijn(vocab, order)]
    windows = np.lib.stride_tricks.sliding_window_view(np.concatenate([cycle, cycle[:order]]), order + 1)
    states = windows[:, :-1] @ vocab ** np.arange(order - 1, -1, -1)
    successors = np.empty(vocab**order, dtype=np.int64)
    successors[states] = windows[:, -1]
    return successors


@functools.lru_cache(maxsize=8)
def _build_chain(vocab: int, order: int, branch: int, seed: int) -> Chain:
    rng = np.random.default_rng([seed, 0])  # stream 0: the chain; streams 1.. : the splits' documents
    states = vocab**order
    keys = rng.random((states, vocab))
    np.put_along_axis(keys, _cycle_successors(vocab, order, rng)[:, None], -1.0, axis=1)  # always a successor
    successors = np.argsort(keys, axis=1)[:, :branch]  # the cycle's successor, then random others
    weights = rng.dirichlet(np.full(branch, DIRICHLET_CONCENTRATION), size=states)
    probs = np.zeros((states, vocab))
    np.put_along_axis(probs, successors, weights, axis=1)
    cumulative = np.cumsum(weights, axis=1)
    cumulative[:, -1] = 1.0  # so a uniform draw in [0, 1) always lands on a successor
    chain = Chain(vocab, order, successors, cumulative, probs, np.empty(0))
    return dataclasses.replace(chain, stationary=_stationary(chain))


def chain(task: Task) -> Chain:
    """The task's chain; it depends only on vocab, order, branch and seed, so every split shares it."""
    return _build_chain(task.vocab, task.order, task.branch, task.seed)


def sample_chains(chain: Chain, uniforms: np.ndarray) -> np.ndarray:
    """Runs one stationary chain per row of `uniforms` ([n, m] draws in [0, 1)); returns [n, m] symbols.

    The first draw picks the first state (the first `order` symbols) from the stationary distribution,
    each later one the next symbol.
    """
    n, m = uniforms.shape
    order, vocab = chain.order, chain.vocab
    cdf = np.cumsum(chain.stationary)
    cdf /= cdf[-1]  # exactly 1 at the end, so every draw finds a state
    state = np.searchsorted(cdf, uniforms[:, 0], side="right")
    out = np.empty((n, max(m, order)), dtype=np.int64)
    for i in range(order):  # the state's digits, oldest first
        out[:, i] = state // vocab ** (order - 1 - i) % vocab
    for t in range(order, m):
        pick = (chain.cumulative[state] <= uniforms[:, t - order + 1, None]).sum(axis=1)
        out[:, t] = chain.successors[state, pick]
        state = state % vocab ** (order - 1) * vocab + out[:, t]
    return out[:, :m]


def symbols(task: Task) -> np.ndarray:
    """The split's documents as symbol indices, [docs, doc_len]; see the module docstring."""
    stride, length = task.stride, -(-task.doc_len // task.stride)  # each of the `stride` chains' length
    rng = np.random.default_rng([task.seed, 1 + SPLITS.index(task.split)])
    # Row-major draws: document i reads rows i*stride .. i*stride+stride-1, whatever `docs` is.
    chains = sample_chains(chain(task), rng.random((task.docs * stride, length)))
    # Chain c of a document holds its positions c, c + stride, c + 2 stride, ...
    interleaved = chains.reshape(task.docs, stride, length).transpose(0, 2, 1).reshape(task.docs, -1)
    return interleaved[:, : task.doc_len]


def symbol_words(vocab: int) -> list[str]:
    """The word of each symbol: `s0`, `s1`, ...; lowercase, so BERT normalization leaves it alone."""
    return [f"{SYMBOL_PREFIX}{i}" for i in range(vocab)]


def documents(spec: str) -> list[str]:
    """The documents of a synthetic spec, as whitespace-separated symbol words."""
    task = parse(spec)
    words = np.array(symbol_words(task.vocab))
    return [" ".join(row) for row in words[symbols(task)].tolist()]


def tokenizer(spec: str) -> Tokenizer:
    """A tokenizer for the task's symbols: the special tokens (ids 0..4), then one token per symbol (5..).

    Normalization, pre-tokenization, decoding and the `[CLS] $A [SEP]` template are those of
    `tokenizer.train_tokenizer`'s tokenizers, so packing and masking treat it like any other; since
    every symbol word is in the vocabulary, WordPiece maps each to exactly one token.
    """
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *symbol_words(parse(spec).vocab)])}
    result = configure(Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]")), lowercase=True)
    result.add_special_tokens(list(SPECIAL_TOKENS))
    return result


def symbol_ids(tokenizer: Tokenizer, vocab: int) -> np.ndarray:
    """The token id of every symbol, [vocab]; fails if the tokenizer does not hold each as one token."""
    ids = [tokenizer.token_to_id(word) for word in symbol_words(vocab)]
    missing = [word for word, i in zip(symbol_words(vocab), ids) if i is None]
    if missing:
        raise ValueError(
            f"tokenizer lacks the symbol tokens {missing[:5]} (of {vocab}); use synthetic.tokenizer(spec) for "
            "synthetic data"
        )
    return np.asarray(ids, dtype=np.int64)
