"""Logits of `hf.load` against transformers' PyTorch models on padded batches (float32, 1e-4)."""

import numpy as np
import pytest
import torch
import transformers

from deberta_jax.model import hf

TOL = 1e-4
SMALL = dict(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
V3 = dict(SMALL, max_position_embeddings=512, relative_attention=True, position_buckets=256, max_relative_positions=512,
          share_att_key=True, norm_rel_ebd="layer_norm", position_biased_input=False, pos_att_type=["p2c", "c2p"],
          type_vocab_size=0)

DEBERTA_CASES = {
    "v3": (V3, [9, 300]),
    "separate_pos_proj": (dict(V3, share_att_key=False), [9, 40]),
    "c2p_only": (dict(V3, pos_att_type=["c2p"]), [17]),
    "p2c_only": (dict(V3, pos_att_type=["p2c"], share_att_key=False), [17]),
    # Without buckets the table has 2 * max_relative_positions rows; length 40 > 16 overflows it.
    "no_buckets": (dict(V3, position_buckets=-1, max_relative_positions=16, norm_rel_ebd="none"), [12, 40]),
    # Small buckets reach the log region, and length 70 > max_relative_positions overflows it.
    "log_buckets": (dict(V3, position_buckets=16, max_relative_positions=32), [70]),
    "abs_input_token_types": (dict(V3, position_biased_input=True, type_vocab_size=2, max_position_embeddings=64), [20]),
    "new_head": (dict(V3, legacy=False), [11]),
}


def _padded_batch(rng, vocab, n):
    """Three rows: full length, three pads, half padding."""
    ids = rng.integers(0, vocab, size=(3, n)).astype(np.int64)
    mask = np.ones((3, n), np.int64)
    mask[1, n - 3:] = 0
    mask[2, n // 2:] = 0
    return ids, mask


def _compare(tmp_path, torch_model, lengths, **load_kw):
    torch_model.eval()
    torch_model.save_pretrained(tmp_path)
    model = hf.load(tmp_path, **load_kw)
    rng = np.random.default_rng(0)
    for n in lengths:
        ids, mask = _padded_batch(rng, torch_model.config.vocab_size, n)
        with torch.no_grad():
            ref = torch_model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
        out = np.asarray(model.mlm_logits(ids.astype(np.int32), mask.astype(np.int32)))
        assert out.shape == ref.shape
        assert not np.isnan(out).any()
        real = mask.astype(bool)
        err = np.abs(out - ref)[real].max()
        assert err <= TOL, f"length {n}: max |diff| {err:.2e} at real tokens"


@pytest.mark.parametrize("name", sorted(DEBERTA_CASES))
def test_deberta_v2_matches_transformers(tmp_path, name):
    config, lengths = DEBERTA_CASES[name]
    torch.manual_seed(0)
    _compare(tmp_path, transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**config)), lengths)


def test_bert_matches_transformers(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(**SMALL, max_position_embeddings=64, type_vocab_size=2)
    _compare(tmp_path, transformers.BertForMaskedLM(config), [5, 64])


def test_config_it_cannot_represent_names_the_key(tmp_path):
    torch.manual_seed(0)
    transformers.DebertaV2ForMaskedLM(transformers.DebertaV2Config(**dict(V3, conv_kernel_size=3))).save_pretrained(tmp_path)
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
