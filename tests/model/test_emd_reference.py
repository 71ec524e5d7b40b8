"""DeBERTa's enhanced mask decoder (EMD) against an independent numpy re-implementation of the official code.

EMD exists only in microsoft/DeBERTa (`DeBERTa/apps/models/masked_language_model.py`,
`EnhancedMaskDecoder`), not in transformers, so `tests/model/test_hf_reference.py` cannot check it. The
reference below re-implements the official forward pass in plain float64 numpy from that code's
semantics, reading nothing from deberta_jax but the parameters of the model it compares with:

- embeddings (`bert.py`, `BertEmbeddings`): word (+ token type) embeddings, LayerNorm, times the input
  mask; absolute positions are *not* added to the input (`position_biased_input=False`) but returned as
  `z`, the rows of the position table for positions `0..N-1`;
- post-LN layers (`BertLayer`): attention, dense, residual *of the query states*, LayerNorm; then
  intermediate dense, erf-GELU, output dense, residual, LayerNorm;
- disentangled attention (`disentangled_attention.py`): `(q.k + q.Kr[idx] + Qr[idx].k) / sqrt(d * s)`
  with `s = 1 + number of position terms`; `Kr`, `Qr` are the (LayerNorm'd) relative table projected
  by the key/query projections (`share_att_key`) or by `pos_key_proj`/`pos_query_proj`, biases
  included; `idx = clip(bucket(i - j) + k, 0, 2k - 1)` indexes both terms (p2c gathers rows of
  `Qr @ k^T`); the softmax mask is `mask_i * mask_j`, fully masked rows give zero probabilities;
- relative positions (`da_utils.py`): with buckets, `i - j` is first clamped to
  `+-(max_relative_positions - 1)`, then log-bucketed in float32 as torch does; without buckets it is
  neither clamped nor bucketed (only the final clip applies);
- EMD (`EnhancedMaskDecoder.emd_context_layer`): keys/values are `H[-2]`, the hidden states entering
  the last layer; the query starts as `z + H[-2]` and the *last* layer's weights are applied
  repeatedly, each output becoming the next query (the official code hard-codes 2 applications, our
  `emd_layers` generalizes it); the MLM head (`BertLMPredictionHead`: dense, GELU, LayerNorm, tied
  word embeddings plus bias) reads the final query.

The model's parameters are all replaced by seeded random values (biases, LayerNorm scales and offsets
included) through nnx state, so a swapped or missing term shows. Logits are compared at real tokens of
a padded batch whose length exceeds `max_relative_positions` (clamped distances and log buckets).
"""

import math

import numpy as np
import pytest
from flax import nnx

from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM
from tests.helpers import model_params, set_model_params

TOL = 1e-5  # observed max |diff| up to 3.2e-6 at logits of std ~1.5 (float32 model vs float64 reference)
BASE = dict(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64, max_position_embeddings=64,
            attention="disentangled", position_biased_input=False, use_emd=True, hidden_dropout=0.0,
            attention_dropout=0.0, position_buckets=8, max_relative_positions=16, pos_att_type=("c2p", "p2c"),
            norm_rel_ebd="layer_norm", layer_norm_eps=1e-7)
# > max_relative_positions: clamped distances and the log-bucket region are both reached. One length for
# every case: eager calls then share compiled operations, faster here than one jit per configuration.
LENGTH = 40

# --------------------------------------------------------------------------- the reference (numpy, float64)
def _layer_norm(x, scale, bias, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * scale + bias


_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _official_log_bucket(rel, bucket_size, max_position):
    """`make_log_bucket_dict` of da_utils.py, evaluated in float32 like torch's default dtype."""
    mid = bucket_size // 2
    sign = np.sign(rel)
    abs_pos = np.where((rel < mid) & (rel > -mid), mid - 1, np.abs(rel))

    def buckets(dtype):
        log_pos = np.ceil(np.log(abs_pos.astype(dtype) / dtype(mid)) / dtype(math.log((max_position - 1) / mid))
                          * dtype(mid - 1)) + dtype(mid)
        return np.where(abs_pos <= mid, rel, (log_pos * sign).astype(np.int64))

    out = buckets(np.float32)
    # The reference must not hinge on float32 rounding at a ceil boundary: pick sizes where it does not.
    assert np.array_equal(out, buckets(np.float64)), "bucket boundary ambiguous in float32; change the sizes"
    return out


def official_relative_index(n, position_buckets, max_relative_positions):
    """Row of the relative table for each (query i, key j): `build_relative_position` plus the clip in
    `disentangled_attention_bias` (shared by c2p and p2c)."""
    rel = np.arange(n)[:, None] - np.arange(n)[None, :]
    if position_buckets > 0:
        rel = np.clip(rel, -max_relative_positions + 1, max_relative_positions - 1)
        rel = _official_log_bucket(rel, position_buckets, max_relative_positions)
        span = position_buckets
    else:
        span = max_relative_positions
    return np.clip(rel + span, 0, 2 * span - 1)


class OfficialDeberta:
    """The official MLM forward pass (with EMD) over a dict of float64 parameters."""

    def __init__(self, cfg: ModelConfig, params: dict):
        self.cfg = cfg
        self.p = {k: np.asarray(v, np.float64) for k, v in params.items()}

    def linear(self, x, name):
        return x @ self.p[name + ".kernel"] + self.p[name + ".bias"]

    def norm(self, x, name):
        return _layer_norm(x, self.p[name + ".scale"], self.p[name + ".bias"], self.cfg.layer_norm_eps)

    def heads(self, x):  # [..., N, H*d] -> [..., H, N, d]
        *lead, n, _ = x.shape
        return np.swapaxes(x.reshape(*lead, n, self.cfg.num_heads, self.cfg.head_dim), -2, -3)

    def attention(self, prefix, kv, query, mask2d, rel, index):
        cfg = self.cfg
        q = self.heads(self.linear(query, prefix + "query_proj"))
        k = self.heads(self.linear(kv, prefix + "key_proj"))
        v = self.heads(self.linear(kv, prefix + "value_proj"))
        terms = [t for t in ("c2p", "p2c") if t in cfg.pos_att_type]
        scale = 1.0 / math.sqrt(cfg.head_dim * (1 + len(terms)))
        scores = q @ np.swapaxes(k, -1, -2) * scale
        if "c2p" in terms:
            pos_k = self.heads(self.linear(rel, prefix + ("key_proj" if cfg.share_att_key else "pos_key_proj")))
            c2p = q @ np.swapaxes(pos_k, -1, -2) * scale                      # [B, H, N, 2k]
            scores = scores + np.take_along_axis(c2p, np.broadcast_to(index, c2p.shape[:2] + index.shape), -1)
        if "p2c" in terms:
            pos_q = self.heads(self.linear(rel, prefix + ("query_proj" if cfg.share_att_key else "pos_query_proj")))
            p2c = (pos_q * scale) @ np.swapaxes(k, -1, -2)                    # [B, H, 2k, N]
            scores = scores + np.take_along_axis(p2c, np.broadcast_to(index, p2c.shape[:2] + index.shape), -2)
        allowed = np.broadcast_to(mask2d[:, None], scores.shape)
        top = np.where(allowed, scores, -np.inf).max(-1, keepdims=True)
        e = np.exp(np.where(allowed, scores - np.where(np.isfinite(top), top, 0.0), -np.inf))
        total = e.sum(-1, keepdims=True)
        probs = np.where(total > 0, e / np.where(total > 0, total, 1.0), 0.0)  # XSoftmax: masked rows -> 0
        context = probs @ v
        b, h, n, d = context.shape
        return np.swapaxes(context, 1, 2).reshape(b, n, h * d)

    def layer(self, i, kv, query, mask2d, rel, index):
        prefix = f"encoder.layers.{i}."
        context = self.attention(prefix + "attention.", kv, query, mask2d, rel, index)
        att = self.norm(self.linear(context, prefix + "attention_out") + query, prefix + "attention_norm")
        mlp = self.linear(_gelu(self.linear(att, prefix + "intermediate")), prefix + "output")
        return self.norm(mlp + att, prefix + "output_norm")

    def logits(self, ids, mask, token_type_ids=None):
        cfg, p = self.cfg, self.p
        n = ids.shape[1]
        x = p["embeddings.word_embeddings"][ids]
        if cfg.type_vocab_size:
            types = np.zeros_like(ids) if token_type_ids is None else token_type_ids
            x = x + p["embeddings.token_type_embeddings"][types]
        if cfg.position_biased_input:
            x = x + p["embeddings.position_embeddings"][:n]
        hidden = self.norm(x, "embeddings.norm") * mask[..., None]
        rel = p["encoder.rel_embeddings"]
        if cfg.norm_rel_ebd == "layer_norm":
            rel = self.norm(rel, "encoder.rel_norm")
        index = official_relative_index(n, cfg.position_buckets, cfg.max_relative_positions)
        mask2d = (mask[:, :, None] * mask[:, None, :]).astype(bool)
        layers = [hidden]  # layers[i + 1]: output of layer i
        for i in range(cfg.num_layers):
            layers.append(self.layer(i, layers[-1], layers[-1], mask2d, rel, index))
        out = layers[-1]
        if cfg.use_emd:
            kv = layers[-2]
            query = p["embeddings.position_embeddings"][:n][None] + kv
            for _ in range(cfg.emd_layers):
                query = self.layer(cfg.num_layers - 1, kv, query, mask2d, rel, index)
            out = query
        x = self.norm(_gelu(self.linear(out, "head_dense")), "head_norm")
        return x @ p["embeddings.word_embeddings"].T + p["head_bias"]


# --------------------------------------------------------------------------- the comparison
def randomize_params(model, seed=0):
    """Replace every parameter with seeded random values through nnx state: LayerNorm scales
    `1 + N(0, 0.3)`, biases `N(0, 0.3)`, kernels `N(0, 0.2)` (attention far from uniform), tables `N(0, 0.25)`."""
    rng = np.random.default_rng(seed)
    new = {}
    for key, value in model_params(model).items():
        noise = rng.standard_normal(value.shape)
        if key.endswith(".scale"):
            new[key] = 1.0 + 0.3 * noise
        elif key.endswith("bias"):
            new[key] = 0.3 * noise
        elif key.endswith(".kernel"):
            new[key] = 0.2 * noise
        else:
            new[key] = 0.25 * noise
    set_model_params(model, new)
    return model


def padded_batch(vocab, n, seed=0):
    """Three rows: full length, three pads, half padding."""
    ids = np.random.default_rng(seed).integers(0, vocab, size=(3, n)).astype(np.int32)
    mask = np.ones((3, n), np.int32)
    mask[1, n - 3:] = 0
    mask[2, n // 2:] = 0
    return ids, mask


def max_error(cfg: ModelConfig, n=LENGTH):
    model = randomize_params(MaskedLM(cfg, rngs=nnx.Rngs(0)))
    ids, mask = padded_batch(cfg.vocab_size, n)
    ours = np.asarray(model.mlm_logits(ids, mask))
    ref = OfficialDeberta(cfg, model_params(model)).logits(ids, mask)
    assert ours.shape == ref.shape and np.isfinite(ours).all()
    real = mask.astype(bool)
    assert np.abs(ref[real]).max() > 1.0  # logits large enough for 1e-5 to be a strict tolerance
    return float(np.abs(ours - ref)[real].max())


@pytest.mark.parametrize("relative_terms", ["gather", "shift"])
@pytest.mark.parametrize("share_att_key", [True, False])
@pytest.mark.parametrize("emd_layers", [1, 2])
def test_emd_matches_official(emd_layers, share_att_key, relative_terms):
    cfg = ModelConfig(**dict(BASE, emd_layers=emd_layers, share_att_key=share_att_key, relative_terms=relative_terms))
    err = max_error(cfg)
    assert err <= TOL, f"max |diff| {err:.2e} at real tokens"


def test_emd_with_the_fused_tpu_kernel_matches_official():
    """The fused TPU kernel (interpreted) under EMD's re-applied layer, with separate position projections."""
    cfg = ModelConfig(**dict(BASE, emd_layers=2, share_att_key=False, attention_kernel="pallas_tpu"))
    err = max_error(cfg)
    assert err <= TOL, f"max |diff| {err:.2e} at real tokens"


def test_encoder_without_emd_matches_official():
    """The same reference without EMD: a failure in the EMD cases alone then points at EMD itself."""
    err = max_error(ModelConfig(**dict(BASE, use_emd=False)))
    assert err <= TOL, f"max |diff| {err:.2e} at real tokens"


def test_emd_single_position_term_and_plain_relative_table():
    """c2p only, no LayerNorm on the relative table, token types present (type 0, as the official MLM)."""
    cfg = ModelConfig(**dict(BASE, pos_att_type=("c2p",), norm_rel_ebd="none", type_vocab_size=2))
    err = max_error(cfg)
    assert err <= TOL, f"max |diff| {err:.2e} at real tokens"


def test_no_buckets_unclamped_matches_official():
    """Without buckets the official code neither clamps nor buckets `i - j`: transformers' behaviour,
    `clamp_relative_positions=False`."""
    cfg = ModelConfig(**dict(BASE, position_buckets=0, max_relative_positions=8, clamp_relative_positions=False))
    err = max_error(cfg)
    assert err <= TOL, f"max |diff| {err:.2e} at real tokens"


def test_no_buckets_default_clamp_is_the_projects_own_option():
    """Without buckets the clamp (our default) is this project's choice, not the official code's (documented in
    ModelConfig): keys at `j - i >= max_relative_positions` read a trained row instead of row 0, so the
    logits differ from the official ones there, and only there."""
    cfg = ModelConfig(**dict(BASE, position_buckets=0, max_relative_positions=8))
    assert cfg.clamp_relative_positions
    assert max_error(cfg) > 1e-2
    assert max_error(cfg, n=8) <= TOL  # no pair that far apart: the clamp changes nothing
