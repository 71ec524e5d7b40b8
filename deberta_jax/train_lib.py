"""The training state and the pure functions `train.py` jits: init, train step, eval step.

All state lives in one pytree, `TrainState(step, params, opt_state)`, with `params` a plain nested
dict (`nnx.to_pure_dict`) that `nnx.merge(graphdef, params)` turns back into a `MaskedLM` inside the
traced functions. Everything random is derived from (seed, step): the dropout key here, the data
order and the masks on the host (`input_pipeline`). A checkpoint therefore needs only the step,
the parameters and the optimizer state for a resumed run to continue bit for bit.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from deberta_jax.config import ModelConfig
from deberta_jax.model import MaskedLM

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


def masked_lm_sums(logits: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Sums over the masked positions: cross-entropy, correct predictions, and their count.

    Sums, not means, so micro-batches, devices and evaluation batches combine exactly: the loss is
    `loss_sum / count` once everything is added up.
    """
    weights = batch["weights"]
    cross_entropy = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    correct = (jnp.argmax(logits, axis=-1) == batch["labels"]).astype(jnp.float32)
    return dict(loss_sum=jnp.sum(cross_entropy * weights), correct_sum=jnp.sum(correct * weights),
                count=jnp.sum(weights))


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation,
                    schedule: optax.Schedule, *, seed: int, grad_accum_steps: int):
    """`train_step(state, batch) -> (state, metrics)`: one optimizer update on one global batch.

    With `grad_accum_steps = k` the batch is processed as k micro-batches in a `lax.scan` that adds
    up gradients of the *summed* loss; dividing once by the total number of masked tokens gives
    exactly the gradient of the whole batch's mean loss (dropout aside), with one update per step.
    Micro-batch j takes rows j, j+k, j+2k, ... so each device's rows stay on that device.
    Dropout for micro-batch j uses `fold_in(fold_in(key(seed), step), j)`.
    """
    def summed_loss(params, micro_batch, key):
        model = nnx.merge(graphdef, params)
        logits = model(micro_batch["input_ids"], micro_batch["attention_mask"], rngs=nnx.Rngs(dropout=key))
        sums = masked_lm_sums(logits, micro_batch)
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
        zero_sums = dict(loss_sum=jnp.zeros(()), correct_sum=jnp.zeros(()), count=jnp.zeros(()))
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
        )
        return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics

    return train_step


def make_eval_step(graphdef: nnx.GraphDef):
    """`eval_step(params, batch) -> sums`: deterministic (no dropout) masked-LM sums of one batch."""
    def eval_step(params: Params, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        logits = nnx.merge(graphdef, params)(batch["input_ids"], batch["attention_mask"])
        return masked_lm_sums(logits, batch)
    return eval_step
