"""Attention kernels: how a variant's scores become context vectors, all at once or block by block.

A kernel knows nothing about positions. It receives a *score function*
`score_fn(shared, keys, key_positions) -> [B, H, Nq, nk]` (see `attention.attention_scores`) and the
tensors it reads:
  - `shared`: a pytree the kernel never slices (queries, DeBERTa's content-to-position products
    `[B, H, Nq, R]`, a per-distance bias), read whole for every block of keys;
  - `keys`: a pytree whose leaves have the key axis third, `[B, H, Nk, ...]` (keys, DeBERTa's
    position-to-content products `[B, H, Nk, R]`), cut into blocks along that axis;
  - `key_positions` `[nk]`: which keys a call scores, so Toeplitz terms (relative index, ALiBi, T5
    biases, stored per distance) are looked up for exactly those keys.

`dense_attention` scores every key at once: `[B, H, Nq, Nk]` scores and probabilities, memory
quadratic in length. `blockwise_attention` (FlashAttention's algorithm, Dao et al. 2022) scans over
blocks of `block_size` keys with an online softmax and a custom backward pass that recomputes each
block's scores from the saved log-sum-exp, so neither pass keeps more than `[B, H, Nq, block_size]`
of scores: memory linear in length, the same result to float rounding. Both mask keys only (outputs
at real tokens do not depend on padding) and compute the softmax in float32.

`pallas_attention.pallas_attention` (config "pallas") is the blockwise kernel with its forward pass
fused into one Pallas/Triton GPU kernel (the `forward` hook of `blockwise_attention`); it is the one
kernel that reads the variant (`attention.ScoreFunction`) instead of calling the score function.

Attention-probability dropout works in the dense and blockwise kernels (`deberta_jax.dropout`
masks). The dense kernel draws one mask of the probabilities' shape; the blockwise one draws block
`b`'s mask from `fold_in(key, b)` (`dropout_keep`) and draws it again in the backward pass, so the
two kernels drop different (equally distributed) entries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from deberta_jax.kernels import dropout
from deberta_jax.model.config import ATTENTION_KERNELS

NEG_INF = float(np.finfo(np.float32).min)

ScoreFn = Callable[[Any, Any, Any], jax.Array]
# A fused forward pass: (score_fn, n_k, shared, key_blocks, value_blocks, mask_blocks) -> (out, lse).
Forward = Callable[..., tuple[jax.Array, jax.Array]]


def dropout_keep(key: jax.Array, block: jax.Array | int, shape: tuple[int, ...], rate: float) -> jax.Array:
    """The keep mask of attention dropout for key block `block` of the blockwise kernel."""
    return dropout.keep_mask(jax.random.fold_in(key, block), shape, rate)


def dense_attention(score_fn: ScoreFn, shared, keys, v: jax.Array, key_mask: jax.Array, *,
                    dropout_rate: float = 0.0, dropout_key: jax.Array | None = None) -> jax.Array:
    """Softmax over all `Nk` keys at once; `v` `[B, H, Nk, d]`, `key_mask` `[B, Nk]` (1 = real token).

    The fastest kernel while `[B, H, Nq, Nk]` float32 scores fit in memory. Dropout (when
    `dropout_key` is given) draws one mask of the probabilities' shape.
    """
    n_k = v.shape[-2]
    scores = score_fn(shared, keys, np.arange(n_k)).astype(jnp.float32)
    scores = jnp.where(key_mask[:, None, None, :].astype(bool), scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    if dropout_key is not None and dropout_rate > 0:
        probs = dropout.apply(probs, dropout.keep_mask(dropout_key, probs.shape, dropout_rate), dropout_rate)
    return jnp.einsum("bhij,bhjd->bhid", probs.astype(v.dtype), v)


def blockwise_attention(score_fn: ScoreFn, shared, keys, v: jax.Array, key_mask: jax.Array, *, block_size: int,
                        dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
                        forward: Forward | None = None) -> jax.Array:
    """The result of `dense_attention` (up to float rounding and dropout bits) in memory linear in `Nk`.

    Keys are padded to a multiple of `block_size` (padding keys score `-inf`, so they weigh nothing
    even in a row whose real keys are all masked, where both kernels average every key uniformly).
    `forward` replaces the `lax.scan` forward pass (without dropout) by a fused one that returns the
    same `(out, lse)` (`pallas_attention.fused_forward`); the backward pass is this kernel's either way.
    """
    n_k = v.shape[-2]
    size = min(block_size, n_k)
    num_blocks = -(-n_k // size)
    pad = num_blocks * size - n_k

    def blocks(x):  # [B, H, Nk, ...] -> [num_blocks, B, H, size, ...]
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(*x.shape[:2], num_blocks, size, *x.shape[3:]), 2, 0)

    mask_blocks = jnp.pad(key_mask, [(0, 0), (0, pad)]).reshape(-1, num_blocks, size).swapaxes(0, 1)
    rate = float(dropout_rate) if dropout_key is not None else 0.0
    return _online_softmax(score_fn, n_k, rate, forward, shared, jax.tree.map(blocks, keys), blocks(v),
                           mask_blocks, dropout_key)


def _block_scores(score_fn: ScoreFn, n_k: int, shared, key_block, mask_block, block) -> jax.Array:
    """Float32 scores of key block `block`: masked keys at NEG_INF (as in the dense kernel), padding
    keys past `n_k` at -inf. Differentiating through the masks zeroes the gradient of both."""
    size = mask_block.shape[-1]
    positions = block * size + jnp.arange(size)
    scores = score_fn(shared, key_block, jnp.minimum(positions, n_k - 1)).astype(jnp.float32)
    scores = jnp.where(mask_block[:, None, None, :].astype(bool), scores, NEG_INF)
    return jnp.where(positions < n_k, scores, -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _online_softmax(score_fn, n_k, rate, forward, shared, key_blocks, value_blocks, mask_blocks, dropout_key):
    return _online_softmax_fwd(score_fn, n_k, rate, forward, shared, key_blocks, value_blocks, mask_blocks,
                               dropout_key)[0]


def _online_softmax_fwd(score_fn, n_k, rate, forward, shared, key_blocks, value_blocks, mask_blocks, dropout_key):
    """The output, with what the backward pass needs: the inputs, the output and each row's log-sum-exp."""
    if forward is None:
        out, lse = _scan_forward(score_fn, n_k, rate, shared, key_blocks, value_blocks, mask_blocks, dropout_key)
    else:
        out, lse = forward(score_fn, n_k, shared, key_blocks, value_blocks, mask_blocks)
    return out, (shared, key_blocks, value_blocks, mask_blocks, dropout_key, out, lse)


def _scan_forward(score_fn, n_k, rate, shared, key_blocks, value_blocks, mask_blocks, dropout_key):
    """Scan over key blocks keeping the running row maximum `m`, normalizer `l` and weighted sum."""
    num_blocks, _, _, size, d = value_blocks.shape
    first_block = jax.tree.map(lambda x: x[0], key_blocks)
    b, h, n_q, _ = jax.eval_shape(score_fn, shared, first_block, jnp.arange(size)).shape

    def body(carry, xs):
        m, l, acc = carry
        block, key_block, value_block, mask_block = xs
        scores = _block_scores(score_fn, n_k, shared, key_block, mask_block, block)
        m_new = jnp.maximum(m, scores.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[..., None])
        l = l * correction + p.sum(axis=-1)
        keep = dropout_keep(dropout_key, block, p.shape, rate) if rate else None
        acc = acc * correction[..., None] + jnp.einsum(
            "bhij,bhjd->bhid", dropout.apply(p, keep, rate).astype(value_block.dtype), value_block,
            preferred_element_type=jnp.float32)
        return (m_new, l, acc), None

    init = (jnp.full((b, h, n_q), -jnp.inf), jnp.zeros((b, h, n_q)), jnp.zeros((b, h, n_q, d)))
    (m, l, acc), _ = jax.lax.scan(body, init, (jnp.arange(num_blocks), key_blocks, value_blocks, mask_blocks))
    return (acc / l[..., None]).astype(value_blocks.dtype), m + jnp.log(l)


def _online_softmax_bwd(score_fn, n_k, rate, forward, residuals, d_out):
    """FlashAttention's backward pass: per block, recompute the probabilities `exp(s - lse)` and pull
    the score gradient `p * (dp - rowsum(d_out * out))` back through the score function's own VJP."""
    shared, key_blocks, value_blocks, mask_blocks, dropout_key, out, lse = residuals
    d_out32 = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out32 * out.astype(jnp.float32), axis=-1)

    def body(d_shared, xs):
        block, key_block, value_block, mask_block = xs
        scores, pull = jax.vjp(
            lambda sh, kb: _block_scores(score_fn, n_k, sh, kb, mask_block, block), shared, key_block)
        p = jnp.exp(scores - lse[..., None])
        keep = dropout_keep(dropout_key, block, p.shape, rate) if rate else None
        d_value = jnp.einsum("bhij,bhid->bhjd", dropout.apply(p, keep, rate).astype(value_block.dtype),
                             d_out.astype(value_block.dtype), preferred_element_type=jnp.float32)
        dp = dropout.apply(jnp.einsum("bhid,bhjd->bhij", d_out32, value_block.astype(jnp.float32)), keep, rate)
        d_sh, d_key = pull(p * (dp - delta[..., None]))
        d_shared = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), d_shared, d_sh)
        return d_shared, (d_key, d_value.astype(value_block.dtype))

    # The gradients of `shared` (queries, c2p) add up over every block: accumulate them in float32.
    d_shared, (d_keys, d_values) = jax.lax.scan(
        body, jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shared),
        (jnp.arange(value_blocks.shape[0]), key_blocks, value_blocks, mask_blocks))
    d_shared = jax.tree.map(lambda g, x: g.astype(x.dtype), d_shared, shared)
    return d_shared, d_keys, d_values, None, None


_online_softmax.defvjp(_online_softmax_fwd, _online_softmax_bwd)


def attention_kernel(name: str, block_size: int) -> Callable[..., jax.Array]:
    """The kernel a config names (`ModelConfig.attention_kernel`), with the same call signature."""
    if name == "dense":
        return dense_attention
    if name == "blockwise":
        return functools.partial(blockwise_attention, block_size=block_size)
    if name == "pallas":
        # Imported on demand: only this kernel needs Pallas and its Triton lowering.
        from deberta_jax.kernels.pallas import pallas_attention
        return functools.partial(pallas_attention, block_size=block_size)
    raise ValueError(f"unknown attention kernel {name!r}; choose one of {ATTENTION_KERNELS}")
