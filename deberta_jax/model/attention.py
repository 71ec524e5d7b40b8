"""Self-attention: projections, and the score terms of every attention variant.

The *variant* (what the scores are made of) is separate from the *kernel* (how the scores become a
context vector, `deberta_jax.kernels`): `SelfAttention` projects queries, keys and values, builds the
variant's `ScoreTerms` (the formula itself, c2c + c2p + p2c + bias, is written once in
`deberta_jax.kernels.scores`) and hands them to the configured kernel. DeBERTa adds its content-to-position
and position-to-content products with the relative table (`relative_products`); RoPE rotates q and k
(`positions.apply_rope`); a bias scheme (`model.biases`: ALiBi, T5, KERPLE) adds a per-distance bias.

Layout: queries/keys/values are `[B, H, N, d]`; projected relative tables are `[H, R, d]` where R is
the number of relative-table rows this sequence length can reach (see `PositionContext`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deberta_jax.kernels import dispatch
from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms
from deberta_jax.model import positions
from deberta_jax.model.config import LEARNED_TEMPERATURES, ModelConfig
from deberta_jax.model.dropout import Dropout
from deberta_jax.model.parameters import UNDECAYED, dense


@dataclasses.dataclass(frozen=True)
class PositionContext:
    """What the embeddings and every attention layer need about positions, built once per forward pass.

    - `position_ids` `[1 or B, N]`: token positions, read by absolute embeddings and RoPE; `0..N-1`
      (numpy), or sampled per sequence when `sampled` (randomized positions in training), in which
      case a learned table reads those rows directly instead of applying the out-of-range policy;
    - `bias` `[H, 2N - 1]` (or `[B, H, 2N - 1]`, `biases.BiasScheme.per_row`): the bias scheme's score bias per
      distance `i - j` (`kernels.scores.distances`), else None; `bias_index`: its bucket per distance, for a
      bias read from a table by bucket (T5's);
    - `temperature` `[B, 1, N, 1]`: the factor on each query's scores (`ModelConfig.attention_temperature`
      "log_length"), else None; `log_keys` `[B, 1, N, 1]`: the log of the keys each query sees, which a learned
      temperature scales by its per-head slope (else None);
    - `global_keys` `[B, 1, N]`: the keys every query sees besides its window (`window_global_tokens`), else None;
    - `rel_embeddings` / `relative` (disentangled): the (LayerNorm'd) relative-table rows `[R, hidden]`
      that the current length can reach, and the row for each distance `i - j` (`RelativeIndex`).
      Projecting only reachable rows keeps short sequences from paying for the whole 2k-row table.
    Position terms are stored per distance, not per (i, j), so a blockwise kernel expands only the
    `[N, block]` slice it needs (`scores.toeplitz`) and memory stays linear in length.
    """

    position_ids: jax.Array | np.ndarray
    sampled: bool = False
    bias: jax.Array | None = None
    bias_index: RelativeIndex | None = None
    rel_embeddings: jax.Array | None = None
    relative: RelativeIndex | None = None
    temperature: jax.Array | None = None
    log_keys: jax.Array | None = None
    global_keys: jax.Array | None = None


def split_heads(x: jax.Array, num_heads: int) -> jax.Array:
    """[..., N, H*d] -> [..., H, N, d]."""
    *lead, n, hd = x.shape
    x = x.reshape(*lead, n, num_heads, hd // num_heads)
    return jnp.swapaxes(x, -2, -3)


def merge_heads(x: jax.Array) -> jax.Array:
    """[B, H, N, d] -> [B, N, H*d]."""
    b, h, n, d = x.shape
    return jnp.swapaxes(x, 1, 2).reshape(b, n, h * d)


def relative_products(x: jax.Array, table: jax.Array) -> jax.Array:
    """`x_n . table[h, r]` for every head, token and relative row: `[B, H, N, d] x [H, R, d] -> [B, H, N, R]`.

    DeBERTa's c2p (queries against position keys) and p2c (keys against position queries). Written as
    one `[B*N, d] x [d, R]` matmul per head, heads leading, rather than the equivalent
    `einsum("bhid,hrd->bhir")`, which XLA's CPU backend runs markedly slower (a batch axis that is not
    leading on one side, shared by the other); the figures are in benchmarks/README.md.
    """
    b, h, n, d = x.shape
    rows = jnp.swapaxes(x, 0, 1).reshape(h, b * n, d)
    return jnp.swapaxes(jnp.einsum("hmd,hrd->hmr", rows, table).reshape(h, b, n, -1), 0, 1)


class SelfAttention(nnx.Module):
    """Multi-head self-attention of any variant, with the projections named as in DeBERTa."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        h = cfg.hidden_size
        self.query_proj = dense(cfg, h, h, rngs)
        self.key_proj = dense(cfg, h, h, rngs)
        self.value_proj = dense(cfg, h, h, rngs)
        separate = cfg.attention == "disentangled" and not cfg.share_att_key
        self.pos_key_proj = dense(cfg, h, h, rngs) if separate and "c2p" in cfg.pos_att_type else None
        self.pos_query_proj = dense(cfg, h, h, rngs) if separate and "p2c" in cfg.pos_att_type else None
        self.pos_dropout = Dropout(cfg.hidden_dropout)
        # A learned temperature's parameter per head (`positions.learned_temperature`), starting where the fixed
        # log-length temperature is: a factor of 1 on rows of L keys, log(n) / log(L) on rows of n.
        self.temperature_slope = nnx.Param(
            jnp.full((cfg.num_heads,), 1 / np.log(cfg.effective_trained_length), jnp.float32), **UNDECAYED,
        ) if cfg.attention_temperature in LEARNED_TEMPERATURES else None

    def _relative_projections(self, ctx: PositionContext, rngs):
        """Project the reachable relative rows into per-head position queries/keys `[H, R, d]`."""
        cfg = self.cfg
        table = self.pos_dropout(ctx.rel_embeddings, rngs)
        key_proj = self.key_proj if cfg.share_att_key else self.pos_key_proj
        query_proj = self.query_proj if cfg.share_att_key else self.pos_query_proj
        pos_k = split_heads(key_proj(table), cfg.num_heads) if "c2p" in cfg.pos_att_type else None
        pos_q = split_heads(query_proj(table), cfg.num_heads) if "p2c" in cfg.pos_att_type else None
        return pos_q, pos_k

    def __call__(
        self,
        hidden: jax.Array,
        key_mask: jax.Array,
        ctx: PositionContext,
        query_states: jax.Array | None = None,
        rngs: nnx.Rngs | None = None,
    ) -> jax.Array:
        """`hidden` gives keys and values; `query_states` (default `hidden`) gives queries (EMD)."""
        cfg = self.cfg
        query_states = hidden if query_states is None else query_states
        q = split_heads(self.query_proj(query_states), cfg.num_heads)
        k = split_heads(self.key_proj(hidden), cfg.num_heads)
        v = split_heads(self.value_proj(hidden), cfg.num_heads)
        temperature = ctx.temperature
        if self.temperature_slope is not None:
            temperature = positions.learned_temperature(cfg.attention_temperature,
                                                        self.temperature_slope[...][None, :, None, None],
                                                        ctx.log_keys, cfg.effective_trained_length)
        terms = ScoreTerms(q=q, k=k, key_len=k.shape[-2], temperature=temperature, window=cfg.attention_window,
                           global_keys=ctx.global_keys)
        if cfg.attention == "disentangled":
            pos_q, pos_k = self._relative_projections(ctx, rngs) if cfg.pos_att_type else (None, None)
            # The fused kernels and the dense kernel's shift formulation take the projected tables themselves.
            shift = cfg.attention_kernel == "dense" and cfg.relative_terms_for(jax.default_backend()) == "shift"
            if shift or cfg.attention_kernel in ("pallas", "pallas_tpu"):
                terms = dataclasses.replace(terms, relative=ctx.relative, pos_key=pos_k, pos_query=pos_q)
            else:
                terms = dataclasses.replace(
                    terms, relative=ctx.relative,
                    c2p=None if pos_k is None else relative_products(q, pos_k),
                    p2c=None if pos_q is None else relative_products(k, pos_q))
        elif cfg.attention == "rope":
            ids = ctx.position_ids[:, None] * cfg.distance_scale(k.shape[-2])  # [1 or B, 1, N] against [B, H, N, d]
            terms = dataclasses.replace(terms, q=positions.apply_rope(q, ids, cfg.rope_theta),
                                        k=positions.apply_rope(k, ids, cfg.rope_theta))
        if ctx.bias is not None:
            terms = dataclasses.replace(terms, bias=ctx.bias, bias_index=ctx.bias_index)
        dropout_key = rngs.dropout() if rngs is not None and cfg.attention_dropout > 0 else None
        kernel = dispatch.attention_kernel(cfg.attention_kernel, cfg.attention_block_size, cfg.sigmoid_bias)
        return merge_heads(kernel(terms, v, key_mask, dropout_rate=cfg.attention_dropout, dropout_key=dropout_key))
