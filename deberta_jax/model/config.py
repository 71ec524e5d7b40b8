"""Model configuration: one frozen dataclass, validated once when it is built.

The model code reads only `ModelConfig`; experiment configs (`configs/*.py`, ml_collections) are
converted with `ModelConfig.from_dict`, and transformers checkpoints with `deberta_jax.model.hf`. Validation
lives here so a bad sweep value fails at start-up with the field's name, not deep inside a jit trace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from deberta_jax.kernels.dispatch import KERNELS, SIGMOID_KERNELS
from deberta_jax.model.biases import SCHEMES

# The variants with their own score terms; every registered bias scheme (`biases.SCHEMES`) is one more variant, the
# dot product plus that bias, and a `score_bias` that another variant's scores can add (read when validating, so a
# scheme registered later counts).
OWN_VARIANTS = ("entangled", "disentangled", "rope")
ATTENTION_KERNELS = KERNELS
# The kernels that fuse both passes: one bias per head and distance, no row axis (`biases.BiasScheme.per_row`).
FUSED_KERNELS = ("pallas", "pallas_tpu")
ABSOLUTE_EMBEDDINGS = ("learned", "sinusoidal")
POS_ATT_TYPES = ("c2p", "p2c")
NORM_REL_EBD = ("none", "layer_norm")
ABSOLUTE_POSITION_POLICIES = ("strict", "untrained", "clip", "interpolate")
DTYPES = ("float32", "bfloat16")
ACTIVATIONS = ("gelu", "gelu_new", "relu")
LAYER_NORM_PLACEMENTS = ("post", "pre")
# Rematerialization of each layer's activations in the backward pass (`jax.checkpoint`), by what is kept:
# "none" keeps everything, "full" only each layer's input, "dots" every matmul output, "dots_no_batch" the
# matmuls without batch dimensions (the projections and the MLP, not the attention scores). The names are
# those of `jax.checkpoint_policies`.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
# Fields that change how the parameters are computed with, not what they are: a checkpoint written under one
# value loads under any other (`encoder.with_options`, resuming a run with another kernel or remat policy).
COMPUTATION_FIELDS = ("attention_kernel", "attention_block_size", "remat", "scan_layers", "relative_terms")
# Fields a trained model can be run under with other values, its parameters unchanged (`ModelConfig.with_options`):
# the computation fields, and what happens to positions past the training length.
OPTION_FIELDS = COMPUTATION_FIELDS + ("absolute_position_policy", "clamp_relative_positions", "attention_temperature",
                                      "attention_window", "window_global_tokens", "relative_position_policy")
# How the dense kernel computes DeBERTa's c2p / p2c terms (`kernels.scores`): "gather" reads each (i, j) pair's
# entry from the products with the reachable relative rows; "shift" multiplies by the rows expanded per distance and
# shifts the result into place; "auto" is "shift" on TPU and GPU, "gather" on CPU (`relative_terms_for`).
RELATIVE_TERMS = ("auto", "gather", "shift")
# What the relative schemes do with distances past the training length (`ModelConfig.distance_scale`).
RELATIVE_POSITION_POLICIES = ("exact", "interpolate")
# Attention temperature as a function of how many keys a query sees (`ModelConfig.attention_temperature`).
ATTENTION_TEMPERATURES = ("none", "log_length", "learned", "learned_rate")
# The temperatures with a parameter per head and layer (`positions.learned_temperature`): models, not options.
LEARNED_TEMPERATURES = ("learned", "learned_rate")
# How a query's scores become weights of its keys (`ModelConfig.attention_weights`).
ATTENTION_WEIGHTS = ("softmax", "sigmoid")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the fix."""


def _fail(field: str, value: Any, fix: str) -> None:
    raise ConfigError(f"model.{field}={value!r} is invalid: {fix}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and position scheme of a masked-LM encoder.

    `attention` is the attention *variant* (how scores are made; the kernel that weighs the keys is shared):
      - "entangled": BERT's single dot product; positions reach attention only through the input
        (`position_biased_input=True` gives BERT). With `position_biased_input=False` the encoder has
        no position information at all ("NoPE", the floor of the comparison): it is permutation-
        equivariant, so only bag-of-words cues remain for the MLM;
      - "disentangled": DeBERTa's content-to-content plus the relative terms listed in `pos_att_type`;
      - "rope": the dot product of queries and keys rotated by their positions (Su et al.), base
        `rope_theta`;
      - a registered bias scheme (`deberta_jax.model.biases.SCHEMES`, listed in docs/models.md): the dot product
        plus the scheme's bias per distance, e.g. "alibi" (`-m_h * |i - j|`, ALiBi made symmetric for a
        bidirectional encoder, Press et al. 2022), "t5_bias" (a learned per-head bias for T5's bidirectional log
        buckets of `i - j`, `t5_num_buckets`, `t5_max_distance`; Raffel et al.; one table shared by all layers) or
        "kerple_log" (KERPLE's `-r1_h * log(1 + r2_h * |i - j|)`, Chi et al. 2022).
    Every variant can be combined with absolute positions at the input (`position_biased_input`), and every variant
    that is not itself a bias scheme with one bias scheme added to its scores (`score_bias`, "none" by default):
    DeBERTa with KERPLE's log decay is `attention="disentangled", score_bias="kerple_log"`.

    `attention_weights` is how a query's scores become the weights of its keys: "softmax" (every published model)
    normalizes them over the keys, so each key a longer sequence adds takes weight from the others; "sigmoid"
    weighs each key by `sigmoid(s_ij - log L)` on its own (sigmoid attention, Ramapuram et al. 2024, whose bias
    `-log n` is fixed here at the training length L, so the bias does not move with the evaluation length). A key's
    weight then depends on its own score only: keys past L cannot dilute the weights of those within L, and add
    to the output only the weight their scores (a distance decay's, `score_bias="kerple_log"`) leave them. On a
    row of L keys scoring 0 the weights sum to `L / (L + 1)`, about the softmax's 1. It is part
    of the model (a trained model keeps it), carried by the dense and blockwise kernels only.

    `attention_kernel` is how any variant's scores become outputs (`deberta_jax.kernels`): "dense"
    materializes `[B, H, N, N]` scores (fastest while they fit), "blockwise" runs an online softmax
    over blocks of `attention_block_size` keys in memory linear in N (evaluation at 8k+ tokens),
    "cudnn" is `jax.nn.dot_product_attention` (cuDNN's fused kernel on GPUs; BERT's anchor: no position terms in
    the scores, no attention dropout), "pallas" and "pallas_tpu" fuse both passes into kernels for GPUs
    (`deberta_jax.kernels.pallas`, Triton) and TPUs (`deberta_jax.kernels.pallas_tpu`, Mosaic), interpreted
    elsewhere; both carry every variant, attention dropout, the temperature and the window with its global tokens.
    All give the same results to float rounding and load the same parameters, so a model trained with one can be
    evaluated with another.
    Knobs of other variants are ignored and not validated (the DeBERTa ones keep their defaults in a
    BERT config); switches that would silently do nothing (`absolute_embedding`, `randomized_positions`
    without any absolute positions or RoPE to act on) are rejected.

    `absolute_embedding` chooses the absolute positions added at the input (and read by EMD):
    "learned" is a `max_position_embeddings`-row table; "sinusoidal" is Vaswani et al.'s fixed
    encoding, defined at every position, so no table exists and `absolute_position_policy` is moot.

    Relative-position knobs (`position_buckets`, `max_relative_positions`, `share_att_key`,
    `norm_rel_ebd`) follow transformers' DebertaV2Config names so checkpoints map one to one.
    `clamp_relative_positions=True` (our default) clamps `i - j` to `+-(max_relative_positions - 1)`
    before bucketing, so every distance, however long the sequence, reads a trained row of the relative
    table. With log buckets (`position_buckets > 0`) that is what the official microsoft/DeBERTa code does
    (inside its bucketing); without buckets the official code does not clamp, so there the clamp is this
    project's own option. False reproduces transformers (and the official code without buckets), which
    reads table row 0 (never trained) for `j - i >= max_relative_positions`.

    `absolute_position_policy` says what the learned absolute table (BERT's input table, DeBERTa's EMD
    table) does at positions `>= trained_length`: "strict" raises, "untrained" reads the rows that
    exist past the training length (error past the table), "clip" repeats the last trained row,
    "interpolate" stretches the trained rows over the longer sequence.

    `remat` and `scan_layers` trade compute and compile time for memory without changing a result: `remat`
    recomputes each layer's activations in the backward pass instead of keeping them (`REMAT_POLICIES` says what
    each policy keeps), and `scan_layers` runs the identical layers as one `lax.scan` over their stacked
    parameters, so XLA compiles one layer instead of `num_layers` (faster compiles of deep models). Remat implies
    the scan: unrolled, XLA hoists every layer's recomputation to the start of the backward pass and the saving
    vanishes (a 12-layer encoder's gradient on CPU: 2.6 GB of temporaries with or without remat unrolled, 0.40 GB
    with 'full' in a scan). Parameters stay one subtree per layer either way, so checkpoints interchange between
    every setting.

    `relative_terms` is how the dense kernel computes DeBERTa's c2p and p2c (`RELATIVE_TERMS`): the same values
    to float rounding, by gathers or by matrix products and a relative shift. The model resolves "auto" for the
    backend it is traced on (`relative_terms_for`); compiling for another target (`deberta_jax.aot`) sets it.

    Three options change what attention does past the training length `L` (`effective_trained_length`), and
    leave every sequence of up to `L` tokens exactly as it was:
      - `attention_temperature="log_length"` multiplies every score of query i (the bias included) by
        `max(1, log(n_i) / log(L))`, `n_i` the number of real keys it may attend to (within `attention_window`
        when set): the "log-n" scaling that keeps the entropy of a softmax over n keys from growing with n
        (Chiang and Cholak 2022; Scalable-Softmax, Nakanishi 2025, with a fixed rather than learned slope). The
        floor at 1 keeps the scores of rows up to `L` tokens, so a model trains identically with or without it
        and evaluates identically at 1x; it is set in training only so the run's config carries it.
        `"learned"` is Scalable-Softmax's own form, a model of its own rather than an option: query i's scores in
        head h are multiplied by `s_h * log(n_i)`, `s_h` a parameter of every layer, trained from the first step
        (initialised to `1 / log(L)`, so a fresh model scores rows of L tokens as one without it). It has no floor:
        at lengths below L the factor falls below 1, as in the paper. Its growth with the number of keys is not
        learned, though: `log(n) / log(L)` from L to n keys whatever `s_h` is, which only scales the head's scores
        alike, as the projections can. `"learned_rate"` learns that growth: the factor is `1 + r_h * log(n_i / L)`,
        1 at L keys whatever `r_h` is, and `r_h` (initialised to `1 / log(L)`, so a fresh model is the fixed
        "log_length" without its floor) gets a gradient only from rows whose key count differs from L, so it is
        trained by the mixed row lengths of `deberta_jax.data.row_lengths` and stays where it started on rows
        of L.
      - `attention_window=W` (0: every key) lets each query attend only to the W consecutive positions around
        it, centered (`W // 2` before it) and shifted at either end of the row so that every query of a row of
        at least W positions sees exactly W of them: sliding-window evaluation (LeX, Sun et al. 2023), which at
        `W = L` never shows a model a distance or a key count it was not trained on, and equals full attention
        on rows of up to W tokens.
      - `relative_position_policy="interpolate"` multiplies every distance `i - j` by `L / N` on a sequence of
        `N > L` tokens, rounded to an integer before DeBERTa's log-bucketing and T5's buckets, unrounded for
        ALiBi's slopes and RoPE's angles (position interpolation, Chen et al. 2023): a longer sequence spans
        the distances of the training length, at a finer grain. "exact" keeps the distances as they are.
    None of them changes a parameter, so `encoder.with_options` sets them on a trained model.

    `layer_norm_placement` is where each layer normalizes: "post" (BERT and DeBERTa as published, so
    their checkpoints load) normalizes after each residual add; "pre" (Xiong et al. 2020) normalizes each
    sub-layer's input and the final output, leaving the residual stream unnormalized, which trains
    without a long warm-up plateau at small scale. It applies to every attention variant alike.

    `randomized_positions` (Ruoss et al. 2023) is a training-time option for the absolute schemes and
    RoPE: when the model is called with `rngs` (training), each sequence's N positions are an ordered
    random sample of `range(random_position_max)` drawn from the `dropout` stream (so a run resumed
    with the same keys draws the same positions); without `rngs` (evaluation) they are `0..N-1`. The
    relative schemes (disentangled, the bias schemes) always see true distances. Since training then reaches
    every row below `random_position_max`, that, not `trained_length`, is where the absolute policy
    starts (`trained_positions`).
    """

    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 1024
    hidden_act: str = "gelu"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-7
    initializer_range: float = 0.02
    type_vocab_size: int = 0
    layer_norm_placement: str = "post"

    attention: str = "disentangled"
    attention_kernel: str = "dense"
    attention_block_size: int = 512
    position_biased_input: bool = False
    max_position_embeddings: int = 512
    trained_length: int | None = None
    absolute_position_policy: str = "strict"
    absolute_embedding: str = "learned"
    randomized_positions: bool = False
    random_position_max: int = 512

    rope_theta: float = 10000.0
    t5_num_buckets: int = 32
    t5_max_distance: int = 128
    score_bias: str = "none"

    pos_att_type: tuple[str, ...] = ("c2p", "p2c")
    position_buckets: int = 256
    max_relative_positions: int = 512
    share_att_key: bool = True
    norm_rel_ebd: str = "layer_norm"
    clamp_relative_positions: bool = True

    use_emd: bool = False
    emd_layers: int = 2

    dtype: str = "float32"
    remat: str = "none"
    scan_layers: bool = False
    relative_terms: str = "auto"
    attention_temperature: str = "none"
    attention_window: int = 0
    window_global_tokens: bool = False
    relative_position_policy: str = "exact"
    attention_weights: str = "softmax"

    def __post_init__(self):
        # Accept lists and "c2p|p2c" strings (transformers' spelling) but store a sorted tuple so
        # configs that mean the same thing compare and hash equal.
        pos = self.pos_att_type
        if isinstance(pos, str):
            pos = [p for p in pos.lower().split("|") if p.strip()]
        object.__setattr__(self, "pos_att_type", tuple(sorted(p.strip() for p in pos)))
        self._validate()

    # ------------------------------------------------------------------ derived values
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def relative_span(self) -> int:
        """k: the relative table has 2k rows (k = buckets, or max_relative_positions without them)."""
        return self.position_buckets if self.position_buckets > 0 else self.max_relative_positions

    @property
    def uses_absolute_positions(self) -> bool:
        """Absolute positions enter the model: added at the input, or before the MLM head (EMD)."""
        return self.position_biased_input or self.use_emd

    @property
    def uses_absolute_table(self) -> bool:
        return self.uses_absolute_positions and self.absolute_embedding == "learned"

    @property
    def effective_trained_length(self) -> int:
        return self.trained_length if self.trained_length is not None else self.max_position_embeddings

    @property
    def bias_scheme(self) -> str | None:
        """The registered bias scheme the scores add (`biases.SCHEMES`): the variant's own or `score_bias`."""
        if self.attention in SCHEMES:
            return self.attention
        return None if self.score_bias == "none" else self.score_bias

    @property
    def sigmoid_bias(self) -> float | None:
        """The bias every score gets under sigmoid weights, `-log L` (`attention_weights`); None under a softmax."""
        return -math.log(self.effective_trained_length) if self.attention_weights == "sigmoid" else None

    @property
    def uses_distances(self) -> bool:
        """Relative distances enter the scores (DeBERTa's terms, RoPE's angles, a bias): what
        `relative_position_policy` scales."""
        return self.attention != "entangled" or self.bias_scheme is not None

    @property
    def trained_positions(self) -> int:
        """Absolute positions `0..trained_positions-1` that training reaches (where the policy starts)."""
        return self.random_position_max if self.randomized_positions else self.effective_trained_length

    def with_options(self, **fields) -> ModelConfig:
        """This config with `OPTION_FIELDS` replaced (validated again): the one way loading a checkpoint or a trained
        model changes its config. Any other field would change the parameters, and is refused naming it."""
        other = sorted(set(fields) - set(OPTION_FIELDS))
        if other:
            raise ConfigError(f"model field(s) {other} cannot be changed on a trained model: they change its "
                              f"parameters; only {list(OPTION_FIELDS)} can")
        new = fields.get("attention_temperature", self.attention_temperature)
        learned = {new, self.attention_temperature} & set(LEARNED_TEMPERATURES)
        if learned and new != self.attention_temperature:
            raise ConfigError(f"model.attention_temperature cannot change from {self.attention_temperature!r} to "
                              f"{new!r} on a trained model: a learned temperature is a parameter of every layer")
        return dataclasses.replace(self, **fields)

    def distance_scale(self, seq_len: int) -> float:
        """The factor on every relative distance (`relative_position_policy`): `L / N` when interpolating a
        sequence of `N > L` tokens, else 1."""
        trained = self.effective_trained_length
        if self.relative_position_policy == "interpolate" and seq_len > trained:
            return trained / seq_len
        return 1.0

    def relative_terms_for(self, backend: str) -> str:
        """`relative_terms` resolved for a backend ("cpu", "gpu", "tpu"): "auto" is "gather" on CPU, where it is
        the faster of the two (benchmarks/README.md), and "shift" elsewhere, where the gathers leave the matrix
        unit idle. Only the dense kernel uses it; the blockwise kernels gather near the diagonal only."""
        if self.relative_terms != "auto":
            return self.relative_terms
        return "gather" if backend == "cpu" else "shift"

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        self._validate_shape()
        self._validate_attention()
        self._validate_positions()
        self._validate_length_options()
        self._validate_computation()

    def _validate_shape(self) -> None:
        """Sizes, activation, normalization, dropout rates, token types and precision."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
            if int(getattr(self, name)) < 1:
                _fail(name, getattr(self, name), "must be a positive integer")
        if self.hidden_size % self.num_heads:
            _fail("num_heads", self.num_heads,
                  f"must divide hidden_size={self.hidden_size}; pick a divisor such as "
                  f"{[h for h in (1, 2, 4, 8, 12, 16) if self.hidden_size % h == 0]}")
        if self.hidden_act not in ACTIVATIONS:
            _fail("hidden_act", self.hidden_act, f"choose one of {ACTIVATIONS}")
        if self.layer_norm_placement not in LAYER_NORM_PLACEMENTS:
            _fail("layer_norm_placement", self.layer_norm_placement,
                  f"choose one of {LAYER_NORM_PLACEMENTS} ('post' as in BERT/DeBERTa, 'pre' as in Xiong et al.)")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(name, getattr(self, name), "must be in [0, 1)")
        if self.type_vocab_size < 0:
            _fail("type_vocab_size", self.type_vocab_size, "must be >= 0 (0 disables token types)")
        if self.dtype not in DTYPES:
            _fail("dtype", self.dtype, f"choose one of {DTYPES}")

    def _validate_attention(self) -> None:
        """The attention variant, its kernel and each variant's own knobs."""
        if self.attention not in (*OWN_VARIANTS, *SCHEMES):
            _fail("attention", self.attention, f"choose one of {(*OWN_VARIANTS, *SCHEMES)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            _fail("attention_kernel", self.attention_kernel, f"choose one of {ATTENTION_KERNELS}")
        if self.score_bias != "none" and self.score_bias not in SCHEMES:
            _fail("score_bias", self.score_bias, f"choose 'none' or one of {tuple(SCHEMES)}")
        if self.attention in SCHEMES and self.score_bias != "none":
            _fail("score_bias", self.score_bias,
                  f"attention={self.attention!r} already adds its own bias; set score_bias='none', or add "
                  f"{self.score_bias!r} to attention='entangled' (the same dot product)")
        if self.attention_kernel == "cudnn" and (self.attention not in ("entangled", "rope") or self.attention_window
                                                 or self.attention_temperature != "none"
                                                 or self.bias_scheme is not None):
            _fail("attention_kernel", self.attention_kernel,
                  f"scores queries against keys only (BERT, NoPE, RoPE), without a window or temperature, but "
                  f"attention={self.attention!r} with score_bias={self.score_bias!r}; use 'pallas' on GPUs, or "
                  "'dense' or 'blockwise'")
        if self.attention_kernel in FUSED_KERNELS and self.bias_scheme and SCHEMES[self.bias_scheme].per_row:
            _fail("attention_kernel", self.attention_kernel,
                  f"carries one bias per head and distance, and the bias scheme {self.bias_scheme!r} has one per row "
                  "(BiasScheme.per_row); use attention_kernel='dense' or 'blockwise'")
        if self.attention_weights not in ATTENTION_WEIGHTS:
            _fail("attention_weights", self.attention_weights, f"choose one of {ATTENTION_WEIGHTS}")
        if self.attention_weights != "softmax" and self.attention_kernel not in SIGMOID_KERNELS:
            _fail("attention_kernel", self.attention_kernel,
                  f"normalizes scores with a softmax only, and attention_weights={self.attention_weights!r}; use "
                  f"one of {SIGMOID_KERNELS}")
        if self.attention_block_size < 1:
            _fail("attention_block_size", self.attention_block_size,
                  "must be a positive integer (keys per block of the blockwise kernel, e.g. 512)")
        if self.attention == "rope":
            if self.head_dim % 2:
                _fail("num_heads", self.num_heads,
                      f"attention='rope' rotates pairs of features and needs an even head_dim, but "
                      f"hidden_size={self.hidden_size} / num_heads={self.num_heads} = {self.head_dim}; "
                      "change num_heads or hidden_size")
            if not self.rope_theta > 0:
                _fail("rope_theta", self.rope_theta, "must be > 0 (10000 in Su et al.)")
        if self.bias_scheme == "t5_bias":
            if self.t5_num_buckets < 4 or self.t5_num_buckets % 2:
                _fail("t5_num_buckets", self.t5_num_buckets,
                      "must be an even integer >= 4 (half the buckets per direction; T5 uses 32)")
            if self.t5_max_distance <= self.t5_num_buckets // 4:
                _fail("t5_max_distance", self.t5_max_distance,
                      f"must exceed t5_num_buckets // 4 = {self.t5_num_buckets // 4}, the last exactly "
                      "bucketed distance (T5 uses 128)")
        unknown = [p for p in self.pos_att_type if p not in POS_ATT_TYPES]
        if unknown or len(set(self.pos_att_type)) != len(self.pos_att_type):
            _fail("pos_att_type", self.pos_att_type,
                  f"use a subset of {POS_ATT_TYPES} without repeats, e.g. ('c2p', 'p2c') or ('c2p',)")
        if self.norm_rel_ebd not in NORM_REL_EBD:
            _fail("norm_rel_ebd", self.norm_rel_ebd, f"choose one of {NORM_REL_EBD}")
        if self.attention == "disentangled":
            if self.max_relative_positions < 1:
                _fail("max_relative_positions", self.max_relative_positions, "must be >= 1")
            if self.position_buckets < 0 or self.position_buckets == 1:
                _fail("position_buckets", self.position_buckets,
                      "use 0 (no log-bucketing) or an integer >= 2")
            if self.position_buckets > 0 and self.max_relative_positions <= self.position_buckets // 2 + 1:
                _fail("max_relative_positions", self.max_relative_positions,
                      f"must exceed position_buckets // 2 + 1 = {self.position_buckets // 2 + 1} "
                      "for log-bucketing to be defined")

    def _validate_positions(self) -> None:
        """Absolute positions: the table, its policy past the training length, randomized positions, EMD."""
        if self.max_position_embeddings < 1:
            _fail("max_position_embeddings", self.max_position_embeddings, "must be >= 1")
        if self.trained_length is not None and not 1 <= self.trained_length <= self.max_position_embeddings:
            _fail("trained_length", self.trained_length,
                  f"must be in [1, max_position_embeddings={self.max_position_embeddings}]")
        if self.absolute_position_policy not in ABSOLUTE_POSITION_POLICIES:
            _fail("absolute_position_policy", self.absolute_position_policy,
                  f"choose one of {ABSOLUTE_POSITION_POLICIES}")
        if self.absolute_embedding not in ABSOLUTE_EMBEDDINGS:
            _fail("absolute_embedding", self.absolute_embedding, f"choose one of {ABSOLUTE_EMBEDDINGS}")
        if self.absolute_embedding == "sinusoidal":
            if not self.uses_absolute_positions:
                _fail("absolute_embedding", self.absolute_embedding,
                      "has no effect without absolute positions; set position_biased_input=True "
                      "(or use_emd=True), or leave it 'learned'")
            if self.hidden_size % 2:
                _fail("absolute_embedding", self.absolute_embedding,
                      f"sinusoidal encodings come in sin/cos pairs and need an even hidden_size, "
                      f"got {self.hidden_size}")
        if self.randomized_positions:
            if not (self.uses_absolute_positions or self.attention == "rope"):
                _fail("randomized_positions", self.randomized_positions,
                      "randomizes absolute positions (position_biased_input=True or use_emd=True) or "
                      "RoPE (attention='rope'), and this config has neither; enable one or set it False")
            if self.random_position_max < 1:
                _fail("random_position_max", self.random_position_max, "must be >= 1")
            if self.uses_absolute_table and self.random_position_max > self.max_position_embeddings:
                _fail("random_position_max", self.random_position_max,
                      f"must be <= max_position_embeddings={self.max_position_embeddings}, the rows of "
                      "the learned absolute table; lower it or enlarge max_position_embeddings")
            if self.trained_length is not None and self.random_position_max < self.trained_length:
                _fail("random_position_max", self.random_position_max,
                      f"must be >= trained_length={self.trained_length} to sample that many distinct "
                      "positions per sequence")
        if self.use_emd:
            if self.position_biased_input:
                _fail("use_emd", self.use_emd,
                      "EMD adds absolute positions before the MLM head and is only defined with "
                      "position_biased_input=False (as in microsoft/DeBERTa)")
            if self.emd_layers < 1:
                _fail("emd_layers", self.emd_layers, "must be >= 1")

    def _validate_length_options(self) -> None:
        """Temperature, window and distance interpolation past the training length, and what the kernel supports."""
        if self.attention_temperature not in ATTENTION_TEMPERATURES:
            _fail("attention_temperature", self.attention_temperature, f"choose one of {ATTENTION_TEMPERATURES}")
        if self.attention_temperature != "none" and self.effective_trained_length < 2:
            _fail("attention_temperature", self.attention_temperature,
                  "divides by log(trained_length), which needs trained_length >= 2")
        if self.window_global_tokens and not self.attention_window:
            _fail("window_global_tokens", self.window_global_tokens,
                  "keeps a row's first and last tokens visible to every query of a window; set attention_window too")
        if self.attention_window < 0 or self.attention_window == 1:
            _fail("attention_window", self.attention_window,
                  "use 0 (every key) or the number of positions each query sees, >= 2 (e.g. the training length)")
        if self.relative_position_policy not in RELATIVE_POSITION_POLICIES:
            _fail("relative_position_policy", self.relative_position_policy,
                  f"choose one of {RELATIVE_POSITION_POLICIES}")
        if self.relative_position_policy == "interpolate" and not self.uses_distances:
            _fail("relative_position_policy", self.relative_position_policy,
                  "scales relative distances, and attention='entangled' has none; for a learned absolute table "
                  "use absolute_position_policy='interpolate'")

    def _validate_computation(self) -> None:
        """How the parameters are computed with: DeBERTa's relative terms, rematerialization."""
        if self.relative_terms not in RELATIVE_TERMS:
            _fail("relative_terms", self.relative_terms, f"choose one of {RELATIVE_TERMS}")
        if self.remat not in REMAT_POLICIES:
            _fail("remat", self.remat,
                  f"choose one of {REMAT_POLICIES} ('full' keeps least, 'none' recomputes nothing)")

    # ------------------------------------------------------------------ conversion
    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> ModelConfig:
        """Build from a plain mapping (e.g. `config.model.to_dict()`), rejecting unknown keys."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown model field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**dict(values))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["pos_att_type"] = list(self.pos_att_type)
        return d
