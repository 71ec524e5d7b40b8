"""The optimizer: AdamW with warmup and decay, gradient clipping, and weight decay where each parameter declares it.

Every parameter says whether it is decayed (`weight_decay` metadata on its `nnx.Param`, set where it is built:
`model.parameters`, a bias scheme's `biases.Parameter`). As published, only the kernels of dense layers are. Not
decayed: biases and LayerNorm scales/offsets (as in BERT and DeBERTa); embedding tables (word, absolute and
relative position, token type), since decoupled decay shrinks every row at every step while a rare token's row is
updated only when it occurs, and rows that training never reaches (absolute positions past seq_len, which
length-extrapolation evaluation reads) would drift toward zero; temperatures and a bias scheme's rates, which decay
would pull toward a value nobody chose. A parameter that declares nothing is refused by name rather than guessed.
"""

from __future__ import annotations

import optax
from flax import nnx

from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM

SCHEDULES = ("linear", "cosine")


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


def weight_decay_mask(model_config: ModelConfig) -> dict:
    """The parameter tree of `model_config`'s model (`nnx.to_pure_dict` layout, as the train state keeps it) with
    True where a parameter declares `weight_decay=True` (`declared_decay`)."""
    return declared_decay(nnx.state(nnx.eval_shape(lambda: MaskedLM(model_config, rngs=nnx.Rngs(params=0)))))


def declared_decay(state: nnx.State) -> dict:
    """Each variable's declared `weight_decay` as a pure dict; raises naming every variable that declares none."""
    undeclared = [".".join(map(str, path)) for path, variable in nnx.to_flat_state(state)
                  if not isinstance(variable.get_metadata().get("weight_decay"), bool)]
    if undeclared:
        raise ValueError(f"parameter(s) {undeclared} declare no weight decay: build each with "
                         "nnx.Param(..., weight_decay=True or False) (nnx.Linear: kernel_metadata / bias_metadata)")
    return nnx.to_pure_dict(nnx.map_state(lambda _, variable: variable.get_metadata()["weight_decay"], state))


def make_optimizer(train_config, schedule: optax.Schedule, model_config: ModelConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW with decoupled weight decay on the parameters that declare it."""
    return optax.chain(
        optax.clip_by_global_norm(train_config.grad_clip_norm),
        optax.adamw(
            learning_rate=schedule,
            b1=train_config.b1,
            b2=train_config.b2,
            eps=train_config.eps,
            weight_decay=train_config.weight_decay,
            mask=weight_decay_mask(model_config),
        ),
    )
