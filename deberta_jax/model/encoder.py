"""Masked-LM encoders: embeddings, post- or pre-LayerNorm encoder layers, tied MLM head, optional EMD.

One class, `MaskedLM`, covers BERT (`attention="entangled"`, `position_biased_input=True`) and
DeBERTa v2/v3 (`attention="disentangled"`, `position_biased_input=False`), every mix of the two that
the ablations need, and the length-generalization baselines (NoPE, sinusoidal, RoPE, ALiBi, T5 bias,
randomized positions), all selected by `ModelConfig`. Everything about positions is gathered once
per forward pass into a `PositionContext` that the embeddings and every layer read.

Precision: parameters are float32; with `dtype="bfloat16"` matmuls run in bfloat16 while the residual
stream, LayerNorm statistics, softmax and logits stay float32.

Dropout (and, with `randomized_positions`, the position sample) is active exactly when `rngs` (an
`nnx.Rngs` with a `dropout` stream) is passed, so a train step derives its dropout key from
(seed, step) and a resumed run draws the same masks and positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from deberta_jax.kernels.scores import RelativeIndex
from deberta_jax.model import biases, positions
from deberta_jax.model.attention import PositionContext, SelfAttention
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.dropout import Dropout
from deberta_jax.model.parameters import UNDECAYED, dense, layer_norm, table

ACTIVATIONS = {
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_new": lambda x: jax.nn.gelu(x, approximate=True),
    "relu": jax.nn.relu,
}


# What `jax.checkpoint` keeps for the backward pass under each `ModelConfig.remat` ("full": nothing but the input).
_REMAT_POLICIES = {"full": None, "dots": jax.checkpoint_policies.dots_saveable,
                   "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


class Embeddings(nnx.Module):
    """Word (+ absolute position when `position_biased_input`) (+ token type), LayerNorm, dropout.

    Absolute positions are learned rows or sinusoids (`absolute_embedding`); EMD models read them
    before the MLM head instead. Only the learned kind has a table.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.word_embeddings = table(cfg, cfg.vocab_size, rngs)
        self.position_embeddings = table(cfg, cfg.max_position_embeddings, rngs) if cfg.uses_absolute_table else None
        self.token_type_embeddings = table(cfg, cfg.type_vocab_size, rngs) if cfg.type_vocab_size else None
        self.norm = layer_norm(cfg, rngs)
        self.dropout = Dropout(cfg.hidden_dropout)

    def absolute(self, ctx: PositionContext) -> jax.Array:
        """Absolute position vectors `[1 or B, N, hidden]` for `ctx.position_ids`.

        A learned table applies `absolute_position_policy` to positions `0..N-1`; sampled positions
        lie below `random_position_max <= max_position_embeddings` (validated) and read their rows.
        """
        if self.cfg.absolute_embedding == "sinusoidal":
            return positions.sinusoidal_embeddings(ctx.position_ids, self.cfg.hidden_size)
        if ctx.sampled:
            return jnp.take(self.position_embeddings[...], ctx.position_ids, axis=0)
        seq_len = ctx.position_ids.shape[-1]
        return positions.absolute_position_embeddings(
            self.position_embeddings[...], seq_len, self.cfg.trained_positions, self.cfg.absolute_position_policy)[None]

    def __call__(self, input_ids, key_mask, token_type_ids, ctx: PositionContext, rngs) -> jax.Array:
        x = jnp.take(self.word_embeddings[...], input_ids, axis=0)
        if self.cfg.position_biased_input:
            x = x + self.absolute(ctx)
        if self.token_type_embeddings is not None:
            x = x + jnp.take(self.token_type_embeddings[...], token_type_ids, axis=0)
        x = self.norm(x) * key_mask[..., None].astype(jnp.float32)
        return self.dropout(x, rngs)


class EncoderLayer(nnx.Module):
    """Transformer layer: attention and MLP sub-layers, each added to the residual stream.

    Post-LN (the published models): `norm(x + sublayer(x))`. Pre-LN: `x + sublayer(norm(x))`; the same two
    norms, applied to each sub-layer's input instead, and `MaskedLM` normalizes the final output.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.attention = SelfAttention(cfg, rngs=rngs)
        self.attention_out = dense(cfg, cfg.hidden_size, cfg.hidden_size, rngs)
        self.attention_norm = layer_norm(cfg, rngs)
        self.intermediate = dense(cfg, cfg.hidden_size, cfg.intermediate_size, rngs)
        self.output = dense(cfg, cfg.intermediate_size, cfg.hidden_size, rngs)
        self.output_norm = layer_norm(cfg, rngs)
        self.dropout = Dropout(cfg.hidden_dropout)

    def _attend(self, hidden, key_mask, ctx, query_states, rngs) -> jax.Array:
        context = self.attention(hidden, key_mask, ctx, query_states=query_states, rngs=rngs)
        return self.dropout(self.attention_out(context), rngs).astype(jnp.float32)

    def _mlp(self, x, rngs) -> jax.Array:
        mlp = self.output(ACTIVATIONS[self.cfg.hidden_act](self.intermediate(x)))
        return self.dropout(mlp, rngs).astype(jnp.float32)

    def __call__(self, hidden, key_mask, ctx: PositionContext, query_states=None, rngs=None) -> jax.Array:
        residual = hidden if query_states is None else query_states
        if self.cfg.layer_norm_placement == "pre":
            queries = None if query_states is None else self.attention_norm(query_states)
            att = residual + self._attend(self.attention_norm(hidden), key_mask, ctx, queries, rngs)
            return att + self._mlp(self.output_norm(att), rngs)
        att = self.attention_norm(self._attend(hidden, key_mask, ctx, query_states, rngs) + residual)
        return self.output_norm(self._mlp(att, rngs) + att)


class Encoder(nnx.Module):
    """The layer stack and the position parameters its layers share: DeBERTa's relative table, a bias scheme's
    parameters (`biases.SCHEMES`, as attributes under their registered names)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.layers = nnx.List([EncoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        relative = cfg.attention == "disentangled"
        self.rel_embeddings = table(cfg, 2 * cfg.relative_span, rngs) if relative else None
        self.rel_norm = layer_norm(cfg, rngs) if relative and cfg.norm_rel_ebd == "layer_norm" else None
        for name, parameter in biases.parameters_of(cfg).items():
            setattr(self, name, nnx.Param(parameter.init(cfg, rngs.params()), weight_decay=parameter.weight_decay))

    def position_context(self, batch: int, seq_len: int, rngs=None, key_mask=None) -> PositionContext:
        """Positions, score bias, reachable relative rows and attention temperature for a `[batch, seq_len]`
        forward pass (`key_mask` `[batch, seq_len]`, all real when None, counts the keys for the temperature).

        With `randomized_positions` and `rngs` (training) the positions are sampled from the dropout
        stream; otherwise they are `0..N-1`. Distances are scaled by `cfg.distance_scale(seq_len)`.
        """
        cfg = self.cfg
        scale = cfg.distance_scale(seq_len)
        sampled = cfg.randomized_positions and rngs is not None
        if sampled:
            ids = positions.random_positions(rngs.dropout(), batch, seq_len, cfg.random_position_max)
        else:
            ids = np.arange(seq_len, dtype=np.int32)[None]
        mask = np.ones((batch, seq_len), np.int32) if key_mask is None else key_mask
        bias = bias_index = rel_embeddings = relative = None
        if cfg.bias_scheme:
            scheme = biases.SCHEMES[cfg.bias_scheme]
            bias = scheme.bias({name: getattr(self, name)[...] for name in scheme.parameters}, cfg, seq_len, scale,
                               mask)
            if scheme.buckets is not None:
                bias_index = RelativeIndex(scheme.buckets(cfg, seq_len, scale))
        if cfg.attention == "disentangled":
            kw = dict(position_buckets=cfg.position_buckets, max_relative_positions=cfg.max_relative_positions,
                      clamp=cfg.clamp_relative_positions, scale=scale)
            lo, hi = positions.relative_rows_used(seq_len, seq_len, **kw)
            rel_embeddings = self.rel_embeddings[...][lo:hi]
            if self.rel_norm is not None:
                # Row-wise, so normalizing a slice equals slicing the normalized table.
                rel_embeddings = self.rel_norm(rel_embeddings)
            relative = RelativeIndex(positions.relative_index_by_distance(seq_len, seq_len, **kw) - lo)
        ends = positions.global_keys(mask) if cfg.window_global_tokens else None
        temperature = log_keys = None
        if cfg.attention_temperature != "none":
            visible = positions.visible_keys(mask, cfg.attention_window, with_ends=cfg.window_global_tokens)
            log_keys = positions.log_keys(visible)
            if cfg.attention_temperature == "log_length":
                temperature = jnp.maximum(log_keys / np.float32(np.log(cfg.effective_trained_length)), 1.0)
        return PositionContext(position_ids=ids, sampled=sampled, bias=bias, bias_index=bias_index,
                               rel_embeddings=rel_embeddings,
                               relative=relative, temperature=temperature, log_keys=log_keys, global_keys=ends)

    def __call__(self, hidden, key_mask, ctx: PositionContext, rngs=None, num_layers: int | None = None) -> jax.Array:
        """Run the first `num_layers` layers (all by default), as a loop or a `lax.scan` (`cfg.scan_layers`),
        each rematerialized under `cfg.remat`.

        Layer l draws its dropout from `fold_in(key, l)`, `key` one draw of `rngs`' dropout stream, so the loop
        and the scan drop the same elements. Remat always runs as a scan: in an unrolled stack XLA schedules every
        layer's recomputation at the start of the backward pass, where it saves no memory at all.
        """
        layers = list(self.layers[: self.cfg.num_layers if num_layers is None else num_layers])
        if not layers:
            return hidden
        apply = _layer_function(self.cfg, nnx.graphdef(layers[0]), key_mask, ctx)
        keys = None
        if rngs is not None:
            keys = jax.vmap(jax.random.fold_in, (None, 0))(rngs.dropout(), jnp.arange(len(layers)))
        if self.cfg.scan_layers or self.cfg.remat != "none":
            stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[nnx.state(layer) for layer in layers])
            hidden, _ = jax.lax.scan(lambda h, xs: (apply(xs[0], h, xs[1]), None), hidden, (stacked, keys))
            return hidden
        for index, layer in enumerate(layers):
            hidden = apply(nnx.state(layer), hidden, None if keys is None else keys[index])
        return hidden


def _layer_function(cfg: ModelConfig, graphdef: nnx.GraphDef, key_mask, ctx: PositionContext):
    """`apply(layer_state, hidden, dropout_key) -> hidden`: one encoder layer as a pure function of its
    parameters, rematerialized under `cfg.remat` (`jax.checkpoint` with the named policy)."""
    def apply(state, hidden, key):
        return nnx.merge(graphdef, state)(hidden, key_mask, ctx, rngs=None if key is None else nnx.Rngs(dropout=key))
    if cfg.remat == "none":
        return apply
    return jax.checkpoint(apply, policy=_REMAT_POLICIES[cfg.remat])


class MaskedLM(nnx.Module):
    """Encoder with the MLM head tied to the word embeddings (and DeBERTa's EMD when `use_emd`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embeddings = Embeddings(cfg, rngs=rngs)
        self.encoder = Encoder(cfg, rngs=rngs)
        self.head_dense = dense(cfg, cfg.hidden_size, cfg.hidden_size, rngs)
        # Pre-LN leaves the residual stream unnormalized; this norm closes it (None for post-LN).
        self.final_norm = layer_norm(cfg, rngs) if cfg.layer_norm_placement == "pre" else None
        self.head_norm = layer_norm(cfg, rngs)
        self.head_bias = nnx.Param(jnp.zeros((cfg.vocab_size,), jnp.float32), **UNDECAYED)

    def encode(self, input_ids, attention_mask=None, token_type_ids=None, *, rngs=None) -> jax.Array:
        """Final hidden states `[B, N, hidden]` (float32) that the MLM head reads."""
        cfg = self.cfg
        input_ids, key_mask, token_type_ids = check_inputs(cfg, input_ids, attention_mask, token_type_ids)
        ctx = self.encoder.position_context(*input_ids.shape, rngs=rngs, key_mask=key_mask)
        hidden = self.embeddings(input_ids, key_mask, token_type_ids, ctx, rngs)
        if not cfg.use_emd:
            return self._close(self.encoder(hidden, key_mask, ctx, rngs=rngs))
        # EMD (microsoft/DeBERTa): keys/values are the input of the last layer; the query starts from
        # absolute positions plus that input and is refined by re-applying the last layer's weights.
        # The last layer's ordinary output is not used by the MLM loss, so it is not computed.
        hidden = self.encoder(hidden, key_mask, ctx, rngs=rngs, num_layers=cfg.num_layers - 1)
        query = self.embeddings.absolute(ctx) + hidden
        last = self.encoder.layers[cfg.num_layers - 1]
        for _ in range(cfg.emd_layers):
            query = last(hidden, key_mask, ctx, query_states=query, rngs=rngs)
        return self._close(query)

    def _close(self, hidden: jax.Array) -> jax.Array:
        return hidden if self.final_norm is None else self.final_norm(hidden)

    def head(self, hidden: jax.Array) -> jax.Array:
        """Transform (dense, activation, LayerNorm) then tied decoder; logits in float32."""
        x = self.head_norm(ACTIVATIONS[self.cfg.hidden_act](self.head_dense(hidden)))
        words = self.embeddings.word_embeddings[...].astype(self.cfg.dtype)
        logits = jnp.einsum("bnh,vh->bnv", x.astype(self.cfg.dtype), words, preferred_element_type=jnp.float32)
        return logits + self.head_bias[...]

    def head_at(self, hidden: jax.Array, positions: jax.Array) -> jax.Array:
        """Logits `[K, vocab]` at the flat positions `positions` `[K]` of `hidden` `[B, N, hidden]`, or `[G, K, vocab]`
        for positions `[G, K]` counted within each of G equal groups of consecutive rows.

        Training and evaluation score only the masked positions, skipping most of the vocabulary projection, the
        largest matmul of a small model. Groups let a batch split over G devices pick and score its positions on
        each device: positions in the flat global batch would make every device score all of them.
        """
        groups = 1 if positions.ndim == 1 else positions.shape[0]
        rows = hidden.reshape(groups, -1, hidden.shape[-1])
        picked = jnp.take_along_axis(rows, positions.reshape(groups, -1, 1), axis=1)
        return self.head(picked).reshape(*positions.shape, -1)

    def __call__(self, input_ids, attention_mask=None, token_type_ids=None, *, rngs=None) -> jax.Array:
        """MLM logits `[B, N, vocab]`; dropout only when `rngs` is given."""
        return self.head(self.encode(input_ids, attention_mask, token_type_ids, rngs=rngs))

    def mlm_logits(self, input_ids, attention_mask=None, token_type_ids=None) -> jax.Array:
        """Deterministic MLM logits (the public contract used with `hf.load`)."""
        return self(input_ids, attention_mask, token_type_ids)


def with_options(model: MaskedLM, **fields) -> MaskedLM:
    """`model`'s parameters under its config with `fields` replaced (`ModelConfig.with_options`: fields that change
    how the parameters are used, not what they are), e.g. to evaluate a trained model past its training length with
    another kernel or position policy. The parameters are shared, not copied."""
    cfg = model.cfg.with_options(**fields)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: MaskedLM(cfg, rngs=nnx.Rngs(params=0))))
    return nnx.merge(graphdef, nnx.state(model))


def check_inputs(cfg: ModelConfig, input_ids, attention_mask, token_type_ids):
    """Validate dtypes, shapes and (when the values are concrete) id ranges; fill defaults.

    Errors name the argument and the fix. Under `jit` only static properties can be checked; the
    range checks run whenever the arrays are concrete (eager calls, `mlm_logits`).
    """
    input_ids = jnp.asarray(input_ids)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [batch, seq_len]; got shape {input_ids.shape}. "
                         "Add a batch axis with input_ids[None] for a single sequence.")
    if not jnp.issubdtype(input_ids.dtype, jnp.integer):
        raise TypeError(f"input_ids must be an integer array; got dtype {input_ids.dtype}. "
                        "Pass token ids, e.g. np.asarray(ids, dtype=np.int32).")
    if input_ids.shape[1] < 1:
        raise ValueError("input_ids has seq_len 0; pass at least one token")
    attention_mask = _like_ids("attention_mask", attention_mask, input_ids, jnp.ones_like)
    if not (jnp.issubdtype(attention_mask.dtype, jnp.integer) or attention_mask.dtype == jnp.bool_):
        raise TypeError(f"attention_mask must be int or bool (1/True = real token); got dtype {attention_mask.dtype}")
    token_type_ids = _like_ids("token_type_ids", token_type_ids, input_ids, jnp.zeros_like)
    if not isinstance(input_ids, jax.core.Tracer):
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= cfg.vocab_size:
            raise ValueError(f"input_ids must lie in [0, vocab_size={cfg.vocab_size}); got values in "
                             f"[{lo}, {hi}]. Check that the tokenizer matches the model's vocabulary.")
    if not isinstance(attention_mask, jax.core.Tracer):
        if not bool(jnp.all((attention_mask == 0) | (attention_mask == 1))):
            raise ValueError("attention_mask must contain only 0 (padding) and 1 (real token)")
    if not isinstance(token_type_ids, jax.core.Tracer) and cfg.type_vocab_size:
        if int(token_type_ids.min()) < 0 or int(token_type_ids.max()) >= cfg.type_vocab_size:
            raise ValueError(f"token_type_ids must lie in [0, type_vocab_size={cfg.type_vocab_size})")
    return input_ids, attention_mask, token_type_ids


def _like_ids(name: str, value, input_ids, default):
    """`value` as an array of input_ids' shape (`default(input_ids)` when None), or a clear error."""
    value = default(input_ids) if value is None else jnp.asarray(value)
    if value.shape != input_ids.shape:
        raise ValueError(f"{name} must have the shape of input_ids {input_ids.shape}; got {value.shape}")
    return value
