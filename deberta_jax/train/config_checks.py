"""Validating an experiment config once, at start-up, with errors that name the field and the fix.

A bad sweep value should fail before any data is read or anything is compiled, not deep inside a
jit trace or an hour into a run. `validate` checks the whole `ml_collections` config against the
machine (device count) and returns the `ModelConfig` the run will use; `resolved` records the
derived values (trained length, tokenizer vocabulary) in the config that is saved to the workdir.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

from absl import flags as absl_flags
from ml_collections import config_dict
from ml_collections.config_flags import config_flags as config_flags_module

from deberta_jax import storage
from deberta_jax.data import errors, packing, row_lengths
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.train.optim import SCHEDULES


def _require(ok: bool, field: str, value, problem: str) -> None:
    if not ok:
        raise ConfigError(f"config.{field}={value!r} {problem}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(config, field: str, minimum: int) -> None:
    value = get_field(config, field)
    _require(_is_int(value) and value >= minimum, field, value, f"must be an integer >= {minimum}")


def _require_number(config, field: str, low: float, high: float, *, low_open=False, high_open=True) -> None:
    value = get_field(config, field)
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    _require(ok, field, value, f"must be a number in {interval}")


def get_field(config, field: str):
    """The value at a dotted path such as "train.batch_size"."""
    section, _, name = field.rpartition(".")
    node = config
    for part in filter(None, section.split(".")):
        node = node[part]
    return node[name]


def validate(config: config_dict.ConfigDict, num_devices: int) -> ModelConfig:
    """Checks every field the run reads; returns the model config with `trained_length = data.seq_len`."""
    _require_int(config, "seed", 0)

    # ---- data
    _require(isinstance(config.data.train_files, str) and config.data.train_files.strip() != "",
             "data.train_files", config.data.train_files,
             "must name training text: files, globs (comma-separated) or hf:NAME:CONFIG:SPLIT")
    _require(isinstance(config.data.eval_files, str), "data.eval_files", config.data.eval_files,
             'must be a data spec like data.train_files, or "" to disable evaluation')
    tokenizer = config.data.tokenizer
    _require(tokenizer is None or storage.path(tokenizer).is_file(), "data.tokenizer", tokenizer,
             "does not exist; pass a tokenizer.json file, or leave it unset to train one on data.train_files")
    # The token cache is memory-mapped, so it lives on each host's own disk; the text itself may be in a bucket.
    _require(not storage.is_remote(config.data.cache_dir), "data.cache_dir", config.data.cache_dir,
             "must be a local folder (each host memory-maps its own token cache); corpora in object storage are "
             "read from data.train_files / eval_files and tokenized into it")
    seq_len = config.data.seq_len
    _require(_is_int(seq_len), "data.seq_len", seq_len, "must be an integer")
    low, high = packing.MIN_SEQ_LEN, packing.MAX_SEQ_LEN
    _require(low <= seq_len <= high, "data.seq_len", seq_len,
             f"is out of range: need {low} <= seq_len <= {high} (each row is [CLS] + seq_len-2 tokens + [SEP])")
    _require_number(config, "data.mask_prob", 0.0, 1.0, low_open=True)
    _require(isinstance(config.data.whole_word_masking, bool), "data.whole_word_masking",
             config.data.whole_word_masking, "must be True or False")
    min_row = config.data.min_row_length
    _require(min_row == 0 or (_is_int(min_row) and low <= min_row <= seq_len), "data.min_row_length", min_row,
             f"must be 0 (every row full) or a length in [{low}, data.seq_len={seq_len}]")

    # ---- mesh
    _require_int(config, "mesh.fsdp", 1)
    _require(num_devices % config.mesh.fsdp == 0, "mesh.fsdp", config.mesh.fsdp,
             f"must divide the number of devices ({num_devices}); the rest of them form the data axis")

    # ---- model
    model = dict(config.model)
    _require(model.get("trained_length") in (None, seq_len), "model.trained_length", model.get("trained_length"),
             f"is derived from config.data.seq_len={seq_len}; leave it unset")
    model["trained_length"] = None  # set below, once the table size is known to be large enough
    try:
        model_config = ModelConfig.from_dict(model)
    except ConfigError as err:
        raise ConfigError(f"config.{err}") from None
    table = model_config.max_position_embeddings
    what = ("the size of the model's absolute position table" if model_config.uses_absolute_table
            else "the longest trained length a ModelConfig accepts")
    _require(seq_len <= table, "data.seq_len", seq_len,
             f"exceeds config.model.max_position_embeddings={table}, {what}; raise max_position_embeddings "
             f"to at least {seq_len} or shorten seq_len")
    model_config = dataclasses.replace(model_config, trained_length=seq_len)
    _check_long_phase(config, num_devices, table, what)
    _require(model_config.attention_kernel != "cudnn" or model_config.attention_dropout == 0,
             "model.attention_kernel", model_config.attention_kernel, "has no attention dropout (cuDNN's kernel "
             f"through jax.nn.dot_product_attention), and model.attention_dropout={model_config.attention_dropout}; "
             "set model.attention_dropout=0, or train with 'pallas' or 'dense', which have it")

    # ---- train
    train = "train."
    for name in ("num_steps", "batch_size", "grad_accum_steps", "log_every", "eval_every",
                 "checkpoint_every", "keep_checkpoints"):
        _require_int(config, train + name, 1)
    _require_int(config, train + "warmup_steps", 0)
    batch_size, accum = config.train.batch_size, config.train.grad_accum_steps
    if batch_size % (num_devices * accum):
        unit = num_devices * accum
        per = f"{num_devices} devices" + (f" x {accum} accumulation steps = {unit}" if accum > 1 else "")
        raise ConfigError(f"config.train.batch_size={batch_size} is not divisible by {per}; "
                          f"use a multiple of {unit}")
    eval_batches = config.train.eval_batches
    _require(eval_batches is None or (_is_int(eval_batches) and eval_batches >= 1), train + "eval_batches",
             eval_batches, "must be an integer >= 1, or None for all of eval_files")
    _require(config.train.schedule in SCHEDULES, train + "schedule", config.train.schedule,
             f"is not a schedule; choose one of {SCHEDULES}")
    _require_number(config, train + "learning_rate", 0.0, math.inf, low_open=True)
    _require_number(config, train + "weight_decay", 0.0, math.inf)
    _require_number(config, train + "b1", 0.0, 1.0)
    _require_number(config, train + "b2", 0.0, 1.0)
    _require_number(config, train + "eps", 0.0, math.inf, low_open=True)
    _require_number(config, train + "grad_clip_norm", 0.0, math.inf, low_open=True)
    return model_config


def _check_long_phase(config: config_dict.ConfigDict, num_devices: int, table: int, what: str) -> None:
    """Short-then-long (`row_lengths`): the long rows fit the model and split into whole batches of the same
    tokens; a long length without long steps would silently do nothing."""
    long_steps, long_len, seq_len = config.train.long_steps, config.data.long_seq_len, config.data.seq_len
    _require_int(config, "train.long_steps", 0)
    _require(long_steps <= config.train.num_steps, "train.long_steps", long_steps,
             f"exceeds config.train.num_steps={config.train.num_steps}; the long phase is the run's last steps")
    share = config.train.long_share
    if not long_steps:
        _require(long_len == 0, "data.long_seq_len", long_len,
                 "is set but config.train.long_steps=0, so no step would use it; set train.long_steps (the last "
                 "updates, trained on rows of long_seq_len) or leave long_seq_len at 0")
        _require(share == 1, "train.long_share", share,
                 "is set but config.train.long_steps=0, so there is no long phase to share; set train.long_steps "
                 "or leave long_share at 1")
        return
    _require_number(config, "train.long_share", 0.0, 1.0, low_open=True, high_open=False)
    _require(row_lengths.long_step_count(long_steps, share) > 0, "train.long_share", share,
             f"leaves none of the config.train.long_steps={long_steps} steps on long rows; raise it or long_steps")
    _require(_is_int(long_len) and seq_len < long_len <= min(table, packing.MAX_SEQ_LEN), "data.long_seq_len",
             long_len, f"must be an integer above data.seq_len={seq_len} for config.train.long_steps={long_steps}, "
             f"at most {min(table, packing.MAX_SEQ_LEN)} ({what})")
    tokens = config.train.batch_size * seq_len
    rows = tokens // long_len
    unit = num_devices * config.train.grad_accum_steps
    _require(tokens % long_len == 0 and rows % unit == 0, "data.long_seq_len", long_len,
             f"must divide the {tokens} tokens of a step (train.batch_size x data.seq_len) into a number of rows "
             f"divisible by {unit} (devices x accumulation steps), so the long phase trains on the same tokens per "
             "step; e.g. 2, 4 or 8 times data.seq_len")


def resolved(config: config_dict.ConfigDict, model_config: ModelConfig) -> config_dict.ConfigDict:
    """A copy of `config` whose `model` section is the complete `ModelConfig` the run trains.

    Saved as the workdir's config.json: it holds every derived value (trained_length, the
    tokenizer's vocabulary size), so the workdir alone rebuilds the model.
    """
    out = config_dict.ConfigDict(config.to_dict())
    out.model = config_dict.ConfigDict(model_config.to_dict())
    return out


def differences(old: config_dict.ConfigDict, new: config_dict.ConfigDict) -> dict[str, tuple]:
    """`{"train.num_steps": (old, new), ...}` for every leaf that was added, removed or changed."""
    def flat(d, prefix=""):
        out = {}
        for key, value in d.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out
    a, b = flat(old.to_dict()), flat(new.to_dict())
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def load_config_file(spec: str):
    """`get_config(arg)` of a `path/to/config.py[:arg]` spec, as ml_collections' config flags load it."""
    path, _, arg = spec.partition(":")
    module_spec = importlib.util.spec_from_file_location("_config_for_error", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.get_config(arg) if arg else module.get_config()


def _flag_argument(argv: list[str], flag: str) -> str | None:
    """The value given to `--flag` in `argv` (as `--flag=VALUE` or `--flag VALUE`), or None."""
    spec = next((a.split("=", 1)[1] for a in argv if a.startswith(f"--{flag}=")), None)
    if spec is None and f"--{flag}" in argv[:-1]:
        spec = argv[argv.index(f"--{flag}") + 1]
    return spec


def parse_config_flags(flags, argv: list[str], flag: str):
    """`flags(argv)`, with every mistake on the command line ending in one line instead of a traceback: a config
    file that does not exist, a config file that refuses its argument (an unknown size), a flag that is missing
    or not of its type (absl's messages, which app.run would print without a traceback had it parsed them), and
    ml_collections' bare `AttributeError: 'foo'` for an override of a field the config lacks
    (`--config.model.foo=1`), which becomes one that lists the fields that exist."""
    spec = _flag_argument(argv, flag)
    if spec is not None and not os.path.isfile(spec.partition(":")[0]):  # ml_collections would defer this error
        raise SystemExit(f"--{flag}={spec}: {spec.partition(':')[0]} does not exist; name a config file as "
                         "PATH.py[:ARG], relative to this folder or absolute")
    try:
        return flags(argv)
    except config_flags_module.UnsupportedOperationError as err:  # e.g. a list field, which flags cannot set
        found = re.search(r"Type <class '(\w+)'> of field (\S+) is not supported", str(err))
        kind, field = found.groups() if found else ("this", "the field")
        raise SystemExit(f"--{field}: a {kind} field cannot be set from the command line (only numbers, strings, "
                         "booleans and tuples can); change it in the config file, or in a copy of it") from None
    except absl_flags.Error as err:
        if os.environ.get(errors.TRACEBACK_VARIABLE):
            raise
        message = " ".join(str(err).split()) + " (--helpshort lists the flags)"
        if "Error whilst parsing config file" in str(err):  # get_config raised: its message is the last line
            message = f"--{flag}={spec}: " + str(err).strip().splitlines()[-1].partition(": ")[2]
        raise SystemExit(message) from None
    except (AttributeError, KeyError) as err:  # KeyError for a missing section, AttributeError for a field
        found = re.search(r"'([^'\\]+)", str(err))
        missing = found.group(1) if found else ""
        prefix = f"--{flag}."
        override = next((a for a in argv if a.startswith(prefix) and missing in a.split("=")[0].split(".")), None)
        if override is None or spec is None:
            raise
        node, where = load_config_file(spec), [flag]
        for part in override[len(prefix):].split("=")[0].split("."):
            if not hasattr(node, "keys") or part not in node:
                missing = part
                break
            node = node[part]
            where.append(part)
        where = ".".join(where)
        known = sorted(node.keys()) if hasattr(node, "keys") else []
        raise SystemExit(f"{override.split('=')[0]}: {where} has no field {missing!r}; its fields are {known}. "
                         f"Check the spelling, or add the field to {spec.partition(':')[0]}.") from None
