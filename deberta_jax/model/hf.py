"""transformers checkpoints (`BertForMaskedLM`, `DebertaV2ForMaskedLM`) in both directions, without torch.

A `save_pretrained` directory holds `config.json` and `model.safetensors`, read and written here with plain
JSON and `safetensors.numpy`. One table of config keys (`_FIELDS`) and one of weight names (`_rules`) serve
both directions, so a name fixed for loading is fixed for exporting too.

Loading (`load`) is all-or-nothing: every parameter of the built model must be filled, every tensor in the
file must be used (or be on a short list of tensors an MLM never reads, such as BERT's pooler), and shapes
must agree. Anything else raises `CheckpointError` naming the key, because a silently partial load produces
a model that looks fine and is wrong. Relative positions are loaded with `clamp_relative_positions=False`,
transformers' own behaviour, so logits match it exactly; set it back to True (the official microsoft/DeBERTa
behaviour with log buckets) to study long sequences without reading the untrained row 0 of the relative table.

Saving (`save`) refuses what transformers cannot express or cannot compute the same way (`ExportError`, naming
the config field) and warns (`ExportWarning`) where the exported model agrees with this one only up to a sequence
length.

`load_tokenizer` reads the tokenizer saved beside a checkpoint: `tokenizer.json`, or the files published
checkpoints ship instead (DeBERTa-v2/v3's SentencePiece `spm.model`, BERT's `vocab.txt`), converted by
transformers exactly as `AutoTokenizer` would.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import warnings
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM

CONFIG_FILE = "config.json"
# The length a model of this project trained at (`ModelConfig.trained_length`), written into an export's config.json
# (transformers keeps keys it does not know as attributes): what an evaluation's 1x is. A published checkpoint has no
# such record.
TRAINED_LENGTH_KEY = "deberta_jax_trained_length"
WEIGHTS_FILE = "model.safetensors"
TOKENIZER_FILE = "tokenizer.json"
# What published checkpoints ship instead of tokenizer.json, with the models that use them.
CONVERTIBLE_TOKENIZER_FILES = {"spm.model": "DeBERTa-v2/v3 SentencePiece", "vocab.txt": "BERT WordPiece"}


class CheckpointError(ValueError):
    """The checkpoint holds a config value or weight this code cannot represent."""


class ExportError(ValueError):
    """The model uses a feature that transformers' BERT and DeBERTa-v2 cannot express."""


class ExportWarning(UserWarning):
    """The exported model gives this model's logits only up to a stated sequence length."""


# Tensors that exist in some checkpoints but play no part in masked-LM logits.
_IGNORED = (
    re.compile(r"^(bert|deberta)\.pooler\."),
    re.compile(r"^mask_predictions\."),
    re.compile(r"\.position_ids$"),
    re.compile(r"^cls\.seq_relationship\."),
)
_ARCHITECTURES = {"bert": "BertForMaskedLM", "deberta-v2": "DebertaV2ForMaskedLM"}
_LAYER_NORM_EPS = {"bert": 1e-12, "deberta-v2": 1e-7}  # transformers' defaults when config.json omits it

# (config.json key, ModelConfig field, value when the key is absent; None: the key is required), shared by
# both families. DeBERTa's relative-position knobs carry the same names on both sides (see ModelConfig).
_FIELDS = (
    ("vocab_size", "vocab_size", None),
    ("hidden_size", "hidden_size", None),
    ("num_hidden_layers", "num_layers", None),
    ("num_attention_heads", "num_heads", None),
    ("intermediate_size", "intermediate_size", None),
    ("max_position_embeddings", "max_position_embeddings", None),
    ("hidden_act", "hidden_act", "gelu"),
    ("hidden_dropout_prob", "hidden_dropout", 0.1),
    ("attention_probs_dropout_prob", "attention_dropout", 0.1),
    ("initializer_range", "initializer_range", 0.02),
    ("type_vocab_size", "type_vocab_size", 0),
)


# --------------------------------------------------------------------------- loading
def load(path: str | os.PathLike, trained_length: int | None = None, **overrides) -> MaskedLM:
    """Build the `MaskedLM` stored at `path` (a `save_pretrained` directory) with its weights.

    `trained_length` is the length it trained at, for a checkpoint that does not record it (`TRAINED_LENGTH_KEY`;
    one that does and says otherwise is refused). `overrides` replace `ModelConfig` fields after conversion (e.g.
    `clamp_relative_positions=True`, `absolute_position_policy="clip"`).
    """
    config, tensors = read_checkpoint(path)
    cfg = config_from_hf(config)
    if trained_length is not None:
        if cfg.trained_length not in (None, trained_length):
            raise CheckpointError(f"{path} records its training length, {cfg.trained_length} tokens (this project's "
                                  f"export), not the {trained_length} given; leave the training length out")
        cfg = dataclasses.replace(cfg, trained_length=trained_length)
    cfg = cfg.with_options(**overrides)
    # Abstract parameters: every one is replaced by a checkpoint tensor, so none is drawn at random first.
    model = nnx.eval_shape(lambda: MaskedLM(cfg, rngs=nnx.Rngs(0)))
    assign_weights(model, tensors, family=config["model_type"], legacy=config.get("legacy", True))
    return model


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    path = os.fspath(path)
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: pass a directory written by save_pretrained")
    with open(config_path) as f:
        config = json.load(f)
    weights = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        raise FileNotFoundError(
            f"{weights} not found; only safetensors checkpoints are read (no torch at run time). Convert a "
            "pytorch_model.bin tensor for tensor (safetensors.torch.save_file(torch.load(...))); loading it into a "
            "transformers model class to re-save it would fill a head the file lacks with random weights.")
    return config, load_file(weights)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer saved beside the checkpoint at `path`.

    `tokenizer.json` is read as is. Published checkpoints often ship only DeBERTa's `spm.model` or BERT's
    `vocab.txt`; those are converted by transformers' `AutoTokenizer`, which also reads `tokenizer_config.json`
    (lower-casing, special tokens) and `config.json` (which tokenizer class), so the ids, the special tokens
    and the [MASK] id are the ones the checkpoint was trained with. Returns the converted `tokenizers` pipeline.
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} does not exist or is not a folder: give the folder of a Hugging Face "
                                "checkpoint (its config.json, weights and tokenizer files)")
    if os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        return Tokenizer.from_file(os.path.join(path, TOKENIZER_FILE))
    if not any(os.path.isfile(os.path.join(path, name)) for name in CONVERTIBLE_TOKENIZER_FILES):
        accepted = [TOKENIZER_FILE, *(f"{name} ({kind})" for name, kind in CONVERTIBLE_TOKENIZER_FILES.items())]
        raise FileNotFoundError(f"{path} holds no tokenizer: expected one of {', '.join(accepted)}. Save the "
                                "tokenizer beside the checkpoint (tokenizer.save_pretrained(path)).")
    try:
        import transformers  # imported here: only these conversions need it, and it is slow to import
    except ImportError:
        raise ImportError(f"converting the tokenizer in {path} needs transformers: pip install 'transformers>=4.45'"
                          ) from None
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not tokenizer.is_fast:
        raise CheckpointError(f"{path}: transformers gave a slow {type(tokenizer).__name__}, which has no tokenizers "
                              "pipeline to evaluate with; install sentencepiece and protobuf so it can convert it")
    return tokenizer.backend_tokenizer


def _require(config: Mapping, key: str, ok: Callable[[object], bool], why: str, default=None):
    value = config.get(key, default)
    if not ok(value):
        raise CheckpointError(f"config.json: {key}={value!r} cannot be represented: {why}")
    return value


def config_from_hf(config: Mapping) -> ModelConfig:
    """Translate a transformers `config.json` dict into a `ModelConfig`."""
    family = config.get("model_type")
    if family not in _ARCHITECTURES:
        raise CheckpointError(f"config.json: model_type={family!r} is not supported; use 'bert' or 'deberta-v2'")
    common = {field: config[key] if default is None else config.get(key, default) for key, field, default in _FIELDS}
    common["layer_norm_eps"] = config.get("layer_norm_eps", _LAYER_NORM_EPS[family])
    common["trained_length"] = _require(config, TRAINED_LENGTH_KEY,
                                        lambda v: v is None or (isinstance(v, int) and not isinstance(v, bool)
                                                                and v > 0),
                                        "the training length this project's export records is a number of tokens")
    if family == "bert":
        _require(config, "position_embedding_type", lambda v: v in (None, "absolute"),
                 "only absolute position embeddings are supported for BERT")
        return ModelConfig(**common, attention="entangled", position_biased_input=True, pos_att_type=())
    hidden = config["hidden_size"]
    _require(config, "embedding_size", lambda v: v in (None, hidden),
             "an embedding size different from hidden_size needs embed_proj, which is not supported")
    _require(config, "conv_kernel_size", lambda v: not v, "the v2-xlarge convolution layer is not supported", 0)
    _require(config, "attention_head_size", lambda v: v in (None, hidden // config["num_attention_heads"]),
             "head size must be hidden_size / num_attention_heads")
    pos_att_type = config.get("pos_att_type") or []
    if isinstance(pos_att_type, str):
        pos_att_type = [p for p in pos_att_type.lower().split("|") if p]
    relative = bool(config.get("relative_attention", False))
    if not relative and pos_att_type:
        raise CheckpointError(
            f"config.json: pos_att_type={pos_att_type!r} with relative_attention=false changes the "
            "score scale without adding position terms; this combination is not supported")
    norm = [x.strip() for x in str(config.get("norm_rel_ebd", "none")).lower().split("|")]
    unknown_norm = [x for x in norm if x not in ("none", "layer_norm")]
    if unknown_norm:
        raise CheckpointError(f"config.json: norm_rel_ebd={config.get('norm_rel_ebd')!r} is not supported")
    max_rel = config.get("max_relative_positions", -1)
    buckets = config.get("position_buckets", -1)
    return ModelConfig(
        **common,
        attention="disentangled" if relative else "entangled",
        position_biased_input=config.get("position_biased_input", True),
        pos_att_type=tuple(pos_att_type),
        position_buckets=max(buckets, 0),
        max_relative_positions=max_rel if max_rel >= 1 else config["max_position_embeddings"],
        share_att_key=config.get("share_att_key", False),
        norm_rel_ebd="layer_norm" if "layer_norm" in norm else "none",
        clamp_relative_positions=False,
    )


# --------------------------------------------------------------------------- weight mapping
# Each rule maps a checkpoint key pattern to (attribute path in MaskedLM, transform). `{n}` is a layer.
_LINEAR = "linear"      # torch Linear: weight [out, in] -> kernel [in, out]; bias as is
_NORM = "norm"          # LayerNorm: weight -> scale, bias -> bias
_TABLE = "table"        # Embedding weight / raw parameter, as is
_TOKEN_TYPES = "embeddings.token_type_embeddings"


def _rules(family: str, legacy: bool) -> list[tuple[str, str, str]]:
    """(checkpoint prefix, model attribute path, kind) for one family."""
    if family == "bert":
        p, q, k, v = "bert.", "query", "key", "value"
    else:
        p, q, k, v = "deberta.", "query_proj", "key_proj", "value_proj"
    layer = p + "encoder.layer.{n}."
    rules = [
        (p + "embeddings.word_embeddings.weight", "embeddings.word_embeddings", _TABLE),
        (p + "embeddings.position_embeddings.weight", "embeddings.position_embeddings", _TABLE),
        (p + "embeddings.token_type_embeddings.weight", _TOKEN_TYPES, _TABLE),
        (p + "embeddings.LayerNorm", "embeddings.norm", _NORM),
        (layer + f"attention.self.{q}", "encoder.layers.{n}.attention.query_proj", _LINEAR),
        (layer + f"attention.self.{k}", "encoder.layers.{n}.attention.key_proj", _LINEAR),
        (layer + f"attention.self.{v}", "encoder.layers.{n}.attention.value_proj", _LINEAR),
        (layer + "attention.self.pos_key_proj", "encoder.layers.{n}.attention.pos_key_proj", _LINEAR),
        (layer + "attention.self.pos_query_proj", "encoder.layers.{n}.attention.pos_query_proj", _LINEAR),
        (layer + "attention.output.dense", "encoder.layers.{n}.attention_out", _LINEAR),
        (layer + "attention.output.LayerNorm", "encoder.layers.{n}.attention_norm", _NORM),
        (layer + "intermediate.dense", "encoder.layers.{n}.intermediate", _LINEAR),
        (layer + "output.dense", "encoder.layers.{n}.output", _LINEAR),
        (layer + "output.LayerNorm", "encoder.layers.{n}.output_norm", _NORM),
        (p + "encoder.rel_embeddings.weight", "encoder.rel_embeddings", _TABLE),
        (p + "encoder.LayerNorm", "encoder.rel_norm", _NORM),
    ]
    if family == "bert" or legacy:
        head = "cls.predictions."
        rules += [
            (head + "transform.dense", "head_dense", _LINEAR),
            (head + "transform.LayerNorm", "head_norm", _NORM),
            (head + "bias", "head_bias", _TABLE),
        ]
    else:
        head = "lm_predictions.lm_head."
        rules += [
            (head + "dense", "head_dense", _LINEAR),
            (head + "LayerNorm", "head_norm", _NORM),
            (head + "bias", "head_bias", _TABLE),
        ]
    return rules


def _expand(rules, num_layers: int) -> dict[str, tuple[str, str]]:
    """Checkpoint key -> (model path, transform) for every tensor a model of this size can hold."""
    out = {}
    for key, target, kind in rules:
        for n in range(num_layers) if "{n}" in key else [None]:
            k, t = key.format(n=n), target.format(n=n)
            if kind == _TABLE:
                out[k] = (t, "value")
            elif kind == _LINEAR:
                out[k + ".weight"] = (t + ".kernel", "transpose")
                out[k + ".bias"] = (t + ".bias", "value")
            else:
                out[k + ".weight"] = (t + ".scale", "value")
                out[k + ".bias"] = (t + ".bias", "value")
    return out


def _variable(model: MaskedLM, path: str):
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _param_paths(model: MaskedLM) -> set[str]:
    return {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _tied_decoder_keys(family: str, legacy: bool) -> tuple[str, str | None]:
    """(decoder weight key, decoder bias key) of heads whose decoder is tied to word embeddings."""
    if family == "bert" or legacy:
        return "cls.predictions.decoder.weight", "cls.predictions.decoder.bias"
    return "lm_predictions.lm_head.decoder.weight", None


def assign_weights(model: MaskedLM, tensors: Mapping[str, np.ndarray], *, family: str, legacy: bool) -> None:
    """Copy `tensors` into `model`, failing on any unused tensor, unfilled parameter or bad shape."""
    mapping = _expand(_rules(family, legacy), model.cfg.num_layers)
    word_key = ("bert." if family == "bert" else "deberta.") + "embeddings.word_embeddings.weight"
    decoder_w, decoder_b = _tied_decoder_keys(family, legacy)
    filled: set[str] = set()
    for key, array in tensors.items():
        if any(p.search(key) for p in _IGNORED):
            continue
        if key == decoder_w:
            if word_key in tensors and not np.array_equal(array, tensors[word_key]):
                raise CheckpointError(
                    f"{key}: the MLM decoder is not tied to {word_key}; untied heads are not supported")
            continue
        if key == decoder_b:
            head_bias = tensors.get("cls.predictions.bias")
            if head_bias is not None and not np.array_equal(array, head_bias):
                raise CheckpointError(f"{key} differs from cls.predictions.bias; expected them tied")
            if head_bias is not None:
                continue
            key_target = mapping["cls.predictions.bias"]
        elif key in mapping:
            key_target = mapping[key]
        else:
            raise CheckpointError(f"{key}: this tensor has no place in the model built from config.json "
                                  "(unsupported layer or a config/weights mismatch)")
        path, how = key_target
        var = _variable(model, path)
        if var is None:
            raise CheckpointError(f"{key}: the model built from config.json has no {path} "
                                  "(check relative_attention / position_biased_input / pos_att_type)")
        value = np.asarray(array, dtype=np.float32)
        value = value.T if how == "transpose" else value
        if tuple(var.shape) != value.shape:
            raise CheckpointError(f"{key}: shape {tuple(array.shape)} does not fit {path} of shape {tuple(var.shape)}")
        var.set_value(jnp.asarray(value))
        filled.add(path)
    missing = sorted(_param_paths(model) - filled)
    if missing:
        if any(key.startswith("mask_predictions.") for key in tensors) and "head_dense.kernel" in missing:
            raise CheckpointError(
                "the checkpoint has a replaced-token-detection head (mask_predictions.*) and no masked-LM head: "
                "it is an ELECTRA-style discriminator (e.g. DeBERTa-v3 as published), whose masked-LM loss is "
                "undefined; evaluate a checkpoint that has an MLM head (cls.predictions.* or lm_predictions.*)")
        wanted = sorted(k for k, (p, _) in mapping.items() if p in missing)
        raise CheckpointError(f"checkpoint lacks tensors for {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                              f"expected keys such as {wanted[:5]}")


# --------------------------------------------------------------------------- saving
def family_of(cfg: ModelConfig) -> str:
    """The transformers model type that computes `cfg`'s logits: BERT for entangled attention over absolute
    positions at the input, DeBERTa-v2 for everything else it can express (relative attention, NoPE)."""
    return "bert" if cfg.attention == "entangled" and cfg.position_biased_input else "deberta-v2"


def _refusals(cfg: ModelConfig) -> list[str]:
    """Why each field that transformers' BERT and DeBERTa-v2 cannot express keeps `cfg` from being exported."""
    checks = (
        ("attention", cfg.attention not in ("entangled", "disentangled"),
         "transformers' BERT and DeBERTa-v2 have only entangled (BERT) and disentangled (DeBERTa) attention"),
        ("score_bias", cfg.score_bias != "none",
         "transformers' BERT and DeBERTa-v2 add no bias per distance to their attention scores"),
        ("use_emd", cfg.use_emd, ("the enhanced mask decoder exists only in the official DeBERTa code; "
                                  "DebertaV2ForMaskedLM predicts from the last layer")),
        ("absolute_embedding", cfg.uses_absolute_positions and cfg.absolute_embedding == "sinusoidal",
         "transformers' BERT and DeBERTa-v2 have only a learned absolute table"),
        ("randomized_positions", cfg.randomized_positions,
         ("the model was trained on sampled positions, which transformers' models never draw, so training it "
          "further there would change the scheme")),
        ("layer_norm_placement", cfg.layer_norm_placement != "post",
         "transformers' BERT and DeBERTa-v2 normalize after each residual add and have no final norm"),
        # Refused, not warned: the window and the temperature are part of what the model computes (a window
        # narrower than the training length even at the training length), and transformers can do neither.
        ("attention_window", cfg.attention_window != 0,
         "transformers attends to every key, so its logits differ on every sequence longer than the window"),
        ("attention_weights", cfg.attention_weights != "softmax",
         "transformers' BERT and DeBERTa-v2 weigh keys by a softmax of their scores"),
        ("attention_temperature", cfg.attention_temperature != "none",
         "transformers scales no attention score by the number of keys, so its logits differ past the training "
         "length"),
    )
    return [f"model.{field}={getattr(cfg, field)!r} ({why})" for field, refused, why in checks if refused]


def config_to_hf(cfg: ModelConfig, *, pad_token_id: int = 0) -> dict:
    """The transformers `config.json` dict of `cfg` (the inverse of `config_from_hf`); raises `ExportError`
    naming every field transformers cannot express."""
    refused = _refusals(cfg)
    if refused:
        raise ExportError("cannot export to transformers: " + "; ".join(refused))
    family = family_of(cfg)
    out = {"model_type": family, "architectures": [_ARCHITECTURES[family]],
           **{key: getattr(cfg, field) for key, field, _ in _FIELDS},
           "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": pad_token_id, "tie_word_embeddings": True}
    if cfg.trained_length is not None:
        out[TRAINED_LENGTH_KEY] = cfg.trained_length
    if family == "bert":
        # BertEmbeddings always adds a token-type row; `export_tensors` writes a zero one when the model has none.
        out.update(type_vocab_size=max(cfg.type_vocab_size, 1), position_embedding_type="absolute")
        return out
    out.update(position_biased_input=cfg.position_biased_input, relative_attention=cfg.attention == "disentangled",
               legacy=True)  # the cls.predictions head names, read by every transformers version
    if cfg.attention == "disentangled":
        out.update(pos_att_type=list(cfg.pos_att_type), position_buckets=cfg.position_buckets,
                   max_relative_positions=cfg.max_relative_positions, share_att_key=cfg.share_att_key,
                   norm_rel_ebd=cfg.norm_rel_ebd)
    return out


def export_differences(cfg: ModelConfig) -> list[str]:
    """Where the exported model's logits leave this model's beyond float32 rounding: one sentence per difference,
    with the length up to which the two agree. Empty when they agree at every length."""
    notes = []
    if cfg.attention == "disentangled" and cfg.pos_att_type and cfg.clamp_relative_positions:
        n = cfg.max_relative_positions
        notes.append(
            f"model.clamp_relative_positions=True: transformers does not clamp relative distances, so a key {n} or "
            f"more positions after its query reads row 0 of the relative table there instead of the outermost "
            f"trained row here; logits agree for sequences of up to {n} tokens (max_relative_positions) and differ "
            "beyond")
    if (cfg.uses_absolute_table and cfg.absolute_position_policy != "untrained"
            and cfg.trained_positions < cfg.max_position_embeddings):
        n = cfg.trained_positions
        notes.append(
            f"model.absolute_position_policy={cfg.absolute_position_policy!r} governs positions from {n} (the "
            f"training length) here, while transformers reads the absolute table's rows as allocated (the "
            f"'untrained' policy) up to max_position_embeddings={cfg.max_position_embeddings}; logits agree for "
            f"sequences of up to {n} tokens and differ beyond")
    if cfg.dtype != "float32":
        notes.append(f"model.dtype={cfg.dtype!r}: the exported parameters are float32 and transformers computes in "
                     f"float32 unless asked otherwise, so its logits differ from this model's by {cfg.dtype} "
                     "rounding at every length")
    return notes


def export_tensors(model: MaskedLM) -> dict[str, np.ndarray]:
    """Every parameter of `model` under its transformers name (`_rules` read backwards), float32.

    The MLM decoder is not written: transformers ties it to the word embeddings on load, as it does for the
    checkpoints its own `save_pretrained` writes.
    """
    cfg = model.cfg
    family = family_of(cfg)
    out, exported = {}, set()
    for key, (path, how) in _expand(_rules(family, legacy=True), cfg.num_layers).items():
        var = _variable(model, path)
        if var is None:
            if family == "bert" and path == _TOKEN_TYPES:
                out[key] = np.zeros((1, cfg.hidden_size), np.float32)  # adds nothing, as no token types
            continue
        value = np.asarray(var[...], np.float32)
        out[key] = np.ascontiguousarray(value.T if how == "transpose" else value)
        exported.add(path)
    unnamed = sorted(_param_paths(model) - exported)
    if unnamed:
        raise ExportError(f"parameters {unnamed[:5]} have no transformers name; this model cannot be exported")
    return out


def save(model: MaskedLM, path: str | os.PathLike, *, pad_token_id: int = 0) -> list[str]:
    """Write `model` as a transformers checkpoint directory (`config.json`, `model.safetensors`) that
    `AutoModelForMaskedLM.from_pretrained(path)` reads; returns `export_differences`, each also warned as an
    `ExportWarning`. Parameters are float32 whatever `model.cfg.dtype` computes in."""
    config = config_to_hf(model.cfg, pad_token_id=pad_token_id)
    tensors = export_tensors(model)
    notes = export_differences(model.cfg)
    for note in notes:
        warnings.warn(note, ExportWarning, stacklevel=2)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    # transformers refuses safetensors files whose metadata does not name their framework.
    weights = os.path.join(path, WEIGHTS_FILE)
    save_file(tensors, weights, metadata={"format": "pt"})
    # safetensors writes through a private (0600) temporary file: give the weights the mode config.json got.
    os.chmod(weights, os.stat(os.path.join(path, CONFIG_FILE)).st_mode & 0o777)
    return notes
