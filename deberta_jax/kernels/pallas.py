"""A fused Pallas (Triton) forward pass of blockwise attention for every variant, DeBERTa's included.

The JAX kernels (`dense`, `blockwise`) hand the score terms to XLA one `[B, H, N, block]` slab at a
time; every slab is written to memory and read back for the softmax. This kernel scores a
`TILE x TILE` tile of queries and keys where it is used, in on-chip memory, as FlashAttention does:
one program per (sequence, head, query tile) loops over key tiles with an online softmax and writes
only the output and the log-sum-exp. DeBERTa's position terms are read inside the tile:
`c2p[i, idx(i - j)]` and `p2c[j, idx(i - j)]` are gather loads from the `[N, R]` products, with the
row index `idx` itself gathered from the per-distance table (`ScoreTerms.relative`), so no
`[N, N]` tensor exists anywhere. ALiBi and T5 read their per-distance bias the same way; RoPE
arrives already rotated.

Only the forward pass is fused. Gradients come from the blockwise kernel's FlashAttention backward
(`blockwise._online_softmax_bwd`), which recomputes each key block's scores from the log-sum-exp this
kernel saves, so training through it keeps memory linear in length too. There is no attention
dropout in the fused pass yet: the blockwise backward pass regenerates the mask from positions
(`dropout_masks.attention_keep`, int32 multiplies, xors and shifts that Triton has too), but the forward hook takes
no dropout key and this kernel no hashes of positions, as the TPU kernel does. With a dropout rate and a dropout key
(training) the call is refused with the fix.

On a GPU the kernel is compiled by Triton. On CPU and TPU it runs in Pallas' interpret mode, which
executes the same kernel body with XLA ops one program at a time: exact, and slow, meant for tests.
The tile's scores go through the same `scores.combine_scores` and `scores.mask_keys` as the other kernels'
(tested against the dense kernel).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from deberta_jax.kernels.blockwise import Blocks, blockwise_attention
from deberta_jax.kernels.scores import ScoreTerms, combine_scores, mask_keys

# Queries and keys per tile. Triton needs powers of two; 64 x 64 float32 scores plus the position
# gathers fit a GPU thread block's registers with room to spare.
TILE = 64


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)


def _per_distance_for_padding(table, key_len: int, padded_queries: int, padded_keys: int):
    """Re-index a per-distance table (`scores.distances(Nq, key_len)` order) for padded sizes.

    Entry `i - j + padded_keys - 1` of the result is the original entry for `i - j`; distances that
    exist only between padding positions repeat the nearest real one (their scores are discarded).
    """
    original = table.shape[-1]
    index = np.arange(padded_queries + padded_keys - 1) - (padded_keys - 1) + (key_len - 1)
    index = np.clip(index, 0, original - 1)
    if isinstance(table, np.ndarray):
        return table[..., index]
    return jnp.take(table, index, axis=-1)


def _attention_kernel(*refs, has_c2p: bool, has_p2c: bool, has_bias: bool, divisor: float, key_len: int,
                      num_key_tiles: int, padded_keys: int):
    """One (sequence, head, query tile) program: online softmax over every key tile."""
    refs = list(refs)
    q_ref, k_ref, v_ref, mask_ref = refs[:4]
    rest = refs[4:]
    rel_ref = rest.pop(0) if has_c2p or has_p2c else None
    c2p_ref = rest.pop(0) if has_c2p else None
    p2c_ref = rest.pop(0) if has_p2c else None
    bias_ref = rest.pop(0) if has_bias else None
    out_ref, lse_ref = rest

    query_start = pl.program_id(2) * TILE
    q = q_ref[...]
    tile_rows = jnp.arange(TILE)

    def body(key_tile, carry):
        m, norm, acc = carry
        key_start = key_tile * TILE
        keys = pl.ds(key_start, TILE)
        dot = plgpu.dot(q, k_ref[keys, :].T).astype(jnp.float32)
        # Row of every per-distance table for the pairs of this tile: i - j + padded_keys - 1.
        distance = (query_start + tile_rows)[:, None] - (key_start + tile_rows)[None, :] + (padded_keys - 1)
        relative = 0.0
        if rel_ref is not None:
            row = rel_ref[distance]
            if has_c2p:
                relative += c2p_ref[tile_rows[:, None], row].astype(jnp.float32)
            if has_p2c:
                relative += p2c_ref[(key_start + tile_rows)[None, :], row].astype(jnp.float32)
        bias = bias_ref[distance].astype(jnp.float32) if has_bias else None
        key_positions = key_start + tile_rows
        scores = mask_keys(combine_scores(dot, relative, bias, divisor), (mask_ref[keys] != 0)[None, :],
                           (key_positions < key_len)[None, :])
        m_new = jnp.maximum(m, scores.max(axis=-1))
        correction = jnp.exp(m - m_new)
        p = jnp.exp(scores - m_new[:, None])
        norm = norm * correction + p.sum(axis=-1)
        acc = acc * correction[:, None] + plgpu.dot(p.astype(v_ref.dtype), v_ref[keys, :]).astype(jnp.float32)
        return m_new, norm, acc

    init = (jnp.full((TILE,), -jnp.inf, jnp.float32), jnp.zeros((TILE,), jnp.float32),
            jnp.zeros((TILE, q.shape[-1]), jnp.float32))
    m, norm, acc = jax.lax.fori_loop(0, num_key_tiles, body, init)
    out_ref[...] = (acc / norm[:, None]).astype(out_ref.dtype)
    lse_ref[...] = m + jnp.log(norm)


def fused_forward(blocks: Blocks, *, interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """`(out, lse)` of attention over the blockwise kernel's key blocks, computed by the Pallas kernel.

    The blocks are undone here (the kernel tiles keys itself); `out` is `[B, H, Nq, d]`, `lse` `[B, H, Nq]`,
    as the blockwise backward pass expects. `interpret` defaults to True except on GPUs.
    """
    def unblock(x):  # [num_blocks, B, H, size, ...] -> [B, H, num_blocks * size, ...]
        x = jnp.moveaxis(x, 0, 2)
        return x.reshape(*x.shape[:2], -1, *x.shape[4:])

    terms = blocks.queries.with_keys(jax.tree.map(unblock, blocks.keys))
    q, k, c2p, p2c, bias = terms.q, terms.k, terms.c2p, terms.p2c, terms.bias
    v = unblock(blocks.values)
    key_mask = jnp.moveaxis(blocks.mask, 0, 1).reshape(blocks.mask.shape[1], -1)
    b, h, n_q, d = q.shape
    padded_q = -(-n_q // TILE) * TILE
    padded_k = -(-k.shape[2] // TILE) * TILE
    # Triton's dot wants power-of-two operands of at least 16: zero features change no dot product.
    padded_d = max(16, pl.next_power_of_2(d))
    q = _pad_axis(_pad_axis(q, 3, padded_d), 2, padded_q)
    k, v = (_pad_axis(_pad_axis(x, 3, padded_d), 2, padded_k) for x in (k, v))
    key_mask = _pad_axis(key_mask.astype(jnp.int32), 1, padded_k)

    per_head = lambda block: pl.BlockSpec((None, None) + block, lambda b_, h_, i: (b_, h_, 0, 0))  # noqa: E731
    per_query_tile = lambda last: pl.BlockSpec((None, None, TILE, last), lambda b_, h_, i: (b_, h_, i, 0))  # noqa: E731
    inputs = [q, k, v, key_mask]
    specs = [per_query_tile(padded_d), per_head((padded_k, padded_d)), per_head((padded_k, padded_d)),
             pl.BlockSpec((None, padded_k), lambda b_, h_, i: (b_, 0))]
    relative = terms.relative is not None and (c2p is not None or p2c is not None)
    if relative:
        rel = _per_distance_for_padding(np.asarray(terms.relative.by_distance, np.int32), terms.key_len,
                                        padded_q, padded_k)
        inputs.append(jnp.asarray(rel))
        specs.append(pl.BlockSpec((rel.shape[0],), lambda b_, h_, i: (0,)))
        if c2p is not None:
            inputs.append(_pad_axis(c2p, 2, padded_q))
            specs.append(per_query_tile(c2p.shape[-1]))
        if p2c is not None:
            inputs.append(_pad_axis(p2c, 2, padded_k))
            specs.append(per_head((padded_k, p2c.shape[-1])))
    if bias is not None:
        bias = _per_distance_for_padding(bias, terms.key_len, padded_q, padded_k)
        inputs.append(bias)
        specs.append(pl.BlockSpec((None, bias.shape[-1]), lambda b_, h_, i: (h_, 0)))
    kernel = functools.partial(
        _attention_kernel, has_c2p=relative and c2p is not None, has_p2c=relative and p2c is not None,
        has_bias=bias is not None, divisor=terms.divisor, key_len=blocks.num_keys,
        num_key_tiles=padded_k // TILE, padded_keys=padded_k)
    out, lse = pl.pallas_call(
        kernel,
        grid=(b, h, padded_q // TILE),
        in_specs=specs,
        out_specs=[per_query_tile(padded_d), pl.BlockSpec((None, None, TILE), lambda b_, h_, i: (b_, h_, i))],
        out_shape=[jax.ShapeDtypeStruct((b, h, padded_q, padded_d), q.dtype),
                   jax.ShapeDtypeStruct((b, h, padded_q), jnp.float32)],
        interpret=jax.default_backend() != "gpu" if interpret is None else interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="disentangled_attention_forward" if relative else "attention_forward",
    )(*inputs)
    return out[:, :, :n_q, :d], lse[:, :, :n_q]


def pallas_attention(terms: ScoreTerms, v: jax.Array, key_mask: jax.Array, *, block_size: int,
                     dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
                     interpret: bool | None = None) -> jax.Array:
    """`blockwise_attention` with the forward pass fused by Pallas (same arguments, same result to float
    rounding); `block_size` sets the key blocks of the backward pass. `interpret=False` on a machine without
    a GPU still lowers the kernel to Triton (for a GPU target), which tests use."""
    if dropout_key is not None and dropout_rate > 0:
        raise ValueError(
            f"attention_kernel='pallas' has no attention dropout, but attention_dropout={dropout_rate} in "
            "training; set model.attention_dropout=0 or train with attention_kernel='blockwise' or 'dense' "
            "(any kernel evaluates a trained model)")
    return blockwise_attention(terms, v, key_mask, block_size=block_size,
                               forward=functools.partial(fused_forward, interpret=interpret))
