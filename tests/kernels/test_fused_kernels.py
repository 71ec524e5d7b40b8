"""The fused kernels, for GPUs (`pallas`) and TPUs (`pallas_tpu`), interpreted on CPU, equal the dense kernel:
outputs and every gradient (queries, keys, values, both projected relative tables, a per-distance bias and T5's
table behind it, a temperature), c2p and p2c on and off, log buckets and exact distances, padding (right and left),
lengths that are not a multiple of the tile, far pairs whose boundary falls anywhere in a tile, float32 and bfloat16,
attention dropout (the dense kernel's mask at any tile size), a window (whose bands of tiles reach every windowed
pair) with its global keys; and the model computes the same with each. The FLOPs the TPU kernels report to XLA are
the products their traced bodies run. Compiling for TPUs is tested in test_pallas_tpu_compiles.py, for GPUs in
test_pallas_compiles.py, both kernels under a sharded batch in test_fused_kernels_sharded.py."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deberta_jax.kernels.dense import dense_attention
from deberta_jax.kernels.pallas import Launches, pallas_attention
from deberta_jax.kernels.pallas_tpu import expand_tables, pallas_tpu_attention
from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms, distances, in_window, saturation, window_starts
from deberta_jax.kernels.tiling import KernelShape
from deberta_jax.model import biases, positions
from deberta_jax.model.config import ModelConfig
from tests.helpers import bias_params
from tests.kernels.test_kernels import outputs_and_grads

B, H, D, R = 2, 2, 8, 12


def table_inputs(terms_on, buckets, n=37, seed=0, dtype=jnp.float32, b=B, h=H):
    """(terms, v, key_mask) with projected tables `[H, R, d]`; the last row of the batch ends in padding."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)  # noqa: E731
    rel = positions.relative_index_by_distance(n, n, position_buckets=buckets, max_relative_positions=R // 2 if
                                               not buckets else 16)
    terms = ScoreTerms(q=normal(b, h, n, D), k=normal(b, h, n, D), key_len=n)
    if terms_on:
        terms = dataclasses.replace(terms, relative=RelativeIndex(rel),
                                    pos_key=normal(h, R, D) if "c2p" in terms_on else None,
                                    pos_query=normal(h, R, D) if "p2c" in terms_on else None)
    key_mask = np.ones((b, n), np.int32)
    key_mask[-1, n - 8:] = 0
    return terms, normal(b, h, n, D), jnp.asarray(key_mask)


def max_error(a, b):
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


FUSED = {"pallas": pallas_attention, "pallas_tpu": pallas_tpu_attention}


@pytest.fixture(params=sorted(FUSED))
def kernel(request):
    """Each fused kernel: the GPU one and the TPU one, interpreted."""
    return FUSED[request.param]


def fused(kernel, **kw):
    """The kernel with `kw`, jitted: the interpreted tiles run as one compiled program, not op by op."""
    return jax.jit(functools.partial(kernel, **kw))


@pytest.mark.parametrize("terms_on,buckets", [
    (("c2p", "p2c"), R // 2),  # DeBERTa v2/v3: log buckets, clamped outermost rows
    (("c2p", "p2c"), 0),       # exact distances, clipped at max_relative_positions
    (("c2p",), R // 2),
    (("p2c",), R // 2),
    ((), 0),                   # no position terms: FlashAttention (BERT, NoPE, RoPE)
])
def test_equals_dense_kernel_outputs_and_gradients(kernel, terms_on, buckets):
    terms, v, key_mask = table_inputs(terms_on, buckets)
    # Tiles of 16 over 37 positions: three tiles, five diagonals, the last tile mostly padding.
    out, grads = outputs_and_grads(fused(kernel, tile=16), terms, v, key_mask)
    want_out, want_grads = outputs_and_grads(jax.jit(dense_attention), terms, v, key_mask)
    assert max_error(out, want_out) < 2e-6
    # Every leaf that gets a gradient: q, k, v and each table that is on (observed ~7e-7).
    assert len(jax.tree.leaves(grads)) == 3 + len(terms_on)
    assert max_error(grads, want_grads) < 3e-6


def test_the_tpu_tile_size():
    """Tiles of 128 (what Mosaic compiles), a length just past one tile: the strides of the lane rotation are
    those of the compiled kernel."""
    terms, v, key_mask = table_inputs(("c2p", "p2c"), R // 2, n=130, b=1, h=1)  # interpreted 128-row rotations: slow
    out, grads = outputs_and_grads(fused(pallas_tpu_attention), terms, v, key_mask)
    want_out, want_grads = outputs_and_grads(jax.jit(dense_attention), terms, v, key_mask)
    assert max_error(out, want_out) < 2e-6 and max_error(grads, want_grads) < 5e-6


def test_bfloat16_within_its_rounding(kernel):
    """bfloat16 inputs: the kernel's error against a float32 reference is of the order of the dense kernel's own
    (both round the products' inputs and the probabilities to bfloat16)."""
    terms16, v16, key_mask = table_inputs(("c2p", "p2c"), R // 2, dtype=jnp.bfloat16)
    terms32, v32 = jax.tree.map(lambda x: x.astype(jnp.float32), (terms16, v16))
    reference = outputs_and_grads(jax.jit(dense_attention), terms32, v32, key_mask)
    got = outputs_and_grads(fused(kernel, tile=16), terms16, v16, key_mask)
    dense = outputs_and_grads(jax.jit(dense_attention), terms16, v16, key_mask)
    assert got[0].dtype == jnp.bfloat16
    for part in (0, 1):
        assert max_error(got[part], reference[part]) < 2 * max_error(dense[part], reference[part]) + 1e-2


def test_expanded_tables_read_every_distance_in_place():
    """Row r of the forward layout is distance r - (padded - 1), of the reversed one padded - 1 - r; distances
    only padding reaches repeat the outermost real one."""
    n, tile = 5, 4
    by_distance = np.arange(2 * n - 1) * 10  # entry = 10 * (distance + n - 1)
    forward, reverse = expand_tables(by_distance, KernelShape(n, tile, divisor=1.0, c2p=True, p2c=True))
    padded = 8
    dist = np.clip(np.arange(2 * padded) - (padded - 1), -(n - 1), n - 1)
    np.testing.assert_array_equal(forward, (dist + n - 1) * 10)
    np.testing.assert_array_equal(reverse, ((np.clip(padded - 1 - np.arange(2 * padded), -(n - 1), n - 1)) + n - 1)
                                  * 10)
    assert len(distances(n, n)) == len(by_distance)


def test_refuses_what_it_does_not_implement(kernel):
    """The kernel reads DeBERTa's projected tables, not the c2p products (what the blockwise kernel takes)."""
    terms, v, key_mask = table_inputs(("c2p",), R // 2)
    products = dataclasses.replace(terms, c2p=jnp.einsum("bhid,hrd->bhir", terms.q, terms.pos_key), pos_key=None)
    with pytest.raises(ValueError, match="projected tables"):
        kernel(products, v, key_mask)


@pytest.mark.parametrize("name", sorted(FUSED))
def test_config_accepts_every_scheme_and_length_method_with_a_fused_kernel(name):
    for scheme in biases.SCHEMES:
        ModelConfig(attention=scheme, attention_kernel=name)
        ModelConfig(attention="disentangled", score_bias=scheme, attention_kernel=name)
    ModelConfig(attention_kernel=name, attention_window=16, attention_temperature="log_length", trained_length=16)
    ModelConfig(attention_kernel=name, attention_window=16, window_global_tokens=True)


@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("attention,options", [
    ("disentangled", dict(attention_temperature="log_length")),
    ("t5_bias", dict(attention_temperature="learned")),
    ("disentangled", dict(score_bias="kerple_log")),
    ("disentangled", dict(window_global_tokens=True)),
])
def test_model_with_a_fused_kernel_equals_the_dense_one(name, attention, options):
    """DeBERTa with EMD (re-applying its one layer), separate position projections and log buckets, and T5's bias
    (its table's gradient through the kernel's), training with dropout as published (0.1, attention and hidden; one
    dropout seed, so each attention call draws the same key with either kernel), with both length methods (a
    window of 24 over 40 tokens, with each row's ends as global keys or without; the log-length temperature of a
    model trained at 16, or a learned one, whose slope per head gets its gradient through the kernel's temperature
    gradient): logits and every parameter's gradient agree."""
    from flax import nnx

    from deberta_jax.model.encoder import MaskedLM
    base = dict(attention=attention, vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                max_position_embeddings=64, position_buckets=8, max_relative_positions=16, share_att_key=False,
                emd_layers=1, hidden_dropout=0.1, attention_dropout=0.1, attention_window=24, trained_length=16,
                **options)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 50, size=(2, 40)))
    mask = jnp.ones((2, 40), jnp.int32).at[1, 31:].set(0)
    results = []
    for kernel in ("dense", name):
        model = MaskedLM(ModelConfig(**base, attention_kernel=kernel), rngs=nnx.Rngs(params=3))
        graphdef, params = nnx.split(model)

        def loss(params, ids, mask, graphdef=graphdef):
            logits = nnx.merge(graphdef, params)(ids, mask, rngs=nnx.Rngs(dropout=4))
            return jnp.sum(jnp.sin(logits)), logits
        # Jitted: the same gradients, one compile instead of op-by-op dispatch of the interpreted kernel.
        (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, ids, mask)
        results.append((logits, grads))
    assert max_error(results[0][0], results[1][0]) < 1e-5
    # Per parameter, relative to its largest gradient entry (embedding gradients reach ~10; observed ~1e-6).
    for got, want in zip(jax.tree.leaves(results[1][1]), jax.tree.leaves(results[0][1])):
        assert max_error(got, want) <= 1e-5 * max(1.0, float(jnp.max(jnp.abs(want))))


def test_table_gradients_include_the_last_tile_pair_of_an_unpadded_last_sequence(kernel):
    """The head's table gradients accumulate over every sequence and tile pair and are written out at the head's
    last step: with a last sequence that ends in real tokens (only the first is padded), that last pair, the last
    query tile against the last key tile of the last sequence, has keys that get a gradient, so dropping its share
    shows. One head, tiles of 8 over 20 positions (the last tile half real)."""
    terms, v, _ = table_inputs(("c2p", "p2c"), R // 2, n=20, b=2, h=1)
    key_mask = jnp.ones((2, 20), jnp.int32).at[0, 13:].set(0)
    out, grads = outputs_and_grads(fused(kernel, tile=8), terms, v, key_mask)
    want_out, want_grads = outputs_and_grads(jax.jit(dense_attention), terms, v, key_mask)
    assert max_error(out, want_out) < 2e-6
    assert max_error(grads[0].pos_key, want_grads[0].pos_key) < 3e-6
    assert max_error(grads[0].pos_query, want_grads[0].pos_query) < 3e-6
    assert max_error(grads, want_grads) < 3e-6


@pytest.mark.parametrize("dtype,tolerance", [(jnp.float32, 3e-6), (jnp.bfloat16, None)])
def test_dropout_equals_the_dense_kernel_forward_and_backward(kernel, dtype, tolerance):
    """Attention dropout 0.3: the kernel drops the dense kernel's entries in the forward pass and regenerates them
    in the backward kernel, so outputs and every gradient agree (37 positions in tiles of 16, padding). bfloat16:
    within twice the dense kernel's own error against float32 (observed f32 max error ~1e-6)."""
    dropout = dict(dropout_rate=0.3, dropout_key=jax.random.key(5))
    terms, v, key_mask = table_inputs(("c2p", "p2c"), R // 2, dtype=dtype)
    got = outputs_and_grads(fused(kernel, tile=16, **dropout), terms, v, key_mask)
    dense = outputs_and_grads(jax.jit(functools.partial(dense_attention, **dropout)), terms, v, key_mask)
    assert len(jax.tree.leaves(got[1])) == 5
    if tolerance:
        assert max_error(got, dense) < tolerance
        undropped = jax.jit(dense_attention)(terms, v, key_mask)
        assert max_error(got[0], undropped) > 0.1
    else:
        reference = outputs_and_grads(jax.jit(functools.partial(dense_attention, **dropout)),
                                      *jax.tree.map(lambda x: x.astype(jnp.float32), (terms, v)), key_mask)
        for part in (0, 1):
            assert max_error(got[part], reference[part]) < 2 * max_error(dense[part], reference[part]) + 1e-2


def test_dropout_mask_does_not_depend_on_the_tile_size(kernel):
    """Tiles of 8 over 21 positions (3 x 3 tile pairs, where the test above has tiles of 16) draw the dense kernel's
    mask too: outputs and gradients agree with the same key."""
    dropout = dict(dropout_rate=0.2, dropout_key=jax.random.key(7))
    terms, v, key_mask = table_inputs(("c2p",), R // 2, n=21)
    want = outputs_and_grads(jax.jit(functools.partial(dense_attention, **dropout)), terms, v, key_mask)
    assert max_error(outputs_and_grads(fused(kernel, tile=8, **dropout), terms, v, key_mask), want) < 3e-6


def test_temperature_and_window_equal_the_dense_kernel(kernel):
    """A temperature per query shared by the heads (the log-length one's shape) and a window of 5 over 37 positions
    in tiles of 8 (a band of 3 key tiles of 5; the last tile ragged), with padding: outputs at real queries and every
    gradient, the temperature's included, equal the dense kernel's (observed ~2e-6, the temperature's). Padding
    queries get no cotangent: a window of 5 holds only padding for the last ones, whose outputs the two kernels
    average over different keys (the module's Scope). A temperature per head, with dropout and a bias, is tested
    below (`test_t5_table_gradient_with_every_option`)."""
    window = 5
    terms, v, key_mask = table_inputs(("c2p", "p2c"), R // 2)
    temperature = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2.0, (B, 1, 37, 1)), jnp.float32)
    terms = dataclasses.replace(terms, temperature=temperature, window=window)
    real = key_mask[:, None, :, None] > 0
    cotangent = jnp.where(real, jnp.asarray(np.random.default_rng(9).normal(size=v.shape), jnp.float32), 0.0)

    def outputs_and_grads(kernel):
        def loss(terms, v):
            out = kernel(terms, v, key_mask)
            return jnp.sum(out * cotangent), jnp.where(real, out, 0.0)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(terms, v)
    (_, out), grads = outputs_and_grads(functools.partial(kernel, tile=8))
    (_, want_out), want_grads = outputs_and_grads(dense_attention)
    assert KernelShape(37, 8, 1.0, True, True, window=window).key_band == 3
    assert max_error(out, want_out) < 2e-6
    assert grads[0].temperature.shape == temperature.shape
    assert max_error(grads, want_grads) < 1e-5


@pytest.mark.parametrize("length,tile,window", [(37, 8, 12), (37, 8, 5), (37, 8, 2), (40, 8, 17), (300, 16, 64),
                                                (129, 16, 128), (64, 16, 63)])
def test_window_bands_reach_every_pair_in_a_window(length, tile, window):
    """Each query tile's band of key tiles (forward, dq) holds every key its queries' windows reach, and each key
    tile's band of query tiles (dk/dv) every query whose window reaches its keys; bands stay inside the tiles."""
    shape = KernelShape(length, tile, 1.0, False, False, window=window)
    n = shape.num_tiles
    pairs = np.argwhere(in_window(length, length, window, np.arange(length)))
    queries, keys = pairs[:, 0] // tile, pairs[:, 1] // tile
    key_first = np.asarray([int(shape.key_tile(i, 0)) for i in range(n)])
    query_first = np.asarray([int(shape.query_tile(j, 0)) for j in range(n)])
    assert key_first.min() >= 0 and key_first.max() + shape.key_band <= n
    assert query_first.min() >= 0 and query_first.max() + shape.query_band <= n
    assert np.all((key_first[queries] <= keys) & (keys < key_first[queries] + shape.key_band))
    assert np.all((query_first[keys] <= queries) & (queries < query_first[keys] + shape.query_band))
    np.testing.assert_array_equal(shape.window_start(np.arange(length)), window_starts(length, length, window))


def test_windowed_tile_pairs_grow_as_length_times_window():
    """Tiles of 128 and a window of 64 (the 8x study's): 3 key tiles per query tile at any length, so the pairs
    visited (the grid, and the cost estimate's products) grow with N, not N^2; a window of 512 visits 5."""
    pairs = {n: KernelShape(n, 128, 1.0, True, True, window=64) for n in (2048, 16384)}
    assert [shape.key_band for shape in pairs.values()] == [3, 3]
    assert [shape.query_band for shape in pairs.values()] == [3, 3]
    assert KernelShape(16384, 128, 1.0, True, True, window=512).key_band == 5
    assert KernelShape(16384, 128, 1.0, True, True).key_band == 128


def check_every_option(attend, window):
    """`attend` (a fused kernel) with a window's global keys, DeBERTa's two position terms, T5's bias, a
    temperature per head and dropout 0.2 over 37 positions with padding, against the dense kernel: outputs at real
    queries and every gradient (observed up to 6e-6); and the global keys matter to the outputs."""
    terms, v, key_mask = table_inputs(("c2p", "p2c"), R // 2, b=4)
    key_mask = key_mask.at[2, 1:].set(0)
    temperature = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2.0, (4, H, 37, 1)), jnp.float32)
    terms = dataclasses.replace(terms, temperature=temperature, window=window)
    table = jnp.asarray(np.random.default_rng(2).normal(size=(8, H)), jnp.float32)
    real = key_mask[:, None, :, None] > 0
    cotangent = jnp.where(real, jnp.asarray(np.random.default_rng(9).normal(size=v.shape), jnp.float32), 0.0)

    marked = positions.global_keys(key_mask)

    def outputs_and_grads(kernel, global_keys=marked):
        def loss(table, terms, v):
            biased = dataclasses.replace(terms, bias=positions.t5_bias(table, 37, 37, 20), global_keys=global_keys)
            out = kernel(biased, v, key_mask, dropout_rate=0.2, dropout_key=jax.random.key(1))
            return jnp.sum(out * cotangent), jnp.where(real, out, 0.0)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(table, terms, v)
    (loss, out), grads = outputs_and_grads(attend)
    (want_loss, want_out), want_grads = outputs_and_grads(dense_attention)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-5)  # a sum of 2,368 outputs: observed ~1.4e-6
    assert max_error((out, grads), (want_out, want_grads)) < 1e-5
    if window:
        without = outputs_and_grads(attend, global_keys=None)
        assert max_error(without[0][1], want_out) > 1e-2  # the global keys matter to these outputs


@pytest.mark.parametrize("window,tile", [(5, 8), (12, 16)])
def test_window_global_keys_with_every_option_equal_the_dense_kernel(kernel, window, tile):
    """A window's global keys (each row's first and last real tokens, seen by every query; `window_global_tokens`)
    with every other option (`check_every_option`); the last row's closing key at 28, away from the sequence's end,
    so the band of queries whose distance to it reads its own table row is not clipped, and a row with one real
    token (its one global key counted once). Windows of 5 and 12 leave the global keys outside most queries'
    windows and inside the nearest ones' (counted once there)."""
    check_every_option(functools.partial(kernel, tile=tile), window)


TILE_LOCAL = Launches(max_product_width=0)  # DeBERTa's terms formed per tile pair at any table size


@pytest.mark.parametrize("terms_on,buckets", [(("c2p", "p2c"), R // 2), (("c2p", "p2c"), 0), (("c2p",), R // 2),
                                              (("p2c",), 0)])
def test_gpu_tile_local_terms_equal_the_dense_kernel(terms_on, buckets):
    """The GPU kernel with DeBERTa's terms formed per tile pair (a tile's queries or keys times the table rows of
    its distances, skewed through the program's scratch; the tables' gradients per diagonal of tile pairs), as it
    runs with a table grown to the length: outputs and every gradient equal the dense kernel's, each term alone and
    both, log buckets and exact distances, 37 positions in tiles of 16 (a ragged last tile, padding)."""
    terms, v, key_mask = table_inputs(terms_on, buckets)
    out, grads = outputs_and_grads(fused(pallas_attention, tile=16, launches=TILE_LOCAL), terms, v, key_mask)
    want_out, want_grads = outputs_and_grads(dense_attention, terms, v, key_mask)
    assert max_error(out, want_out) < 2e-6
    assert max_error(grads, want_grads) < 3e-6


@pytest.mark.parametrize("window", [0, 12])
def test_gpu_tile_local_terms_with_every_option(window):
    """Tile-local terms beside T5's bias (whose per-distance gradient keeps its band), a temperature per head,
    dropout and a window with its global keys; backward in tiles of 8 under a forward of 16."""
    launches = dataclasses.replace(TILE_LOCAL, backward_tile=8)
    check_every_option(functools.partial(pallas_attention, tile=16, launches=launches), window)


@pytest.mark.parametrize("window", [0, 12])
def test_gpu_backward_in_smaller_tiles_than_its_forward(window):
    """The GPU kernel's backward passes walk the forward's padded arrays in their own, smaller tiles (as on a GPU:
    64 forward, 32 backward): 37 positions padded to 48 by tiles of 16, walked backward in tiles of 8, the last of
    which holds padding only; with every option, windowed and not."""
    launches = Launches(backward_tile=8)
    assert KernelShape(37, 8, 1.0, True, True, window=12, pad_unit=16).num_tiles == 6
    check_every_option(functools.partial(pallas_attention, tile=16, launches=launches), window)


@pytest.mark.parametrize("scheme", sorted(biases.SCHEMES))
@pytest.mark.parametrize("terms_on", [(), ("c2p", "p2c")])
def test_every_bias_scheme_equals_the_dense_kernel(kernel, scheme, terms_on):
    """Every registered bias scheme, alone and added to DeBERTa's two terms, 37 positions in tiles of 16 (padding,
    the last tile ragged): outputs and the gradients of queries, keys, values and the scheme's parameters (through
    the bias per distance) agree (observed ~1e-6)."""
    terms, v, key_mask = table_inputs(terms_on, R // 2 if terms_on else 0)
    cfg = ModelConfig(attention=scheme, num_heads=H, hidden_size=H * D, t5_num_buckets=8, t5_max_distance=20)
    params = bias_params(cfg, seed=2)

    cotangent = jnp.asarray(np.random.default_rng(9).normal(size=v.shape), jnp.float32)

    def grads(kernel):
        def loss(params, terms, v):
            bias = biases.SCHEMES[scheme].bias(params, cfg, 37, 1.0, key_mask)
            out = kernel(dataclasses.replace(terms, bias=bias), v, key_mask)
            return jnp.sum(out * cotangent), out
        return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(params, terms, v)
    got, want = grads(fused(kernel, tile=16)), grads(jax.jit(dense_attention))
    assert max_error(got, want) < 1e-5
    for name, value in want[1][0].items():  # a parameter that learns gets a gradient the kernel must carry
        assert float(jnp.max(jnp.abs(value))) > 1e-4, name


def test_t5_table_gradient_with_every_option(kernel):
    """T5's table read per bucket, DeBERTa's two position terms, a temperature per head, a window of 12 and dropout
    0.2, tiles of 8 over 37 positions with padding: outputs at real queries and every gradient, the T5 table's (it
    flows through the bias array's) and the temperature's included, equal the dense kernel's (observed ~3e-6)."""
    terms, v, key_mask = table_inputs(("c2p", "p2c"), R // 2)
    temperature = jnp.asarray(np.random.default_rng(3).uniform(0.5, 2.0, (B, H, 37, 1)), jnp.float32)
    terms = dataclasses.replace(terms, temperature=temperature, window=12)
    table = jnp.asarray(np.random.default_rng(2).normal(size=(8, H)), jnp.float32)
    real = key_mask[:, None, :, None] > 0
    cotangent = jnp.where(real, jnp.asarray(np.random.default_rng(9).normal(size=v.shape), jnp.float32), 0.0)

    def outputs_and_grads(kernel):
        def loss(table, terms, v):
            biased = dataclasses.replace(terms, bias=positions.t5_bias(table, 37, 37, 20))
            out = kernel(biased, v, key_mask, dropout_rate=0.2, dropout_key=jax.random.key(1))
            return jnp.sum(out * cotangent), jnp.where(real, out, 0.0)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(table, terms, v)
    got = outputs_and_grads(functools.partial(kernel, tile=8))
    want = outputs_and_grads(dense_attention)
    assert max_error(got, want) < 1e-5
    assert max_error(got[1][0], want[1][0]) < 1e-5 < float(jnp.max(jnp.abs(want[1][0])))


def inner_jaxprs(eqn):
    """The jaxprs nested in an equation's parameters (a `cond`'s branches, a `pjit`'s body, a Pallas kernel)."""
    for param in eqn.params.values():
        for inner in param if isinstance(param, (list, tuple)) else [param]:
            inner = getattr(inner, "jaxpr", inner)
            if hasattr(inner, "eqns"):
                yield inner


def matrix_unit_flops(kernel_jaxpr) -> list[int]:
    """FLOPs of the `dot_general`s in a Pallas kernel's jaxpr by how many conditionals (`pl.when`, `lax.cond`) they
    sit under: `[unconditional, under one, under two]`."""
    flops = [0, 0, 0]

    def walk(jaxpr, depth):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "dot_general":
                (contracted, _), _ = eqn.params["dimension_numbers"]
                size = math.prod(eqn.invars[0].aval.shape[axis] for axis in contracted)
                flops[depth] += 2 * math.prod(eqn.outvars[0].aval.shape) * size
            for inner in inner_jaxprs(eqn):
                walk(inner, depth + (eqn.primitive.name == "cond"))
    walk(kernel_jaxpr, 0)
    return flops


def near_pairs(rel, n, tile, visits) -> np.ndarray:
    """`[query tiles, key tiles]`: whether a grid visits the pair (`visits`, a boolean matrix) and one of its
    distances has a relative index that is not an outermost row (from the index itself: the pair needs position
    products)."""
    tiles = np.arange(visits.shape[0]) * tile
    a = np.arange(tile)
    distance = tiles[:, None, None, None] + a[:, None] - tiles[None, :, None, None] - a
    index = rel[np.clip(distance, -(n - 1), n - 1) + n - 1].reshape(visits.shape + (-1,))
    return visits & ~((index == rel[0]).all(-1) | (index == rel[-1]).all(-1))


def pallas_calls(jaxpr) -> dict:
    """The Pallas calls in a program's jaxpr, by kernel name (each once: `platform_dependent` traces two)."""
    calls = {}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            calls.setdefault(eqn.params["name"], eqn.params)
        for inner in inner_jaxprs(eqn):
            for name, params in pallas_calls(inner).items():
                calls.setdefault(name, params)
    return calls


def traced_costs(terms_on, window, tile=8):
    """Per kernel: (its cost estimate's FLOPs per sequence and head, the FLOPs of its traced products outside any
    conditional / under one / under two, its grid's (rows, steps), the pairs it visits as `[query tile, key tile]`)."""
    terms, v, key_mask = table_inputs(terms_on, R // 2 if terms_on else 0)
    terms = dataclasses.replace(terms, window=window)
    jaxpr = jax.make_jaxpr(jax.grad(lambda terms, v: jnp.sum(pallas_tpu_attention(terms, v, key_mask, tile=tile)),
                                    argnums=(0, 1)))(terms, v)
    calls = pallas_calls(jaxpr.jaxpr)
    assert sorted(calls) == ["backward_kernel", "forward_kernel"]
    costs = {}
    for name, params in calls.items():
        backward = name == "backward_kernel"
        grid = params["grid_mapping"].grid
        rows, steps = np.meshgrid(np.arange(grid[2]), np.arange(grid[3]), indexing="ij")
        shape = KernelShape(terms.q.shape[2], tile, 1.0, False, False, window=window)
        with jax.ensure_compile_time_eval():
            other = np.asarray(shape.query_tile(rows, steps) if backward else shape.key_tile(rows, steps))
        visits = np.zeros((grid[2], grid[2]), bool)
        visits[(other, rows) if backward else (rows, other)] = True
        costs[name] = (params["cost_estimate"].flops // math.prod(grid[:2]), matrix_unit_flops(params["jaxpr"]),
                       grid[2:], visits)
    return costs, terms.relative.by_distance if terms_on else None, terms.q.shape[2]


@pytest.mark.parametrize("terms_on,window", [(("c2p", "p2c"), 0), (("c2p", "p2c"), 12), (("c2p",), 0), (("p2c",), 0),
                                             ((), 0)])
def test_cost_estimate_counts_the_products_the_kernels_run(terms_on, window):
    """The FLOPs each kernel reports to XLA's cost analysis (what the aot tables' TFLOP and rooflines add up) are
    the matrix-unit products its body runs, counted from the traced kernels, forward and backward: those outside
    any conditional at every visited tile pair; with position terms, those under one conditional (the position
    products) at every near pair (one with a distance whose relative index is not an outermost row, counted here
    from the index), and those under two (a carried product's first half, a pending gradient's flush) once per
    band of near pairs: one along each grid row and one along each column, so once per tile for each term."""
    tile = 8
    kernels, rel, n = traced_costs(terms_on, window, tile)
    for estimate, (every, once, twice), (rows, steps), visits in kernels.values():
        near = near_pairs(rel, n, tile, visits) if terms_on else visits
        assert near.any(axis=0).all() and near.any(axis=1).all()  # a band in every row and column
        assert estimate == every * rows * steps + once * int(near.sum()) + twice * rows
        assert (~near & visits).any() == bool(terms_on)  # the test reaches far pairs, with and without a window


def relative_inputs(n, buckets, max_relative, b=B, key_mask=None, seed=4):
    """`table_inputs`' DeBERTa terms with the relative index of `buckets` log buckets up to `max_relative` and tables
    that have every row it reads."""
    terms, v, default_mask = table_inputs(("c2p", "p2c"), R // 2, n=n, b=b, seed=seed)
    rel = positions.relative_index_by_distance(n, n, position_buckets=buckets, max_relative_positions=max_relative)
    rows = int(rel.max()) + 1
    rng = np.random.default_rng(seed + 1)
    terms = dataclasses.replace(terms, relative=RelativeIndex(rel),
                                pos_key=jnp.asarray(rng.normal(size=(H, rows, D)), jnp.float32),
                                pos_query=jnp.asarray(rng.normal(size=(H, rows, D)), jnp.float32))
    return terms, v, default_mask if key_mask is None else key_mask


def test_far_pairs_start_anywhere_in_a_tile(kernel):
    """8 buckets up to 16 saturate at a distance of 10, 2 past a tile boundary of 8: the tile pairs at a gap of one
    tile mix near distances (8, 9) with far ones, so a far/near boundary off by one in the kernels' tile test or in
    their per-distance gradients changes outputs or gradients. 37 positions, tiles of 8, padding."""
    terms, v, key_mask = relative_inputs(37, 8, 16)
    assert saturation(terms.relative.by_distance, 37, 37)[0] % 8 == 2
    got = outputs_and_grads(fused(kernel, tile=8), terms, v, key_mask)
    want = outputs_and_grads(jax.jit(dense_attention), terms, v, key_mask)
    assert max_error(got, want) < 3e-6


def test_global_keys_of_left_padded_rows(kernel):
    """Rows padded on the left (their first real token, a global key, well inside the sequence) with a window of 5,
    and log buckets that saturate at 7: queries on both sides of a global key, near and far from it, read its
    position terms from the right end row; an off-by-one in the far test of the global keys' position terms reaches
    real queries here (with right-padded rows only padding sees it). Outputs at real queries and every gradient."""
    n = 37
    key_mask = np.ones((B, n), np.int32)
    key_mask[0, :9] = 0
    key_mask[1, :3] = 0
    key_mask[1, 30:] = 0
    terms, v, key_mask = relative_inputs(n, 6, 16, key_mask=jnp.asarray(key_mask))
    terms = dataclasses.replace(terms, window=5)
    real = key_mask[:, None, :, None] > 0
    cotangent = jnp.where(real, jnp.asarray(np.random.default_rng(9).normal(size=v.shape), jnp.float32), 0.0)

    def outputs_and_grads(attend):
        def loss(terms, v):
            out = attend(dataclasses.replace(terms, global_keys=positions.global_keys(key_mask)), v, key_mask)
            return jnp.sum(out * cotangent), jnp.where(real, out, 0.0)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(terms, v)
    (_, out), grads = outputs_and_grads(functools.partial(kernel, tile=8))
    (_, want_out), want_grads = outputs_and_grads(dense_attention)
    assert max_error(out, want_out) < 2e-6
    assert max_error(grads, want_grads) < 1e-5
