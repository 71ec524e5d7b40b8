"""The length-extrapolation study: models x datasets x policies x lengths x protocols -> records.

`eval.py` is the command line around `run_study`; the sweep runner calls it too. Each model is
scored on one tokenized corpus per dataset, at lengths derived from its own training length, once per
applicable out-of-range policy for its absolute table (a model without one gets policy "none").
Combinations a policy refuses (e.g. "strict" past the training length) become `skipped` entries with
the reason instead of values, so no NaN ever reaches a table.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import jax
import numpy as np
from absl import logging
from ml_collections import config_dict
from tqdm import tqdm

from deberta_jax import storage
from deberta_jax.data import packing, synthetic, targets
from deberta_jax.data.tokenizer import SPECIAL_TOKENS, SpecialIds
from deberta_jax.kernels import dense
from deberta_jax.model import hf
from deberta_jax.model.config import ABSOLUTE_POSITION_POLICIES, COMPUTATION_FIELDS, LEARNED_TEMPERATURES, ModelConfig
from deberta_jax.model.encoder import MaskedLM, with_options
from deberta_jax.study import protocols, report, scoring
from deberta_jax.study.baselines import OracleModel, UnigramModel
from deberta_jax.train import checkpoint, config_checks

# Ways of running a trained model past its training length, each a set of `ModelConfig` options that change no
# parameter (`encoder.with_options`), made from the model's config; None where the method has nothing to act on.
# The study scores each requested method as another model, labelled `<label>+<method>`.
LENGTH_METHODS = {
    # Scores scaled by log(keys seen) / log(L): attention as sharp over 8L keys as over L. A model trained with a
    # learned temperature already scales its scores with log(keys seen).
    "log_length": lambda cfg: None if cfg.attention_temperature in LEARNED_TEMPERATURES else dict(
        attention_temperature="log_length"),
    # Every query attends to the L positions around it: no unseen distance or key count.
    "window": lambda cfg: dict(attention_window=cfg.effective_trained_length),
    # The same window, and every query also sees its row's [CLS] and closing [SEP] (local-global attention).
    "window_global": lambda cfg: dict(attention_window=cfg.effective_trained_length, window_global_tokens=True),
    # Distances times L / N: a longer sequence spans the trained distances (absolute tables have their policies).
    "interpolate_distances": lambda cfg: None if not cfg.uses_distances else dict(
        relative_position_policy="interpolate"),
}
DEFAULT_MULTIPLES = (1, 2, 4, 8)
DEFAULT_EXTRA = (16, 64)


@dataclasses.dataclass
class EvalModel:
    """A model under evaluation: what it is (`identity`, which every one of its records carries) and how to score
    it."""

    label: str  # the name its results are shown under; runs differing only in seed share a label
    seed: int | str
    source: str  # workdir or checkpoint path
    model: object  # MaskedLM, or a reference model (UnigramModel, OracleModel)
    tokenizer: object
    train_len: int
    dataset: str | None = None  # score only this dataset (an oracle knows one task); None: every dataset
    step: int | None = None  # the checkpoint step of a workdir's model; None for others
    checkpoint: str | None = None  # how a workdir's step was chosen: "latest", "best" or the step asked for
    config: str | None = None  # what a run trained (`config_fingerprint`); None for others
    method: str = "none"  # the length method it is scored under (`LENGTH_METHODS`); "none": as trained

    def identity(self) -> dict:
        """The fields of `report.IDENTITY_FIELDS`, with the label: the report averages as seeds only models that
        share a label and agree on these but for seed and source (`report.check_seed_groups`)."""
        return dict(model=self.label, seed=self.seed, source=self.source, step=self.step, checkpoint=self.checkpoint,
                    config=self.config, method=self.method)


# The seed suffix of a workdir name (`<variant>-L<len>-s<seed>`, as the sweep runner names them).
SEED_SUFFIX = re.compile(r"[-_](?:s|seed)(\d+)$")


def run_label(workdir: str) -> str:
    """Runs that differ only in seed share a label: the workdir name without a `-s<seed>` suffix."""
    return SEED_SUFFIX.sub("", os.path.basename(os.path.normpath(workdir)))


def workdir_seed(workdir: str) -> int | None:
    """The seed a workdir's name ends in, or None."""
    match = SEED_SUFFIX.search(os.path.basename(os.path.normpath(workdir)))
    return int(match.group(1)) if match else None


# Config fields that say how a run was executed, logged or checkpointed (or which folder held a file), not which
# model it trained on which data: runs that share a label may differ in these besides `seed`. The held-out
# eval_files only pick which checkpoint is "best"; a given tokenizer is compared by the workdir's own copy.
RUN_ONLY_FIELDS = frozenset({
    "seed", "data.cache_dir", "data.eval_files", "data.tokenizer", "mesh.fsdp", "train.grad_accum_steps",
    "train.log_every", "train.eval_every", "train.eval_batches", "train.checkpoint_every", "train.keep_checkpoints",
    *(f"model.{name}" for name in COMPUTATION_FIELDS)})


def _trained(config: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """What a run's config says it trained: every field but `RUN_ONLY_FIELDS`, with the model fields added since it
    was written at their defaults (which is what it trained with)."""
    tree = config.to_dict()
    tree["model"] = ModelConfig.from_dict(tree["model"]).to_dict()
    for field in RUN_ONLY_FIELDS:
        *sections, name = field.split(".")
        node = tree
        for section in sections:
            node = node.get(section, {})
        node.pop(name, None)
    return config_dict.ConfigDict(tree)


def config_fingerprint(workdir: str, config: config_dict.ConfigDict | None = None, by_content: bool = True) -> str:
    """A short hash of what a workdir's run trained (`_trained`, the training text by its bytes where it can be read
    (`packing.source_fingerprint`), and the tokenizer): the same for every seed of one model, and another for any
    other; a byte-identical copy of the text is the same text. `config`: another config.json in place of the
    workdir's (what a sweep would have it train), with its tokenizer. `by_content=False`: the text by path, size and
    modification time, as fingerprints recorded before were made."""
    trained = _trained(config or checkpoint.read_config(workdir)).to_dict()
    try:
        trained["data"]["train_files"] = packing.source_fingerprint(trained["data"]["train_files"], by_content)
    except OSError:  # the training text is gone; its spec still names it
        pass
    digest = hashlib.sha256(json.dumps(trained, sort_keys=True, default=str).encode())
    digest.update(storage.read_bytes(storage.path(workdir) / checkpoint.TOKENIZER_FILE))
    return digest.hexdigest()[:16]


def run_identity(workdir: str, step: int, chosen: int | str | None = None) -> dict:
    """The identity fields a workdir's model has at checkpoint `step`, chosen as `chosen` asked (None: the latest):
    its folder, step, seed and `config_fingerprint` (`EvalModel.identity`)."""
    return dict(source=workdir, step=step, checkpoint=str(chosen or "latest"),
                seed=checkpoint.read_config(workdir).seed, config=config_fingerprint(workdir))


def _folder_key(folder: str) -> str:
    """One spelling per folder (`runs/a`, `./runs/a/` and a link to it agree; a bucket's URL without its last /)."""
    path = storage.path(folder)
    return os.fspath(path).rstrip("/") if storage.is_remote(path) else str(path.resolve())


def config_differences(old: config_dict.ConfigDict, new: config_dict.ConfigDict) -> list[str]:
    """`config.<field> a vs b` for every difference between what two configs train (`_trained`), the training text
    compared by the files it names, however spelled."""
    differ = config_checks.differences(_trained(old), _trained(new))
    return [f"config.{key} {a!r} vs {b!r}" for key, (a, b) in differ.items()
            if not (key == "data.train_files" and packing.same_source(a, b))]


def _identity_differences(first: str, other: str, configs: dict) -> list[str]:
    """`config.<field> a vs b` for every difference between two workdirs' runs (`configs`: each one's config)
    beyond `RUN_ONLY_FIELDS` (training text compared by the files it names, however spelled), and their
    tokenizers'."""
    out = config_differences(configs[first], configs[other])
    tokenizers = [storage.read_text(storage.path(w) / checkpoint.TOKENIZER_FILE) for w in (first, other)]
    return out + ([f"their {checkpoint.TOKENIZER_FILE}"] if tokenizers[0] != tokenizers[1] else [])


def check_labels(workdirs: Sequence[str], checkpoints: Sequence[str] = ()) -> None:
    """Refuses, before any model is loaded, folders that the report would average or show under one label without
    their being seeds of one model, naming what differs (the report's own check, `report.check_seed_groups`, sees
    only fingerprints, and the models' seeds and steps once loaded).

    The report's mean and interval are over the runs that share a label, taken as seeds. So a folder is given once
    (twice, it would be two identical "seeds" with a zero-width interval); workdirs that share a label (`run_label`)
    must have configs that differ only in `RUN_ONLY_FIELDS` and the same tokenizer; a transformers checkpoint, which
    has no seed, and the references (unigram, oracle) share their label with nothing. Raises ValueError naming both
    folders and what differs.
    """
    given = [("--workdir", w) for w in workdirs] + [("--hf_checkpoint", c) for c in checkpoints]
    folders, labels = {}, {}
    for flag, folder in given:
        key = _folder_key(folder)
        if key in folders:
            raise ValueError(f"{flag} {folder} is given twice ({folders[key]}): one run scored twice would be averaged "
                             "as two seeds with a zero-width interval; give each folder once")
        folders[key] = folder
        label = run_label(folder) if flag == "--workdir" else os.path.basename(os.path.normpath(folder))
        if label in report.REFERENCES:
            raise ValueError(f"{flag} {folder} would be reported as {label!r}, the name of a reference model; "
                             "rename the folder")
        labels.setdefault(label, []).append((flag, folder))
    configs = {w: checkpoint.read_config(w) for w in workdirs}  # a damaged one is named before any checkpoint
    for label, members in labels.items():
        (first_flag, first), *others = members
        for flag, other in others:
            both = f"{first_flag} {first} and {flag} {other} would both be reported as {label!r}, as seeds of one model"
            if "--hf_checkpoint" in (first_flag, flag):
                raise ValueError(f"{both}, but a transformers checkpoint has no seed; give one folder another name")
            differ = _identity_differences(first, other, configs)
            if differ:
                raise ValueError(f"{both}, but they differ in {'; '.join(differ)}: only runs that differ in seed "
                                 "share a label, so give one folder another name")


def load_workdir_model(workdir: str, step: int | str | None = None, **overrides) -> EvalModel:
    """A trained run as an `EvalModel` (latest checkpoint, "best", or a step); `overrides` as in
    `checkpoint.load_workdir` (e.g. the attention kernel). The step is resolved first, so the results can name the
    checkpoint they scored."""
    chosen = checkpoint.resolve_step(workdir, step)
    config, model, tokenizer = checkpoint.load_workdir(workdir, chosen, **overrides)
    return EvalModel(run_label(workdir), model=model, tokenizer=tokenizer, train_len=int(config.data.seq_len),
                     **run_identity(workdir, chosen, step))


def load_hf_checkpoint(path: str, trained_length: int | None = None, notes: list[str] | None = None,
                       **overrides) -> EvalModel:
    """A transformers `save_pretrained` directory (local or in a bucket) as an `EvalModel`: weights from
    `model.safetensors`, the tokenizer from `tokenizer.json` or converted from the `spm.model` / `vocab.txt`
    published checkpoints ship (`hf.load_tokenizer`), so its special tokens and [MASK] id are the checkpoint's own.

    Loaded with the clamp of relative distances (`ModelConfig.clamp_relative_positions`), since lengths past
    training are the point here. Its training length (what 1x is) is the one this project's export records
    (`hf.TRAINED_LENGTH_KEY`); a published checkpoint records none, so it is `trained_length`, or else
    `max_position_embeddings` (512 for published models), and a sentence saying so is appended to `notes` (the
    report's warnings). A `trained_length` that contradicts the recorded one is refused.
    """
    with storage.local_copy(path) as local:  # transformers' tokenizer conversion reads local files only
        tokenizer = hf.load_tokenizer(local)
        missing = [token for token in SPECIAL_TOKENS if tokenizer.token_to_id(token) is None]
        if missing:
            raise ValueError(f"the tokenizer in {path} has no {', '.join(missing)}: the study needs "
                             f"{', '.join(SPECIAL_TOKENS)} (BERT's and DeBERTa's spellings); checkpoints with other "
                             "special tokens (e.g. RoBERTa's <mask>) are not supported")
        config_bytes = storage.read_bytes(storage.path(local) / hf.CONFIG_FILE)
        config = json.loads(config_bytes)
        label = os.path.basename(os.path.normpath(path))
        if config.get(hf.TRAINED_LENGTH_KEY) is None:
            assumed = "as given" if trained_length else "its max_position_embeddings"
            trained_length = trained_length or config["max_position_embeddings"]
            if notes is not None:
                notes.append(f"{label}: the checkpoint does not record its training length, so 1x is taken to be "
                             f"{trained_length} tokens ({assumed}), and the lengths scored are multiples of that")
        model = hf.load(local, trained_length=trained_length, **{"clamp_relative_positions": True, **overrides})
        config = hashlib.sha256(config_bytes).hexdigest()[:16]
    if tokenizer.get_vocab_size() > model.cfg.vocab_size:
        raise ValueError(f"the tokenizer in {path} has {tokenizer.get_vocab_size()} tokens but the model has only "
                         f"vocab_size={model.cfg.vocab_size} embedding rows: they do not belong together")
    return EvalModel(label, "published", path, model, tokenizer, model.cfg.trained_length, config=config)


def _replaced_training_options(cfg: ModelConfig, options: dict) -> dict:
    """`{field: (trained, new)}` for each option a length method would set on a model trained with another value
    than `ModelConfig`'s default (e.g. its own attention window)."""
    return {name: (getattr(cfg, name), value) for name, value in options.items()
            if getattr(cfg, name) not in (value, ModelConfig.__dataclass_fields__[name].default)}


def with_methods(models: Sequence[EvalModel], methods: Sequence[str], skipped: list[dict] | None = None
                 ) -> list[EvalModel]:
    """`models` followed by each trained model under each of `methods` (`LENGTH_METHODS`) that applies to it,
    labelled `<label>+<method>`; the parameters are shared, not copied. A method that does not apply to a model is
    appended to `skipped` (the report's "Not evaluated"), with the reason.

    A method adds to what the model was trained with and never replaces it: a model trained with a window of 4 run
    with the method's window of L would be another model even at 1x, so that is refused (ValueError)."""
    out = list(models)
    for em in models:
        if not isinstance(em.model, MaskedLM):
            continue
        for name in methods:
            options = LENGTH_METHODS[name](em.model.cfg)
            if options is None:
                cfg = em.model.cfg
                reason = (f"the length method {name!r} does not apply to a model with attention={cfg.attention!r} "
                          f"and attention_temperature={cfg.attention_temperature!r}")
                logging.info("%s: %s", em.label, reason)
                if skipped is not None:
                    skipped.append(dict(em.identity(), model=f"{em.label}+{name}", method=name, reason=reason))
                continue
            replaced = _replaced_training_options(em.model.cfg, options)
            if replaced:
                raise ValueError(
                    f"methods: {em.label} was trained with "
                    + ", ".join(f"{field}={trained!r}, which the length method {name!r} would replace with {new!r}"
                                for field, (trained, new) in replaced.items())
                    + f", changing the model even at its training length; leave {name} out of the methods for it")
            out.append(dataclasses.replace(em, label=f"{em.label}+{name}", model=with_options(em.model, **options),
                                           method=name))
    return out


def unigram_reference(em: EvalModel) -> EvalModel:
    """The unigram floor for a trained run: counts from its own training files and tokenizer. Those files are
    the ones its config.json names, not any path the user gave the evaluation, so a missing one is reported as
    such."""
    config = checkpoint.read_config(em.source)
    try:
        packed = packing.load_or_pack(config.data.train_files, em.tokenizer, int(config.data.seq_len),
                                      config.data.cache_dir)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the unigram floor counts the training files that {em.source}'s {checkpoint.CONFIG_FILE} names "
            f"(data.train_files={config.data.train_files!r}), and they are not all there; restore them, or leave the "
            "floor out (eval.py --unigram=false)") from None
    # The memory-mapped token stream (every content token once, [SEP] between documents, whose counts the
    # model ignores), counted without building the rows.
    unigram = UnigramModel(packed.tokens, em.tokenizer.get_vocab_size(), SpecialIds.from_tokenizer(em.tokenizer))
    return EvalModel("unigram", "-", f"unigram({em.source})", unigram, em.tokenizer, em.train_len)


def oracle_references(em: EvalModel, datasets: dict[str, str]) -> list[EvalModel]:
    """The Bayes-optimal oracle of every synthetic dataset in `datasets` (name -> data spec), scored with
    `em`'s tokenizer and training length (the windows and targets of `em`'s rows)."""
    return [EvalModel("oracle", "-", f"oracle({spec})", OracleModel(spec, em.tokenizer), em.tokenizer, em.train_len,
                      dataset=name)
            for name, spec in datasets.items()
            if synthetic.is_synthetic_spec(spec) and synthetic.has_exact_oracle(spec)]


# The share of [UNK] tokens in an evaluation text above which the study warns (natural text under its own
# training tokenizer has almost none; a model scored on a text its vocabulary does not cover is no result).
UNKNOWN_TOKEN_WARNING = 0.01


@dataclasses.dataclass(frozen=True)
class StudySettings:
    multiples: tuple[int, ...] = DEFAULT_MULTIPLES
    extra: tuple[int, ...] = DEFAULT_EXTRA
    lengths: tuple[int, ...] = ()  # explicit lengths, used instead of multiples/extra when given
    policies: tuple[str, ...] = ("untrained", "clip", "interpolate")
    protocols: tuple[str, ...] = tuple(protocols.PROTOCOLS)
    mask_seed: int = 0
    tokens_per_batch: int = 16384
    max_eval_tokens: int = 0  # 0 = the whole stream
    # Centred-target protocol: spans of `span` tokens (0: half the training length), as many as the text holds up to
    # `num_spans`: 256 spans of 32 tokens at L = 64 hold about 1,200 targets at the 15% masking rate.
    num_spans: int = 256
    span: int = 0
    bootstrap: int = 1000
    buckets_per_train_len: int = 8
    methods: tuple[str, ...] = ()  # of LENGTH_METHODS, each scored besides the model as trained

    def __post_init__(self):
        # A policy, protocol or method given twice would score the same model twice, and the report would average it
        # with itself as two seeds (a zero-width interval).
        for name in ("policies", "protocols", "methods"):
            values = getattr(self, name)
            repeated = sorted({v for v in values if values.count(v) > 1})
            if repeated:
                raise ValueError(f"{name}: {', '.join(map(repr, repeated))} given twice; give each once (as given, "
                                 "one model would be scored twice and averaged with itself as two seeds)")
        for name, allowed, lost in (("policies", ABSOLUTE_POSITION_POLICIES, "no model with a learned absolute table"),
                                    ("protocols", tuple(protocols.PROTOCOLS), "nothing")):
            if not getattr(self, name):
                raise ValueError(f"{name}: none given, so {lost} would be scored; give one or more of {allowed}")
        if not self.multiples and not self.lengths:
            raise ValueError("multiples: none given, so there is no length to score; give multiples of the training "
                             f"length (default {','.join(map(str, DEFAULT_MULTIPLES))}) or explicit lengths")
        if self.mask_seed < 0:  # numpy's generators take no negative seed ("expected non-negative integer")
            raise ValueError(f"mask_seed={self.mask_seed}: the seed of the fixed targets must be an integer from 0 "
                             "up (default 0)")
        if self.max_eval_tokens < 0:
            raise ValueError(f"max_eval_tokens={self.max_eval_tokens}: give a number of tokens to keep from the start "
                             "of each eval text, or 0 for all of it")
        if self.bootstrap < 2:
            raise ValueError(f"bootstrap={self.bootstrap}: the 95% intervals are percentiles over resamples of the "
                             "documents, so give 2 or more (default 1000)")
        for p in self.policies:
            if p not in ABSOLUTE_POSITION_POLICIES:
                raise ValueError(f"policies: unknown policy {p!r}; choose from {ABSOLUTE_POSITION_POLICIES}")
        for p in self.protocols:
            protocols.get(p)
        for n in self.lengths:
            if n < packing.MIN_SEQ_LEN:
                raise ValueError(f"lengths: {n} is too short; every length must be >= {packing.MIN_SEQ_LEN} "
                                 "([CLS] + tokens + [SEP])")
        if any(m <= 0 for m in self.multiples):
            raise ValueError("multiples must be positive")
        if self.num_spans < 1:
            raise ValueError(f"num_spans={self.num_spans}: the centred-target protocol needs at least one target "
                             "span; pass 1 or more")
        if self.span < 0:
            raise ValueError(f"span={self.span}: pass a span length in tokens, or 0 for half of each training "
                             "length")
        for m in self.methods:
            if m not in LENGTH_METHODS:
                raise ValueError(f"methods: unknown length method {m!r}; choose from {tuple(LENGTH_METHODS)}")

    def lengths_for(self, train_len: int) -> list[int]:
        if self.lengths:
            return sorted(set(self.lengths))
        return sorted({train_len * m for m in self.multiples} | {train_len + e for e in self.extra})


def _has_absolute_table(model) -> bool:
    return isinstance(model, MaskedLM) and model.cfg.uses_absolute_table


def policies_for(model, requested: Sequence[str]) -> list[str]:
    return list(requested) if _has_absolute_table(model) else ["none"]


def scorer_for(model, policy: str) -> scoring.Scorer:
    if isinstance(model, (UnigramModel, OracleModel)):
        return model.scorer()
    if policy != "none":
        model = with_options(model, absolute_position_policy=policy)
    return scoring.make_scorer(model)


def refusal(model, policy: str, eval_len: int) -> str | None:
    """Why `policy` cannot score `eval_len` (None when it can); mirrors `positions` without running it."""
    if not _has_absolute_table(model) or eval_len <= model.cfg.trained_positions:
        return None
    trained = model.cfg.trained_positions  # train_len, or more with randomized positions
    table = model.cfg.max_position_embeddings
    if policy == "strict":
        return f"strict policy: positions >= {trained} (never trained) are refused"
    if policy == "untrained" and eval_len > table:
        return f"untrained policy: the absolute table has only {table} rows"
    return None


def _records(em: EvalModel, sums: scoring.Sums, resamples: np.ndarray, **key) -> list[dict]:
    """Overall loss/accuracy/perplexity with bootstrap intervals, plus loss/accuracy per position bucket."""
    base = dict(em.identity(), train_len=em.train_len, multiple=key["eval_len"] / em.train_len, **key)
    out = []
    for metric, num, transform in (("loss", sums.loss_doc, None), ("accuracy", sums.correct_doc, None),
                                   ("perplexity", sums.loss_doc, np.exp)):
        value = sums.loss if metric != "accuracy" else sums.accuracy
        value = math.exp(value) if metric == "perplexity" else value
        lo, hi = scoring.bootstrap_ratio_ci(num, sums.count_doc, resamples, transform or (lambda x: x))
        out.append(dict(base, bucket="all", metric=metric, value=value, ci_low=lo, ci_high=hi, n_tokens=sums.count))
    for b in np.nonzero(sums.count_bucket)[0]:
        n = int(sums.count_bucket[b])
        start = int(b) * sums.bucket_width
        out.append(dict(base, bucket=start, metric="loss", value=float(sums.loss_bucket[b] / n),
                        ci_low=None, ci_high=None, n_tokens=n))
        out.append(dict(base, bucket=start, metric="accuracy", value=float(sums.correct_bucket[b] / n),
                        ci_low=None, ci_high=None, n_tokens=n))
    return out


# The length methods that hide keys past a window of the training length: what the paired measure compares with.
WINDOW_METHODS = ("window", "window_global")
# Protocols that score the same targets at every length, so a model's losses at two lengths pair.
SAME_TARGETS_PROTOCOLS = ("centred_target",)


def context_use_records(scored: dict, resamples: dict[str, np.ndarray]) -> list[dict]:
    """The paired context-use measure: for each model scored both as trained (full attention) and under a window
    method (`window`, `window_global`: the keys of a window of its training length) at the same length, on the same
    windows and targets, its loss as trained minus its windowed loss (`report.CONTEXT_USE` + the method), summed per
    document, with a bootstrap interval over documents whose resamples pair the two. Negative: the keys the window
    hides lower the loss, so the model uses context past its training length. The per-document sums ride in the
    record (`doc_diff`, `doc_count`), for the interval over seeds (`report.aggregate_seeds`).

    `scored` maps (source, seed, dataset, policy, eval_len, protocol, offset, method) to (EvalModel, loss per
    document, targets per document); pairs whose targets differ are refused."""
    out = []
    for key, (em, loss, count) in scored.items():
        *unit, method = key
        full = scored.get((*unit, "none"))
        if method not in WINDOW_METHODS or full is None:
            continue
        full_em, full_loss, full_count = full
        dataset, policy, eval_len, protocol, offset = unit[2:]
        if not np.array_equal(count, full_count):
            raise ValueError(f"{em.label} and {full_em.label} ({dataset}, length {eval_len}, {protocol}) were scored "
                             "on different targets, so their losses do not pair; score both in one study")
        out.append(_paired_record(full_em, tuple(unit[2:]), report.CONTEXT_USE + method, full_loss - loss, count,
                                  resamples[dataset]))
    return out


def _paired_record(em: EvalModel, unit: tuple, metric: str, diff: np.ndarray, count: np.ndarray,
                   resamples: np.ndarray) -> dict:
    """A paired measure's record: `diff` (per-document loss sums on the same targets) over `count`, with its
    bootstrap interval over documents and the per-document sums for the interval over seeds."""
    dataset, policy, eval_len, protocol, offset = unit
    lo, hi = scoring.bootstrap_ratio_ci(diff, count, resamples)
    return dict(em.identity(), train_len=em.train_len, multiple=eval_len / em.train_len, policy=policy,
                dataset=dataset, eval_len=eval_len, protocol=protocol, offset=offset, bucket="all", metric=metric,
                value=float(diff.sum() / max(count.sum(), 1)), ci_low=lo, ci_high=hi, n_tokens=int(count.sum()),
                doc_diff=diff.tolist(), doc_count=count.tolist())


def context_gain_records(scored: dict, resamples: dict[str, np.ndarray]) -> list[dict]:
    """`report.CONTEXT_GAIN`: for a protocol that scores the same targets at every length (`centred_target`), each
    model's loss of them in the window of N minus in the window of its training length, summed per document, with
    a paired bootstrap interval over documents. Negative: the wider context makes the same targets easier. Its
    interval's half-width is the smallest difference the protocol resolves at the number of targets scored. The
    unigram floor reads no context, so it has none."""
    out = []
    for key, (em, loss, count) in scored.items():
        source, seed, dataset, policy, eval_len, protocol, offset, method = key
        at_l = scored.get((source, seed, dataset, policy, em.train_len, protocol, offset, method))
        if (protocol not in SAME_TARGETS_PROTOCOLS or at_l is None or eval_len == em.train_len
                or isinstance(em.model, UnigramModel)):
            continue
        if not np.array_equal(count, at_l[2]):
            raise ValueError(f"{em.label} ({dataset}, {protocol}) scored different targets at lengths {eval_len} and "
                             f"{em.train_len}, so their losses do not pair")
        out.append(_paired_record(em, (dataset, policy, eval_len, protocol, offset), report.CONTEXT_GAIN,
                                  loss - at_l[1], count, resamples[dataset]))
    return out


def add_relative_change(records: list[dict]) -> list[dict]:
    """`loss_change_vs_1x`: loss minus the same model's loss at its training length (chunked)."""
    at_1x = {(r["model"], r["seed"], r["policy"], r["dataset"]): r["value"] for r in records
             if r["protocol"] == "chunked" and r["bucket"] == "all" and r["metric"] == "loss"
             and r["eval_len"] == r["train_len"]}
    extra = []
    for r in records:
        key = (r["model"], r["seed"], r["policy"], r["dataset"])
        if r["protocol"] == "chunked" and r["bucket"] == "all" and r["metric"] == "loss" and key in at_1x:
            extra.append(dict(r, metric="loss_change_vs_1x", value=r["value"] - at_1x[key], ci_low=None, ci_high=None))
    return records + extra


def tokenizer_groups(labelled: Iterable[tuple[str, str]]) -> list[list[str]]:
    """Labels grouped by tokenizer, from `(label, tokenizer JSON)` pairs. Targets are token positions
    of each tokenizer's stream, so only models in one group are scored on the same targets."""
    groups: dict[str, list[str]] = {}
    for label, tokenizer_json in labelled:
        groups.setdefault(tokenizer_json, []).append(label)
    return list(groups.values())


def unpaired_note(labelled: Iterable[tuple[str, str]]) -> str | None:
    """A warning for reports when `(label, tokenizer JSON)` pairs name more than one tokenizer (else None)."""
    groups = tokenizer_groups(labelled)
    if len(groups) < 2:
        return None
    return (f"These models use {len(groups)} different tokenizers, so their targets differ and only models "
            "within one group are compared on the same tokens: "
            + "; ".join(f"group {i}: {', '.join(g)}" for i, g in enumerate(groups, 1)) + ".")


def device_memory_bytes() -> int:
    """Memory of the first local device: its allocator's limit on accelerators, physical memory on CPU."""
    device = jax.local_devices()[0]
    stats = device.memory_stats() if device.platform != "cpu" else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_dense_memory(models: Sequence[EvalModel], settings: StudySettings, available: int) -> None:
    """Refuses, before anything is scored, a study whose dense-kernel scores cannot fit in `available`
    bytes (XLA would fail only when it gets there, with an out-of-memory error that names no fix)."""
    for em in models:
        cfg = getattr(em.model, "cfg", None)
        if cfg is None or cfg.attention_kernel != "dense":
            continue
        for eval_len in settings.lengths_for(em.train_len):
            batch = max(1, settings.tokens_per_batch // eval_len)
            need = dense.peak_bytes(batch, cfg.num_heads, eval_len, eval_len)
            if need > available:
                raise MemoryError(
                    f"{em.label} at length {eval_len} with the dense attention kernel needs about "
                    f"{need / 2**30:.0f} GiB for its [{batch}, {cfg.num_heads}, {eval_len}, {eval_len}] scores, "
                    f"more than the {available / 2**30:.0f} GiB of {jax.local_devices()[0].platform}; pass "
                    "--attention_kernel blockwise (same results, memory linear in length), or evaluate shorter lengths")


class Progress:
    """The study's progress over its units of work (a model under one policy on one dataset at one length).

    On a terminal, one bar over them all, described by the unit being scored; elsewhere (a log file, a pipe, a
    notebook's captured stderr), where a bar shows nothing until it ends, a line per unit scored with the time so
    far. Only process 0 reports, since every process scores every unit.
    """

    def __init__(self, total: int, stream=None):
        self.stream = sys.stderr if stream is None else stream
        self.total, self.done, self.started = total, 0, time.perf_counter()
        self.silent = jax.process_index() != 0
        self.bar = (tqdm(total=total, file=self.stream, unit="length", dynamic_ncols=True)
                    if not self.silent and self.stream.isatty() else None)

    def advance(self) -> None:
        """Counts the unit about to be scored or skipped (the bar shows the units begun)."""
        self.done += 1
        if self.bar is not None:
            self.bar.update()

    def scoring(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description(what)
        elif not self.silent:
            print(f"scoring {self.done}/{self.total}: {what} ({time.perf_counter() - self.started:.0f} s so far)",
                  file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_study(models: Sequence[EvalModel], datasets: dict[str, list[str]], settings: StudySettings,
              corpora: dict | None = None, warnings: list[str] | None = None,
              before_each_unit: Callable[[], None] | None = None):
    """Score every model on every dataset; returns (records, skipped).

    `corpora` caches the tokenized, masked eval streams per (dataset, tokenizer); pass the same dict
    to calls that score models one at a time so each stream is built once. What makes a result doubtful (a text
    the tokenizer cannot read) is logged and appended to `warnings`, for the report's summary. `before_each_unit` is
    called before each model is scored at each length; what it raises ends the study there (a sweep's preemption
    notice: a signal handler that raised would do so inside whatever code the signal interrupted).
    """
    records, skipped = [], []
    per_document, resamples_of = {}, {}  # per-document sums of each unit, for `context_use_records`
    models = with_methods(models, settings.methods, skipped)
    # Before anything is scored: models the report would average as seeds of one model without their being so.
    report.check_seed_groups([dict(em.identity(), dataset=em.dataset) for em in models])
    check_dense_memory(models, settings, device_memory_bytes())
    corpora = {} if corpora is None else corpora
    note = unpaired_note((f"{em.label} (seed {em.seed})", em.tokenizer.to_str()) for em in models)
    if note:
        logging.warning("%s", note)
    progress = Progress(sum(len(policies_for(em.model, settings.policies)) * len(settings.lengths_for(em.train_len))
                            for em in models for dataset in datasets if em.dataset in (None, dataset)))
    try:  # one `progress` unit per model, policy, dataset and length
        for em in models:
            lengths = settings.lengths_for(em.train_len)
            bucket_width = max(em.train_len // settings.buckets_per_train_len, 1)
            span = settings.span or max(em.train_len // 2, 1)
            for dataset, documents in datasets.items():
                if em.dataset not in (None, dataset):
                    continue
                key = (dataset, em.tokenizer.to_str())
                if key not in corpora:
                    corpus = targets.build_corpus(documents, em.tokenizer, seed=settings.mask_seed)
                    if settings.max_eval_tokens:
                        corpus = targets.corpus_from_stream(corpus.tokens[: settings.max_eval_tokens],
                                                            corpus.special, settings.mask_seed)
                    corpora[key] = corpus
                corpus = corpora[key]
                unknown = float(np.mean(corpus.tokens == corpus.special.unk))
                if unknown > UNKNOWN_TOKEN_WARNING:
                    warning = (f"{dataset}: {100 * unknown:.1f}% of its tokens are [UNK] under {em.label}'s "
                               "tokenizer, whose vocabulary does not cover this text; its scores measure a text the "
                               "model cannot read")
                    logging.warning("%s", warning)
                    if warnings is not None:
                        warnings.append(warning)
                if not corpus.targets.any():
                    raise ValueError(
                        f"{dataset}: the text yields no masked targets ({len(corpus.tokens)} tokens), so every loss "
                        "would be 0 over 0 tokens; give more evaluation text")
                if len(corpus.tokens) < max(lengths) - 2:
                    raise ValueError(
                        f"{dataset}: {len(corpus.tokens)} tokens is shorter than the longest eval length "
                        f"{max(lengths)}; pass a longer eval text or smaller multiples / lengths")
                resamples = resamples_of[dataset] = scoring.document_resamples(corpus.num_docs, settings.bootstrap)
                chosen = [protocols.get(name) for name in settings.protocols]
                starts = (targets.centred_spans(corpus, em.train_len, span, settings.num_spans)
                          if any(p.needs_starts for p in chosen) else None)
                for policy in policies_for(em.model, settings.policies):
                    scorer = scorer_for(em.model, policy)
                    for eval_len in lengths:
                        if before_each_unit is not None:
                            before_each_unit()
                        progress.advance()
                        reason = refusal(em.model, policy, eval_len)
                        common = dict(policy=policy, dataset=dataset, eval_len=eval_len)
                        if reason:
                            skipped.append(dict(em.identity(), **common, reason=reason))
                            continue
                        batch = max(1, settings.tokens_per_batch // eval_len)
                        desc = f"{em.label}{'' if policy == 'none' else f' ({policy})'} on {dataset} at N={eval_len}"
                        progress.scoring(desc)
                        setting = protocols.Setting(corpus, eval_len, em.train_len, span, starts)
                        for protocol in chosen:
                            scored = False
                            for offset, windows in protocol.windows(setting):
                                scored = True
                                sums = scoring.score_windows(scorer, corpus, windows, batch, bucket_width, desc)
                                per_document[(em.source, em.seed, dataset, policy, eval_len, protocol.name, offset,
                                              em.method)] = (em, sums.loss_doc, sums.count_doc)
                                records += [r for r in _records(em, sums, resamples, protocol=protocol.name,
                                                                offset=offset, **common)
                                            if protocol.per_position or r["bucket"] == "all"]
                            if not scored:  # e.g. a target span longer than the window
                                skipped.append(dict(em.identity(), **common, reason=(
                                    f"{protocol.name}: no window of {eval_len} tokens holds a target span of {span}")))
    finally:
        progress.close()
    return (add_relative_change(records) + context_use_records(per_document, resamples_of)
            + context_gain_records(per_document, resamples_of), skipped)
