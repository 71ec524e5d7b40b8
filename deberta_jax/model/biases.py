"""Score biases per distance: the registry a distance-only position scheme joins, with one entry.

A bias scheme adds `b_h(i - j)` to every score of head h (`kernels.scores.combine_scores`: after the division by
`sqrt(d * ...)`, before a temperature). Its entry in `SCHEMES` says everything the rest of the project needs:
  - `bias(params, cfg, length, scale, key_mask)`: the bias per distance, `[H, 2N - 1]` in `kernels.scores.distances`
    order (expanded per block by `scores.toeplitz`, so memory stays linear in length), or `[B, H, 2N - 1]` with a
    row axis when `per_row` (a bias that depends on the row, e.g. its real length, read from `key_mask` `[B, N]`);
    `scale` multiplies every distance (`ModelConfig.distance_scale`, the interpolated-distances length method);
  - `parameters`: what it learns, each a `Parameter` (shape, initial value, whether it is weight-decayed), created
    on the encoder under these names and shared by every layer (as T5's table is in T5);
  - `buckets`: for a bias read from a table by bucket, the bucket per distance, which tells the fused GPU kernel
    past which distance every gradient goes to one bucket (None: every distance has its own value);
  - `per_row`: the dense and blockwise kernels take a bias with a row axis; the fused kernels take one bias per
    head and distance, and a config that pairs them is refused at start-up, naming the scheme;
  - `flops(cfg, length)`: the matmul FLOPs of building the bias once per forward pass, for a scheme that computes
    it with matmuls (an MLP over distances); `model.flops` adds them. Elementwise work is not counted there.
A registered name is an `attention` variant (the dot product plus this bias, as in its paper) and a `score_bias`
(added to another variant's scores: DeBERTa's, RoPE's). `ModelConfig` validates both against this registry, the
encoder builds the parameters and the bias from it, the optimizer reads each parameter's `weight_decay`, and the
kernels read only the bias.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deberta_jax.kernels.scores import distances
from deberta_jax.model import positions

# A `model.config.ModelConfig`, which validates names against `SCHEMES`: importing it here, even for types only, would
# make the two modules import each other.
ModelConfig = Any


@dataclasses.dataclass(frozen=True)
class Parameter:
    """A learned array of a bias scheme: `init(cfg, key)` returns its initial float32 value. `weight_decay` is
    declared, not inferred from a name: decay pulls toward zero, which for a rate or a bucket's bias is a prior
    the scheme must choose."""

    init: Callable[[ModelConfig, jax.Array], jax.Array]
    weight_decay: bool = False


@dataclasses.dataclass(frozen=True)
class BiasScheme:
    """One distance-only position scheme (see the module docstring for each field)."""

    bias: Callable[..., jax.Array]
    parameters: Mapping[str, Parameter] = dataclasses.field(default_factory=dict)
    buckets: Callable[[ModelConfig, int, float], np.ndarray] | None = None
    per_row: bool = False
    flops: Callable[[ModelConfig, int], float] = lambda cfg, length: 0.0


def absolute_distances(length: int, scale: float) -> np.ndarray:
    """`|i - j|` per distance (`scores.distances` order) times `scale`, float32: what a symmetric bias reads."""
    return np.abs(distances(length, length)).astype(np.float32) * np.float32(scale)


def _t5_buckets(cfg: ModelConfig, length: int, scale: float) -> np.ndarray:
    return positions.t5_distance_buckets(length, length, cfg.t5_num_buckets, cfg.t5_max_distance, scale)


def _t5_bias(params, cfg: ModelConfig, length: int, scale: float, key_mask) -> jax.Array:
    return positions.t5_bias(params["relative_attention_bias"], length, length, cfg.t5_max_distance, scale)


def _alibi_bias(params, cfg: ModelConfig, length: int, scale: float, key_mask) -> jax.Array:
    return positions.alibi_bias(length, length, cfg.num_heads, scale)


def _normal(cfg: ModelConfig, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The normal initialization every table of the model gets (`initializer_range`)."""
    return cfg.initializer_range * jax.random.normal(key, shape, jnp.float32)


def _softplus_inverse(x: np.ndarray) -> np.ndarray:
    return np.log(np.expm1(x)).astype(np.float32)


def _kerple_log_bias(params, cfg: ModelConfig, length: int, scale: float, key_mask) -> jax.Array:
    """KERPLE's logarithmic kernel (Chi et al. 2022), made symmetric for an encoder: `-r1_h * log(1 + r2_h |i - j|)`
    with `r1_h, r2_h > 0` (softplus of the parameters). The penalty keeps growing with distance, slower than ALiBi's
    line, so far keys are down-weighted at every length without a cut-off."""
    strength = jax.nn.softplus(params["kerple_strength"])[:, None]
    rate = jax.nn.softplus(params["kerple_rate"])[:, None]
    return -strength * jnp.log1p(rate * jnp.asarray(absolute_distances(length, scale)))


def _kerple_strength(cfg: ModelConfig, key) -> jax.Array:
    # Heads start from nearly position-blind (1/H) to strongly local (1): ALiBi's spread of ranges over heads.
    return jnp.asarray(_softplus_inverse(np.arange(1, cfg.num_heads + 1) / cfg.num_heads))


def _kerple_rate(cfg: ModelConfig, key) -> jax.Array:
    return jnp.asarray(_softplus_inverse(np.ones(cfg.num_heads)))


SCHEMES: dict[str, BiasScheme] = {
    "alibi": BiasScheme(_alibi_bias),
    "t5_bias": BiasScheme(
        _t5_bias, parameters={"relative_attention_bias": Parameter(
            lambda cfg, key: _normal(cfg, key, (cfg.t5_num_buckets, cfg.num_heads)))},
        buckets=_t5_buckets),
    "kerple_log": BiasScheme(
        _kerple_log_bias,
        parameters={"kerple_strength": Parameter(_kerple_strength), "kerple_rate": Parameter(_kerple_rate)}),
}


def parameters_of(cfg: ModelConfig) -> Mapping[str, Parameter]:
    """The parameters of `cfg`'s bias scheme (`ModelConfig.bias_scheme`), none without one."""
    return SCHEMES[cfg.bias_scheme].parameters if cfg.bias_scheme else {}
