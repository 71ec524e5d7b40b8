"""Logits of `hf.load` against transformers' PyTorch models on padded batches (float32).

A freshly initialized transformers model has every bias 0 and every LayerNorm at (1, 0), so a bias or
norm loaded into the wrong place would still give the right logits. Every case therefore perturbs all
biases and LayerNorm parameters before saving (`perturb_biases_and_norms`), feeds random token types
where the model has them, and uses weights large enough (`initializer_range`) that attention is far
from uniform, so positions and relative terms move the logits. Errors are compared at real tokens
only; the tolerance (1e-5) sits near the largest error observed, 2.1e-6 at logits of std ~1.
"""

import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from deberta_jax.model import hf

TOL = 1e-5
SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, initializer_range=0.15)
V3 = dict(SMALL, max_position_embeddings=512, relative_attention=True, position_buckets=256, max_relative_positions=512,
          share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, pos_att_type=["p2c", "c2p"],
          type_vocab_size=0)

DEBERTA_CASES = {
    "v3": (V3, [9]),
    # Every distance up to 639: exact buckets, the log region, and past max_relative_positions, where
    # transformers does not clamp (j - i >= 512 reads row 0 of the relative table; hf.load sets
    # clamp_relative_positions=False to match).
    "v3_long": (dict(V3, hidden_size=16, num_attention_heads=2, intermediate_size=32), [640]),
    "separate_pos_proj": (dict(V3, share_att_key=False), [40]),
    "c2p_only": (dict(V3, pos_att_type=["c2p"]), [17]),
    "p2c_only": (dict(V3, pos_att_type=["p2c"], share_att_key=False), [17]),
    # Without buckets the table has 2 * max_relative_positions rows; length 40 > 16 overflows it.
    "no_buckets": (dict(V3, position_buckets=-1, max_relative_positions=16, norm_rel_ebd="none"), [12, 40]),
    # Small buckets reach the log region, and length 70 > max_relative_positions overflows it.
    "log_buckets": (dict(V3, position_buckets=16, max_relative_positions=32), [70]),
    "abs_input_token_types": (
        dict(V3, position_biased_input=True, type_vocab_size=2, max_position_embeddings=64), [20]),
    "new_head": (dict(V3, legacy=False), [11]),
    # Not the default 1e-7: an epsilon the loader ignored would move these logits by about 1e-3.
    "layer_norm_eps": (dict(V3, layer_norm_eps=1e-2), [13]),
}

# One compiled forward per model and shape: tracing the whole model once is several times faster
# than running it op by op, and the numbers are those of the public `mlm_logits`.
_mlm_logits = nnx.jit(lambda model, ids, mask, types: model.mlm_logits(ids, mask, types))


def perturb_biases_and_norms(torch_model, seed=0, scale=0.3):
    """Add seeded normal noise to every bias and every LayerNorm weight/bias of `torch_model`, in place.

    Parameters shared between modules (the MLM decoder bias tied to the head bias) are perturbed once,
    so ties survive. Returns the names of the perturbed parameters.
    """
    generator = torch.Generator().manual_seed(seed)
    seen, names = set(), []
    with torch.no_grad():
        for module_name, module in torch_model.named_modules():
            norm = isinstance(module, torch.nn.LayerNorm)
            for name, param in module.named_parameters(recurse=False):
                if id(param) in seen or not (norm or name == "bias"):
                    continue
                seen.add(id(param))
                param.add_(scale * torch.randn(param.shape, generator=generator))
                names.append(f"{module_name}.{name}")
    return names


def _padded_batch(rng, vocab, n, type_vocab_size=0):
    """Three rows (full length, three pads, half padding) and random token types (None without types)."""
    ids = rng.integers(0, vocab, size=(3, n)).astype(np.int64)
    mask = np.ones((3, n), np.int64)
    mask[1, n - 3:] = 0
    mask[2, n // 2:] = 0
    types = rng.integers(0, type_vocab_size, size=(3, n)).astype(np.int64) if type_vocab_size else None
    return ids, mask, types


def max_error(torch_model, model, n, seed=0):
    """Max |ours - transformers| over the real tokens of a padded batch of length `n`."""
    config = torch_model.config
    ids, mask, types = _padded_batch(np.random.default_rng(seed), config.vocab_size, n, config.type_vocab_size)
    with torch.no_grad():
        ref = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                          token_type_ids=None if types is None else torch.tensor(types)).logits.numpy()
    out = np.asarray(_mlm_logits(model, ids.astype(np.int32), mask.astype(np.int32),
                                 None if types is None else types.astype(np.int32)))
    assert out.shape == ref.shape
    assert np.isfinite(out).all()
    return float(np.abs(out - ref)[mask.astype(bool)].max())


def _compare(tmp_path, torch_model, lengths, **load_kw):
    torch_model.eval()
    assert perturb_biases_and_norms(torch_model)
    torch_model.save_pretrained(tmp_path)
    model = hf.load(tmp_path, **load_kw)
    for n in lengths:
        err = max_error(torch_model, model, n)
        assert err <= TOL, f"length {n}: max |diff| {err:.2e} at real tokens"


# Every way of computing c2p / p2c: gathers (CPU), matrix products and a shift (dense kernel on TPU and GPU), and
# the fused TPU kernel (interpreted here, slowly: on log buckets reaching past max_relative_positions and on exact
# clipped distances; each position term alone is checked against the dense kernel in tests/kernels).
COMPUTATIONS = {"gather": dict(relative_terms="gather"), "shift": dict(relative_terms="shift"),
                "pallas_tpu": dict(attention_kernel="pallas_tpu")}
KERNEL_CASES = ("v3_long", "no_buckets")


@pytest.mark.parametrize("name,computation", [(name, computation) for name in sorted(DEBERTA_CASES)
                                              for computation in sorted(COMPUTATIONS)
                                              if computation != "pallas_tpu" or name in KERNEL_CASES])
def test_deberta_v2_matches_transformers(tmp_path, name, computation):
    config, lengths = DEBERTA_CASES[name]
    torch.manual_seed(0)
    _compare(tmp_path, transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**config)), lengths,
             **COMPUTATIONS[computation])


def test_bert_matches_transformers(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(**SMALL, max_position_embeddings=64, type_vocab_size=2)
    _compare(tmp_path, transformers.BertForMaskedLM(config), [5, 64])


def test_perturbation_reaches_every_bias_and_norm():
    """Nothing a swap could hide is left at its initial value (0 biases, unit norms)."""
    torch.manual_seed(0)
    model = transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**dict(V3, type_vocab_size=2)))
    names = perturb_biases_and_norms(model)
    for name, param in model.named_parameters():
        if name.endswith("bias") or "LayerNorm" in name:
            assert name in names, name
            initial = 1.0 if name.endswith("LayerNorm.weight") else 0.0
            assert (param != initial).all(), name


def test_config_it_cannot_represent_names_the_key(tmp_path):
    torch.manual_seed(0)
    config = transformers.DebertaV2Config(**dict(V3, conv_kernel_size=3))
    transformers.DebertaV2ForMaskedLM(config).save_pretrained(tmp_path)
    with pytest.raises(hf.CheckpointError, match="conv_kernel_size"):
        hf.load(tmp_path)


def test_wrong_shape_names_the_key(tmp_path):
    from safetensors.numpy import load_file, save_file
    torch.manual_seed(0)
    transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**V3)).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    key = "deberta.encoder.layer.1.intermediate.dense.weight"
    tensors[key] = tensors[key][:, :-1].copy()
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hf.CheckpointError, match=key.replace(".", r"\.")):
        hf.load(tmp_path)


def test_missing_and_unknown_tensors_fail(tmp_path):
    from safetensors.numpy import load_file, save_file
    torch.manual_seed(0)
    transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**V3)).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["deberta.encoder.rel_embeddings.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hf.CheckpointError, match="rel_embeddings"):
        hf.load(tmp_path)
    tensors["deberta.encoder.rel_embeddings.weight"] = np.zeros((512, 32), np.float32)
    tensors["deberta.encoder.layer.5.output.dense.weight"] = np.zeros((32, 64), np.float32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(hf.CheckpointError, match=r"layer\.5\.output"):
        hf.load(tmp_path)
