"""The FLOPs a model needs by its own arithmetic: what MFU divides by (`aot.analysis`) and what a training recipe
costs per token (`study.training_cost`). Matmuls only, counted from the config, so it needs no compiler."""

from __future__ import annotations

from deberta_jax.model import biases, positions
from deberta_jax.model.config import ModelConfig


def model_flops(cfg: ModelConfig, rows: int, seq_len: int, predicted: int, *, train: bool) -> float:
    """FLOPs the model needs for `rows` sequences of `seq_len` tokens with `predicted` positions through the MLM
    head: matmuls only (2 per multiply-add), the backward pass twice the forward (`train`), no recomputation.

    Per layer and sequence: the four projections and the MLP (`2N(4h^2 + 2hI)`), scores and context
    (`4NKh` for the K keys each query sees: N, or `attention_window` of them, the pairs a windowed kernel computes),
    and for DeBERTa each position term's product with the R reachable relative rows (`2NRh`) plus the projection
    of those rows (`2Rh^2`, once per call). EMD runs the last layer `emd_layers` times instead
    of once. The head: dense transform and tied decoder at the predicted positions (`2P(h^2 + hV)`). A bias scheme
    adds what its entry declares (`biases.BiasScheme.flops`, once per forward pass): nothing for an elementwise
    bias (ALiBi, T5, KERPLE).
    """
    h, n = cfg.hidden_size, seq_len
    layers = cfg.num_layers - 1 + cfg.emd_layers if cfg.use_emd else cfg.num_layers
    keys = min(cfg.attention_window, n) if cfg.attention_window else n
    per_layer = rows * (2 * n * (4 * h * h + 2 * h * cfg.intermediate_size) + 4 * n * keys * h)
    if cfg.attention == "disentangled" and cfg.pos_att_type:
        lo, hi = positions.relative_rows_used(n, n, position_buckets=cfg.position_buckets,
                                              max_relative_positions=cfg.max_relative_positions,
                                              clamp=cfg.clamp_relative_positions)
        terms = len(cfg.pos_att_type)
        per_layer += terms * (rows * 2 * n * (hi - lo) * h + 2 * (hi - lo) * h * h)
    forward = layers * per_layer + 2 * predicted * (h * h + h * cfg.vocab_size)
    if cfg.bias_scheme:
        forward += biases.SCHEMES[cfg.bias_scheme].flops(cfg, n)
    return 3 * forward if train else forward
