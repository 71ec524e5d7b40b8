"""The optimizer: AdamW with warmup and decay, gradient clipping, and a path-based weight-decay mask."""

from __future__ import annotations

import jax
import optax

SCHEDULES = ("linear", "cosine")

# Weight decay applies to the kernels of dense layers only. Not decayed:
#   - biases and LayerNorm scales/offsets (as in BERT and DeBERTa);
#   - embedding tables (word, absolute and relative position, token type). Decoupled decay shrinks
#     every row at every step while a rare token's row is updated only when it occurs, and rows
#     that training never reaches (absolute positions past seq_len, which length-extrapolation
#     evaluation reads) would drift toward zero; undecayed, they stay exactly as initialized.
DECAYED_LEAF_NAMES = ("kernel",)


def learning_rate_schedule(peak: float, warmup_steps: int, num_steps: int, schedule: str) -> optax.Schedule:
    """Linear warmup from 0 to `peak` over `warmup_steps`, then `schedule` decay to 0 at `num_steps`.

    A run shorter than its warmup simply ends while the rate is still rising.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; choose one of {SCHEDULES}")
    decay_steps = max(num_steps - warmup_steps, 1)
    if schedule == "linear":
        decay = optax.linear_schedule(peak, 0.0, decay_steps)
    else:
        decay = optax.cosine_decay_schedule(peak, decay_steps)
    if warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, peak, warmup_steps)
    return optax.join_schedules([warmup, decay], boundaries=[warmup_steps])


def weight_decay_mask(params):
    """True for the leaves that get weight decay, decided from each leaf's path in the parameter tree."""
    def decayed(path, _):
        return getattr(path[-1], "key", None) in DECAYED_LEAF_NAMES
    return jax.tree_util.tree_map_with_path(decayed, params)


def make_optimizer(train_config, schedule: optax.Schedule) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with decoupled weight decay on the masked leaves."""
    return optax.chain(
        optax.clip_by_global_norm(train_config.grad_clip_norm),
        optax.adamw(
            learning_rate=schedule,
            b1=train_config.b1,
            b2=train_config.b2,
            eps=train_config.eps,
            weight_decay=train_config.weight_decay,
            mask=weight_decay_mask,
        ),
    )
