"""The training state and the pure functions `train.py` jits: init, train step, eval step.

All state lives in one pytree, `TrainState(step, params, opt_state)`, with `params` a plain nested
dict (`nnx.to_pure_dict`) that `nnx.merge(graphdef, params)` turns back into a `MaskedLM` inside the
traced functions. Everything random is derived from (seed, step): the dropout key here, the data
order and the masks on the host (`deberta_jax.data.batches`). A checkpoint therefore needs only the step,
the parameters and the optimizer state for a resumed run to continue bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM

Params = dict[str, Any]


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: number of optimizer updates applied
    params: Params
    opt_state: optax.OptState


def model_graphdef(model_config: ModelConfig) -> nnx.GraphDef:
    """The static structure of the model, built without allocating parameters."""
    return nnx.graphdef(nnx.eval_shape(lambda: MaskedLM(model_config, rngs=nnx.Rngs(params=0))))


def init_params(model_config: ModelConfig, seed: int) -> Params:
    return nnx.to_pure_dict(nnx.state(MaskedLM(model_config, rngs=nnx.Rngs(params=seed))))


def make_init_fn(model_config: ModelConfig, optimizer: optax.GradientTransformation, seed: int):
    """A function of no arguments returning the initial state; jit it with `out_shardings` to
    create the parameters directly where they live."""
    def init() -> TrainState:
        params = init_params(model_config, seed)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params))
    return init


def prediction_budget(num_tokens: int, mask_prob: float) -> int:
    """How many positions of a batch of `num_tokens` the MLM head scores: a static bound on the masked count.

    Scoring only the masked positions (about 15%) instead of all of them skips most of the vocabulary
    projection, the largest matmul of a small model (benchmarks/README.md). Shapes
    must be static while the masked count is random, so the budget is its mean plus 8 standard
    deviations (the variance taken as twice the token-level one, for whole-word masking's multi-piece
    words). Batches over budget are counted in `dropped`, which stops the run rather than skewing it.
    """
    mean = num_tokens * mask_prob
    return min(num_tokens, math.ceil(mean + 8 * math.sqrt(2 * mean) + 8))


def step_prediction_budget(rows: int, seq_len: int, mask_prob: float, accum: int = 1, groups: int = 1) -> int:
    """The positions one step's MLM head scores in all, as the train step (`accum` micro-batches) or the eval step
    (`accum=1`) bounds them: `prediction_budget` of each device's share (`groups`) of each micro-batch."""
    return accum * groups * prediction_budget(rows // accum * seq_len // groups, mask_prob)


def masked_lm_sums(model: MaskedLM, batch: dict[str, jax.Array], budget: int, rngs: nnx.Rngs | None = None,
                   groups: int = 1) -> dict[str, jax.Array]:
    """Sums over the masked positions: cross-entropy, correct predictions, their count, and `dropped`.

    Sums, not means, so micro-batches, devices and evaluation batches combine exactly: the loss is
    `loss_sum / count` once everything is added up. The head runs on the `budget` highest-weight
    positions of each of `groups` equal groups of consecutive rows (every masked one, while each group is
    within budget). With one group per device of the batch axis, each device scores its own rows: one global
    group would make the compiler gather every masked position to every device and score them all there.
    """
    hidden = model.encode(batch["input_ids"], batch["attention_mask"], rngs=rngs)
    weights = jnp.asarray(batch["weights"]).reshape(groups, -1)
    _, positions = jax.lax.top_k(weights, budget)
    logits = model.head_at(hidden, positions)
    labels = jnp.take_along_axis(jnp.asarray(batch["labels"]).reshape(groups, -1), positions, axis=1)
    kept = jnp.take_along_axis(weights, positions, axis=1)
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    correct = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
    return dict(loss_sum=jnp.sum(cross_entropy * kept), correct_sum=jnp.sum(correct * kept), count=jnp.sum(kept),
                dropped=jnp.sum(weights > 0) - jnp.sum(kept > 0))


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, *, seed: int, grad_accum_steps: int, mask_prob: float,
                    head_groups: int = 1):
    """`train_step(state, batch) -> (state, metrics)`: one optimizer update on one global batch.

    With `grad_accum_steps = k` the batch is processed as k micro-batches in a `lax.scan` that adds
    up gradients of the *summed* loss; dividing once by the total number of masked tokens gives
    exactly the gradient of the whole batch's mean loss (dropout aside), with one update per step.
    Micro-batch j takes rows j, j+k, j+2k, ... so each device's rows stay on that device.
    Dropout for micro-batch j uses `fold_in(fold_in(key(seed), step), j)`. `head_groups` is the number of
    devices the batch is split over (`masked_lm_sums`).
    """
    def summed_loss(params, micro_batch, key):
        budget = prediction_budget(micro_batch["input_ids"].size // head_groups, mask_prob)
        sums = masked_lm_sums(nnx.merge(graphdef, params), micro_batch, budget, rngs=nnx.Rngs(dropout=key),
                              groups=head_groups)
        return sums["loss_sum"], sums

    grad_fn = jax.grad(summed_loss, has_aux=True)

    def train_step(state: TrainState, batch: dict[str, jax.Array]) -> tuple[TrainState, dict[str, jax.Array]]:
        step_key = jax.random.fold_in(jax.random.key(seed), state.step)
        micro_batches = jax.tree.map(
            lambda x: x.reshape(x.shape[0] // grad_accum_steps, grad_accum_steps, *x.shape[1:]).swapaxes(0, 1),
            batch)

        def accumulate(carry, indexed):
            index, micro_batch = indexed
            grads, sums = grad_fn(state.params, micro_batch, jax.random.fold_in(step_key, index))
            return jax.tree.map(jnp.add, carry, (grads, sums)), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        zero_sums = dict(loss_sum=jnp.zeros(()), correct_sum=jnp.zeros(()), count=jnp.zeros(()),
                         dropped=jnp.zeros((), jnp.int32))
        (grad_sum, sums), _ = jax.lax.scan(
            accumulate, (zeros, zero_sums), (jnp.arange(grad_accum_steps), micro_batches))
        count = jnp.maximum(sums["count"], 1.0)
        grads = jax.tree.map(lambda g: g / count, grad_sum)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics = dict(
            loss=sums["loss_sum"] / count,
            accuracy=sums["correct_sum"] / count,
            grad_norm=optax.tree.norm(grads),
            param_norm=optax.tree.norm(params),
            learning_rate=schedule(state.step),
            masked_tokens=sums["count"],
            dropped=sums["dropped"],
        )
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef, *, mask_prob: float, head_groups: int = 1):
    """`eval_step(params, batch) -> sums`: deterministic (no dropout) masked-LM sums of one batch, its rows
    in `head_groups` groups (`masked_lm_sums`)."""
    def eval_step(params: Params, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        budget = prediction_budget(batch["input_ids"].size // head_groups, mask_prob)
        return masked_lm_sums(nnx.merge(graphdef, params), batch, budget, groups=head_groups)
    return eval_step
