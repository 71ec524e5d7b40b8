"""Attention kernels: the blockwise kernel equals the dense one (outputs and gradients, every variant, padding,
lengths that are not a multiple of the block), draws dropout consistently in both passes and needs memory linear in
length; a model computes the same with each kernel. The fused kernels' own tests are in test_fused_kernels.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deberta_jax.kernels import blockwise, dispatch
from deberta_jax.kernels.dense import dense_attention
from deberta_jax.kernels.scores import (
    NEG_INF,
    RelativeIndex,
    ScoreTerms,
    banded_relative_terms,
    relative_terms,
    shifted_relative_terms,
    skew,
    toeplitz,
)
from deberta_jax.model import biases, positions
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM
from tests.helpers import bias_params

B, H, N, D, R = 2, 2, 37, 8, 12  # N is not a multiple of the block sizes below


def variant_inputs(variant, seed=0, n=N, d=D):
    """(terms, v, key_mask) for one variant at length `n`, head size `d`; row 1 of the batch ends in padding."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    terms = ScoreTerms(q=normal(B, H, n, d), k=normal(B, H, n, d), key_len=n)
    if variant in ("disentangled", "c2p_only"):
        rel_index = positions.relative_index_by_distance(n, n, position_buckets=R // 2, max_relative_positions=16)
        terms = dataclasses.replace(terms, c2p=normal(B, H, n, R), relative=RelativeIndex(rel_index),
                                    p2c=normal(B, H, n, R) if variant == "disentangled" else None)
    elif variant in biases.SCHEMES:
        cfg = ModelConfig(attention=variant, num_heads=H, hidden_size=H * d, t5_num_buckets=8, t5_max_distance=20)
        bias = biases.SCHEMES[variant].bias(bias_params(cfg, seed), cfg, n, 1.0, np.ones((B, n)))
        terms = dataclasses.replace(terms, bias=bias)
    key_mask = np.ones((B, n), np.int32)
    key_mask[1, 29:] = 0
    return terms, normal(B, H, n, d), jnp.asarray(key_mask)


def outputs_and_grads(kernel, terms, v, key_mask, **kw):
    cotangent = jnp.asarray(np.random.default_rng(9).normal(size=v.shape), jnp.float32)

    def loss(terms, v):
        out = kernel(terms, v, key_mask, **kw)
        return jnp.sum(out * cotangent), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(terms, v)
    return out, grads


def assert_trees_close(a, b, atol):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=1e-5)


VARIANTS = ["entangled", "disentangled", "c2p_only", *biases.SCHEMES]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_size", [8, 64])  # 37 keys = 4 blocks of 8 + 5; one block larger than N
def test_kernel_equals_dense_outputs_and_gradients(variant, block_size):
    inputs = variant_inputs(variant)
    dense_out, dense_grads = outputs_and_grads(dense_attention, *inputs)
    out, grads = outputs_and_grads(dispatch.attention_kernel("blockwise", block_size), *inputs)
    np.testing.assert_allclose(out, dense_out, atol=1e-5, rtol=1e-5)
    assert_trees_close(grads, dense_grads, atol=1e-5)


@pytest.mark.parametrize("terms", [("c2p", "p2c"), ("c2p",), ("p2c",)])
def test_relative_terms_hand_written_gradient_equals_autodiff(terms):
    # A static index (dense kernel) takes the custom VJP; a traced one (blockwise) is differentiated
    # by JAX. Non-square, so that query and key rows cannot be confused.
    n_q, n_k = 9, 13
    rel_index = positions.relative_index_by_distance(n_q, n_k, position_buckets=4, max_relative_positions=8)
    index = toeplitz(rel_index - rel_index.min(), np.arange(n_q), np.arange(n_k), n_k)
    rng = np.random.default_rng(4)
    tables = {"c2p": (B, H, n_q, 8), "p2c": (B, H, n_k, 8)}
    args = {name: jnp.asarray(rng.normal(size=tables[name]), jnp.float32) for name in terms}
    cotangent = jnp.asarray(rng.normal(size=(B, H, n_q, n_k)), jnp.float32)

    def loss(args, index):
        return jnp.sum(relative_terms(args.get("c2p"), args.get("p2c"), index) * cotangent)
    static = jax.grad(loss)(args, index)
    traced = jax.jit(jax.grad(loss))(args, jnp.asarray(index))
    assert set(static) == set(terms)
    for name in terms:
        np.testing.assert_allclose(static[name], traced[name], atol=1e-5)


def test_skew_lays_each_distance_under_its_pair():
    n = 6
    per_distance = np.arange(3 * n * (2 * n - 1), dtype=np.float32).reshape(3, n, 2 * n - 1)
    want = np.stack([[per_distance[b, i, j - i + n - 1] for i in range(n) for j in range(n)] for b in range(3)])
    np.testing.assert_array_equal(skew(jnp.asarray(per_distance)), want.reshape(3, n, n))


@pytest.mark.parametrize("terms", [("c2p", "p2c"), ("c2p",), ("p2c",)])
@pytest.mark.parametrize("buckets,max_distance,clamp", [(8, 16, True), (8, 16, False), (0, 6, True), (0, 6, False),
                                                        (4, 40, True)])
def test_shifted_relative_terms_equal_the_gathers(terms, buckets, max_distance, clamp):
    """The per-distance products and the shift give `relative_terms`' values and gradients (to float rounding) for
    every bucket setting, both terms and each alone; 37 tokens reach past every table here."""
    rel_index = positions.relative_index_by_distance(N, N, position_buckets=buckets,
                                                     max_relative_positions=max_distance, clamp=clamp)
    rows = int(rel_index.max()) + 1
    rng = np.random.default_rng(5)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    q, k, pos_key, pos_query = normal(B, H, N, D), normal(B, H, N, D), normal(H, rows, D), normal(H, rows, D)
    pos_key, pos_query = (pos_key if "c2p" in terms else None), (pos_query if "p2c" in terms else None)
    cotangent = normal(B, H, N, N)

    def shifted(q, k, pos_key, pos_query):
        return shifted_relative_terms(q, k, pos_key, pos_query, rel_index)

    def gathered(q, k, pos_key, pos_query):
        c2p = None if pos_key is None else jnp.einsum("bhid,hrd->bhir", q, pos_key)
        p2c = None if pos_query is None else jnp.einsum("bhjd,hrd->bhjr", k, pos_query)
        return relative_terms(c2p, p2c, toeplitz(rel_index, np.arange(N), np.arange(N), N))

    args = (q, k, pos_key, pos_query)
    np.testing.assert_allclose(jax.jit(shifted)(*args), jax.jit(gathered)(*args), rtol=0, atol=1e-5)
    grad = lambda f: jax.grad(lambda *a: jnp.sum(f(*a) * cotangent), argnums=(0, 1, 2, 3))(*args)  # noqa: E731
    assert_trees_close(grad(shifted), grad(gathered), atol=1e-4)  # sums of up to 37 * 37 products


@pytest.mark.parametrize("clamp", [True, False])
@pytest.mark.parametrize("start", [0, 40, 134])  # a block at the left edge, inside, and the ragged last one
def test_banded_relative_terms_equal_the_full_gather(clamp, start):
    # 150 queries against 16 keys with a table trained at 16: the index is constant past |i - j| ~ 15
    # (clamped, or clipped as in transformers), so only a band of queries is gathered.
    n, block = 150, 16
    rel_index = positions.relative_index_by_distance(n, n, position_buckets=8, max_relative_positions=16, clamp=clamp)
    rng = np.random.default_rng(1)
    c2p, p2c = (jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in [(2, 2, n, 16), (2, 2, block, 16)])
    key_positions = np.minimum(start + np.arange(block), n - 1)
    full = relative_terms(c2p, p2c, toeplitz(rel_index, np.arange(n), key_positions, n))
    banded = jax.jit(lambda kp: banded_relative_terms(c2p, p2c, rel_index, kp, n))(jnp.asarray(key_positions))
    np.testing.assert_allclose(banded, full, atol=1e-6)


def test_kernel_equals_dense_far_past_the_relative_table():
    # Long sequence, short table: blockwise blocks use the banded gather; outputs and gradients still match.
    n = 150
    rng = np.random.default_rng(2)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)  # noqa: E731
    rel_index = positions.relative_index_by_distance(n, n, position_buckets=8, max_relative_positions=16)
    terms = ScoreTerms(q=normal(1, 2, n, D), k=normal(1, 2, n, D), c2p=normal(1, 2, n, 15), p2c=normal(1, 2, n, 15),
                       relative=RelativeIndex(rel_index - rel_index.min()), key_len=n)
    key_mask = jnp.asarray((np.arange(n) < 141)[None].astype(np.int32))
    inputs = (terms, normal(1, 2, n, D), key_mask)
    dense_out, dense_grads = outputs_and_grads(dense_attention, *inputs)
    out, grads = outputs_and_grads(dispatch.attention_kernel("blockwise", 16), *inputs)
    np.testing.assert_allclose(out, dense_out, atol=1e-5, rtol=1e-5)
    assert_trees_close(grads, dense_grads, atol=1e-5)


def test_blockwise_bfloat16_is_close_to_dense():
    # bfloat16 inputs: scores and softmax in float32 in both kernels, gradients of the shared inputs
    # accumulated over blocks in float32.
    terms, v, key_mask = variant_inputs("disentangled")
    terms, v = jax.tree.map(lambda x: x.astype(jnp.bfloat16), (terms, v))
    dense_out, dense_grads = outputs_and_grads(dense_attention, terms, v, key_mask)
    block_out, block_grads = outputs_and_grads(blockwise.blockwise_attention, terms, v, key_mask, block_size=8)
    assert block_out.dtype == jnp.bfloat16
    to32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
    np.testing.assert_allclose(to32(block_out), to32(dense_out), atol=3e-2, rtol=3e-2)
    for got, want in zip(jax.tree.leaves(to32(block_grads)), jax.tree.leaves(to32(dense_grads))):
        np.testing.assert_allclose(got, want, atol=0.1, rtol=5e-2)


@pytest.mark.slow
def test_blockwise_dropout_is_dense_attention_with_the_blocks_masks():
    terms, v, key_mask = variant_inputs("disentangled")
    rate, size, key = 0.3, 8, jax.random.key(3)
    blocks = -(-N // size)
    keep = jnp.concatenate([blockwise.dropout_keep(key, b, (B, H, N, size), rate) for b in range(blocks)], -1)[..., :N]

    def reference(terms, v, key_mask):
        scores = jnp.where(key_mask[:, None, None, :] > 0, terms.scores(np.arange(N)), NEG_INF)
        probs = jnp.where(keep, jax.nn.softmax(scores, axis=-1) / (1 - rate), 0.0)
        return jnp.einsum("bhij,bhjd->bhid", probs, v)

    ref_out, ref_grads = outputs_and_grads(reference, terms, v, key_mask)
    out, grads = outputs_and_grads(blockwise.blockwise_attention, terms, v, key_mask,
                                   block_size=size, dropout_rate=rate, dropout_key=key)
    np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=1e-5)
    assert_trees_close(grads, ref_grads, atol=1e-5)
    assert not np.allclose(out, outputs_and_grads(blockwise.blockwise_attention, terms, v, key_mask,
                                                  block_size=size)[0], atol=1e-3)


@pytest.mark.parametrize("kernel", ["blockwise", "pallas"])
def test_fully_padded_row_matches_dense(kernel):
    # A row with no real key at all: every kernel averages every real-length key uniformly.
    terms, v, _ = variant_inputs("entangled")
    key_mask = jnp.zeros((B, N), jnp.int32)
    dense = dense_attention(terms, v, key_mask)
    np.testing.assert_allclose(dispatch.attention_kernel(kernel, 8)(terms, v, key_mask), dense, atol=1e-5)


MODEL = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
             hidden_dropout=0.0, attention_dropout=0.0, position_buckets=8, max_relative_positions=16)
MODELS = {
    "bert": dict(MODEL, attention="entangled", position_biased_input=True, max_position_embeddings=64),
    "deberta": dict(MODEL, attention="disentangled"),
    "deberta_emd_separate_keys": dict(MODEL, attention="disentangled", use_emd=True, share_att_key=False),
}


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["blockwise", "pallas"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_with_other_kernels_equals_dense(name, kernel):
    dense_cfg = ModelConfig(**MODELS[name])
    block_cfg = dataclasses.replace(dense_cfg, attention_kernel=kernel, attention_block_size=8)
    graphdef, params = nnx.split(MaskedLM(dense_cfg, rngs=nnx.Rngs(0)))
    block_graphdef = nnx.graphdef(MaskedLM(block_cfg, rngs=nnx.Rngs(0)))
    ids = np.random.default_rng(0).integers(0, 64, (2, 29)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, 20:] = 0

    def loss(params, graphdef):
        logits = nnx.merge(graphdef, params)(ids, mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask), logits

    (_, dense_logits), dense_grads = jax.value_and_grad(loss, has_aux=True)(params, graphdef)
    (_, block_logits), block_grads = jax.value_and_grad(loss, has_aux=True)(params, block_graphdef)
    np.testing.assert_allclose(block_logits, dense_logits, atol=1e-5, rtol=1e-5)
    assert_trees_close(block_grads, dense_grads, atol=1e-5)


def compiled_temp_bytes(kernel, n, **kw):
    """XLA's scratch memory for the forward and backward pass of one disentangled attention call."""
    rel_index = positions.relative_index_by_distance(n, n, position_buckets=32, max_relative_positions=64)
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    terms = ScoreTerms(q=spec(1, 2, n, 16), k=spec(1, 2, n, 16), c2p=spec(1, 2, n, 64), p2c=spec(1, 2, n, 64),
                       relative=RelativeIndex(rel_index), key_len=n)

    def loss(terms, v):
        return jnp.sum(kernel(terms, v, jnp.ones((1, n), jnp.int32), **kw))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(terms, spec(1, 2, n, 16)).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.slow
def test_blockwise_memory_is_linear_in_length():
    dense = compiled_temp_bytes(dense_attention, 2048)
    blocked = [compiled_temp_bytes(blockwise.blockwise_attention, n, block_size=128) for n in (1024, 2048)]
    assert dense > 8 * 2 * 2048 * 2048  # at least two [1, 2, N, N] float32 tensors
    assert blocked[1] < dense / 5  # measured: 17.7 MB against 134 MB
    assert blocked[1] < 2.5 * blocked[0]  # twice the length, about twice the memory


def test_kernel_is_validated_by_name():
    ModelConfig(attention_kernel="pallas")
    with pytest.raises(ConfigError, match="attention_kernel.*dense"):
        ModelConfig(attention_kernel="flash")
    with pytest.raises(ConfigError, match="attention_block_size"):
        ModelConfig(attention_kernel="blockwise", attention_block_size=0)


def test_cudnn_kernel_equals_dense_and_refuses_what_it_lacks():
    """The cuDNN anchor (`jax.nn.dot_product_attention`, XLA's implementation off a GPU) equals the dense kernel for
    queries and keys alone with right padding (a row's real keys first, as packed rows are); it refuses position
    terms in the scores, and attention dropout, naming the fix."""
    terms, v, key_mask = variant_inputs("entangled")
    kernel = dispatch.attention_kernel("cudnn", 8)
    out, grads = outputs_and_grads(kernel, terms, v, key_mask)
    want_out, want_grads = outputs_and_grads(dense_attention, terms, v, key_mask)
    np.testing.assert_allclose(out, want_out, atol=1e-5, rtol=1e-5)
    assert_trees_close(grads, want_grads, atol=1e-5)
    with pytest.raises(ValueError, match="'dense', 'blockwise' or 'pallas'"):
        kernel(variant_inputs("alibi")[0], v, key_mask)
    with pytest.raises(ValueError, match="attention_dropout=0"):
        kernel(terms, v, key_mask, dropout_rate=0.1, dropout_key=jax.random.key(0))
    with pytest.raises(ConfigError, match="attention_kernel='cudnn'.*attention='disentangled'"):
        ModelConfig(attention="disentangled", attention_kernel="cudnn")
