"""Load transformers checkpoints (`BertForMaskedLM`, `DebertaV2ForMaskedLM`) without torch.

A checkpoint directory written by `save_pretrained` holds `config.json` and `model.safetensors`; both
are read with plain JSON and `safetensors.numpy`. The load is all-or-nothing: every parameter of the
built model must be filled, every tensor in the file must be used (or be on a short list of tensors an
MLM never reads, such as BERT's pooler), and shapes must agree. Anything else raises `CheckpointError`
naming the key, because a silently partial load produces a model that looks fine and is wrong.

Relative positions are loaded with `clamp_relative_positions=False`, transformers' own behaviour, so
logits match it exactly; set it back to True (the official microsoft/DeBERTa behaviour with log buckets)
to study long sequences without reading the untrained row 0 of the relative table.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file

from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM


class CheckpointError(ValueError):
    """The checkpoint holds a config value or weight this code cannot represent."""


# Tensors that exist in some checkpoints but play no part in masked-LM logits.
_IGNORED = (
    re.compile(r"^(bert|deberta)\.pooler\."),
    re.compile(r"^mask_predictions\."),
    re.compile(r"\.position_ids$"),
    re.compile(r"^cls\.seq_relationship\."),
)


def load(path: str | os.PathLike, **overrides) -> MaskedLM:
    """Build the `MaskedLM` stored at `path` (a `save_pretrained` directory) with its weights.

    `overrides` replace `ModelConfig` fields after conversion (e.g. `clamp_relative_positions=True`,
    `absolute_position_policy="clip"`).
    """
    config, tensors = read_checkpoint(path)
    cfg = dataclasses.replace(config_from_hf(config), **overrides)
    model = MaskedLM(cfg, rngs=nnx.Rngs(0))
    assign_weights(model, tensors, family=config["model_type"], legacy=config.get("legacy", True))
    return model


def read_checkpoint(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    path = os.fspath(path)
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{config_path} not found: pass a directory written by save_pretrained")
    with open(config_path) as f:
        config = json.load(f)
    weights = os.path.join(path, "model.safetensors")
    if not os.path.isfile(weights):
        raise FileNotFoundError(
            f"{weights} not found; only safetensors checkpoints are read (no torch at run time). "
            "Re-save with model.save_pretrained(path, safe_serialization=True).")
    return config, load_file(weights)


def _require(config: Mapping, key: str, ok: Callable[[object], bool], why: str, default=None):
    value = config.get(key, default)
    if not ok(value):
        raise CheckpointError(f"config.json: {key}={value!r} cannot be represented: {why}")
    return value


def config_from_hf(config: Mapping) -> ModelConfig:
    """Translate a transformers `config.json` dict into a `ModelConfig`."""
    family = config.get("model_type")
    common = dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        hidden_act=config.get("hidden_act", "gelu"),
        hidden_dropout=config.get("hidden_dropout_prob", 0.1),
        attention_dropout=config.get("attention_probs_dropout_prob", 0.1),
        initializer_range=config.get("initializer_range", 0.02),
        max_position_embeddings=config["max_position_embeddings"],
        type_vocab_size=config.get("type_vocab_size", 0),
    )
    if family == "bert":
        _require(config, "position_embedding_type", lambda v: v in (None, "absolute"),
                 "only absolute position embeddings are supported for BERT")
        return ModelConfig(**common, layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                           attention="entangled", position_biased_input=True, pos_att_type=())
    if family == "deberta-v2":
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
            layer_norm_eps=config.get("layer_norm_eps", 1e-7),
            attention="disentangled" if relative else "entangled",
            position_biased_input=config.get("position_biased_input", True),
            pos_att_type=tuple(pos_att_type),
            position_buckets=max(buckets, 0),
            max_relative_positions=max_rel if max_rel >= 1 else config["max_position_embeddings"],
            share_att_key=config.get("share_att_key", False),
            norm_rel_ebd="layer_norm" if "layer_norm" in norm else "none",
            clamp_relative_positions=False,
        )
    raise CheckpointError(f"config.json: model_type={family!r} is not supported; use 'bert' or 'deberta-v2'")


# --------------------------------------------------------------------------- weight mapping
# Each rule maps a checkpoint key pattern to (attribute path in MaskedLM, transform). `{n}` is a layer.
_LINEAR = "linear"      # torch Linear: weight [out, in] -> kernel [in, out]; bias as is
_NORM = "norm"          # LayerNorm: weight -> scale, bias -> bias
_TABLE = "table"        # Embedding weight / raw parameter, as is


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
        (p + "embeddings.token_type_embeddings.weight", "embeddings.token_type_embeddings", _TABLE),
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
                raise CheckpointError(f"{key}: the MLM decoder is not tied to {word_key}; untied heads are not supported")
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
        var[...] = jnp.asarray(value)
        filled.add(path)
    params = {".".join(map(str, path)) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    missing = sorted(params - filled)
    if missing:
        wanted = sorted(k for k, (p, _) in mapping.items() if p in missing)
        raise CheckpointError(f"checkpoint lacks tensors for {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                              f"expected keys such as {wanted[:5]}")
