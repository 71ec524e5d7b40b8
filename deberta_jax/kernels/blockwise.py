"""The blockwise kernel: FlashAttention's online softmax over blocks of keys, memory linear in length.

`blockwise_attention` (Dao et al. 2022) scans over blocks of `block_size` keys keeping each row's running maximum
and normalizer, with a custom backward pass that recomputes each block's scores from the saved log-sum-exp, so
neither pass holds more than `[B, H, Nq, block_size]` of scores: the dense kernel's result to float rounding, for
evaluation at 8k+ tokens. The key side of the `ScoreTerms` (keys, DeBERTa's p2c) is cut into blocks; the query
side (queries, c2p, a per-distance bias) is read whole by every block.

Under sigmoid weights (`sigmoid_bias`, `ModelConfig.attention_weights`) a key's weight is final when its block is
scored, so the scan keeps only the weighted sum, and the backward pass recomputes each block's weights from the
scores alone.

Attention dropout draws each block's mask from its positions (`dropout_keep`) and draws it again in the backward
pass: the dense kernel's mask, whatever the block size.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from deberta_jax.kernels import dropout_masks
from deberta_jax.kernels.scores import ScoreTerms, mask_keys


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Blocks:
    """The kernel's inputs laid out in key blocks: what the forward pass reads and the backward pass saves.

    `queries` is the query side of the score terms (key side None); `keys` the key side and `values`
    `[num_blocks, B, H, size, ...]`; `mask` `[num_blocks, B, size]` (1 = real token); `dropout_key` None without
    dropout. `num_keys` (static) is the real number of keys: block positions past it are padding.
    """

    queries: ScoreTerms
    keys: dict
    values: jax.Array
    mask: jax.Array
    dropout_key: jax.Array | None
    num_keys: int = dataclasses.field(metadata=dict(static=True))

    @property
    def block_size(self) -> int:
        return self.mask.shape[-1]

    def scores(self, block, key_block: dict, mask_block: jax.Array, queries: ScoreTerms | None = None) -> jax.Array:
        """Float32 scores of key block `block`, masked (`mask_keys`); padding keys past `num_keys` at -inf.
        Differentiating through the masks zeroes the gradient of both."""
        queries = self.queries if queries is None else queries
        positions = block * self.block_size + jnp.arange(self.block_size)
        scores = queries.with_keys(key_block).scores(jnp.minimum(positions, self.num_keys - 1))
        real = mask_block[:, None, None, :].astype(bool)
        return mask_keys(scores.astype(jnp.float32), real, positions < self.num_keys)


def dropout_keep(key: jax.Array, block: jax.Array | int, shape: tuple[int, ...], rate: float) -> jax.Array:
    """The keep mask of attention dropout for key block `block`, `shape` `[B, H, Nq, block size]`."""
    b, h, n_q, size = shape
    hashes = dropout_masks.attention_hashes(key, b, h, jnp.arange(n_q), block * size + jnp.arange(size))
    return dropout_masks.attention_keep(*hashes, rate)


def blockwise_attention(terms: ScoreTerms, v: jax.Array, key_mask: jax.Array, *, block_size: int,
                        dropout_rate: float = 0.0, dropout_key: jax.Array | None = None,
                        sigmoid_bias: float | None = None) -> jax.Array:
    """The result of `dense_attention` (up to float rounding and dropout bits) in memory linear in `Nk`.

    Keys are padded to a multiple of `block_size` (padding keys score -inf, so they weigh nothing even in a row
    whose real keys are all masked, where both kernels average every key uniformly).
    """
    n_k = v.shape[-2]
    size = min(block_size, n_k)
    num_blocks = -(-n_k // size)
    pad = num_blocks * size - n_k

    def cut(x):  # [B, H, Nk, ...] -> [num_blocks, B, H, size, ...]
        x = jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3))
        return jnp.moveaxis(x.reshape(*x.shape[:2], num_blocks, size, *x.shape[3:]), 2, 0)

    blocks = Blocks(
        queries=terms.with_keys({name: None for name in terms.key_side()}),
        keys=jax.tree.map(cut, terms.key_side()), values=cut(v),
        mask=jnp.pad(key_mask, [(0, 0), (0, pad)]).reshape(-1, num_blocks, size).swapaxes(0, 1),
        dropout_key=dropout_key if dropout_rate > 0 else None, num_keys=n_k)
    rate = float(dropout_rate) if blocks.dropout_key is not None else 0.0
    return _block_attention(rate, None if sigmoid_bias is None else float(sigmoid_bias), blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _block_attention(rate: float, sigmoid_bias: float | None, blocks: Blocks) -> jax.Array:
    return _block_attention_fwd(rate, sigmoid_bias, blocks)[0]


def _block_attention_fwd(rate, sigmoid_bias, blocks: Blocks):
    """The output, with what the backward pass needs: the blocks, the output and each row's log-sum-exp (unused
    under sigmoid weights)."""
    out, lse = _scan_forward(rate, sigmoid_bias, blocks)
    return out, (blocks, out, lse)


def _scan_forward(rate: float, sigmoid_bias: float | None, blocks: Blocks) -> tuple[jax.Array, jax.Array | None]:
    """Scan over key blocks keeping the running row maximum `m`, normalizer `norm` and weighted sum (the sum only,
    under sigmoid weights)."""
    num_blocks, _, _, _, d = blocks.values.shape
    first = jax.tree.map(lambda x: x[0], blocks.keys)
    b, h, n_q, _ = jax.eval_shape(lambda kb, mb: blocks.scores(0, kb, mb), first, blocks.mask[0]).shape

    def body(carry, xs):
        m, norm, acc = carry
        block, key_block, value_block, mask_block = xs
        scores = blocks.scores(block, key_block, mask_block)
        if sigmoid_bias is None:
            m_new = jnp.maximum(m, scores.max(axis=-1))
            correction = jnp.exp(m - m_new)[..., None]
            p = jnp.exp(scores - m_new[..., None])
            norm = norm * correction[..., 0] + p.sum(axis=-1)
        else:  # final weights: nothing earlier to rescale
            m_new, correction, p = m, 1.0, jax.nn.sigmoid(scores + sigmoid_bias)
        keep = dropout_keep(blocks.dropout_key, block, p.shape, rate) if rate else None
        acc = acc * correction + jnp.einsum(
            "bhij,bhjd->bhid", dropout_masks.apply(p, keep, rate).astype(value_block.dtype), value_block,
            preferred_element_type=jnp.float32)
        return (m_new, norm, acc), None

    init = (jnp.full((b, h, n_q), -jnp.inf), jnp.zeros((b, h, n_q)), jnp.zeros((b, h, n_q, d)))
    xs = (jnp.arange(num_blocks), blocks.keys, blocks.values, blocks.mask)
    (m, norm, acc), _ = jax.lax.scan(body, init, xs)
    if sigmoid_bias is not None:  # no normalizer: the backward pass recomputes the weights from the scores alone
        return acc.astype(blocks.values.dtype), None
    return (acc / norm[..., None]).astype(blocks.values.dtype), m + jnp.log(norm)


def _block_attention_bwd(rate, sigmoid_bias, residuals, d_out):
    """FlashAttention's backward pass: per block, recompute the probabilities `exp(s - lse)` and pull
    the score gradient `p * (dp - rowsum(d_out * out))` back through the score terms' own VJP; under sigmoid
    weights the weights are `sigmoid(s + bias)` and the score gradient `dp * p * (1 - p)`."""
    blocks, out, lse = residuals
    d_out32 = d_out.astype(jnp.float32)
    delta = jnp.sum(d_out32 * out.astype(jnp.float32), axis=-1)

    def body(d_queries, xs):
        block, key_block, value_block, mask_block = xs
        scores, pull = jax.vjp(lambda qs, kb: blocks.scores(block, kb, mask_block, queries=qs),
                               blocks.queries, key_block)
        p = jnp.exp(scores - lse[..., None]) if sigmoid_bias is None else jax.nn.sigmoid(scores + sigmoid_bias)
        keep = dropout_keep(blocks.dropout_key, block, p.shape, rate) if rate else None
        d_value = jnp.einsum("bhij,bhid->bhjd", dropout_masks.apply(p, keep, rate).astype(value_block.dtype),
                             d_out.astype(value_block.dtype), preferred_element_type=jnp.float32)
        dp = dropout_masks.apply(jnp.einsum("bhid,bhjd->bhij", d_out32, value_block.astype(jnp.float32)), keep, rate)
        d_qs, d_key = pull(p * (dp - delta[..., None]) if sigmoid_bias is None else dp * p * (1 - p))
        d_queries = jax.tree.map(lambda acc, g: acc + g.astype(jnp.float32), d_queries, d_qs)
        return d_queries, (d_key, d_value.astype(value_block.dtype))

    # The gradients of the query side (queries, c2p, bias) add up over every block: accumulate them in float32.
    d_queries, (d_keys, d_values) = jax.lax.scan(
        body, jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), blocks.queries),
        (jnp.arange(blocks.values.shape[0]), blocks.keys, blocks.values, blocks.mask))
    d_queries = jax.tree.map(lambda g, x: g.astype(x.dtype), d_queries, blocks.queries)
    return (dataclasses.replace(blocks, queries=d_queries, keys=d_keys, values=d_values, mask=None,
                                dropout_key=None),)


_block_attention.defvjp(_block_attention_fwd, _block_attention_bwd)
