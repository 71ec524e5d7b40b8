"""The fused TPU kernel with every option it implements compiles for TPUs (Mosaic lowers its kernels, forward and
backward) from this machine's CPU with libtpu: what the interpreter's parity tests (test_fused_kernels.py) cannot
show. The whole train step with the kernel is compiled in tests/aot/test_aot.py."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from deberta_jax.aot.chips import tpu_slice
from deberta_jax.kernels.pallas_tpu import pallas_tpu_attention
from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms
from deberta_jax.model import positions

# Compiled for devices this process lacks: kept out of the suite's persistent compilation cache.
pytestmark = pytest.mark.usefixtures("no_persistent_cache")


@functools.cache
def compile_for_tpu(topology, n, heads=2, d=64, dtype=jnp.bfloat16, dropout_rate=0.1, temperature=True, window=0,
                    global_keys=False):
    """The compiled value and gradients (every input) of one DeBERTa attention call on one chip of `topology`, with
    a per-distance bias, attention dropout, a temperature per query and head (a learned one's shape), a window
    and, `global_keys`, each row's ends seen by every query. Each program is compiled once per module."""
    device = SingleDeviceSharding(tpu_slice(topology).devices[0])
    spec = lambda *shape, dtype=dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)  # noqa: E731
    rel = positions.relative_index_by_distance(n, n, position_buckets=32, max_relative_positions=64)
    terms = ScoreTerms(q=spec(1, heads, n, d), k=spec(1, heads, n, d), pos_key=spec(heads, 64, d),
                       pos_query=spec(heads, 64, d), relative=RelativeIndex(rel), key_len=n, window=window,
                       bias=spec(heads, 2 * n - 1, dtype=jnp.float32),
                       temperature=spec(1, heads, n, 1, dtype=jnp.float32) if temperature else None)

    def loss(terms, v, key_mask):
        if global_keys:
            terms = dataclasses.replace(terms, global_keys=positions.global_keys(key_mask))
        out = pallas_tpu_attention(terms, v, key_mask, dropout_rate=dropout_rate,
                                   dropout_key=jax.random.key(0) if dropout_rate else None)
        return jnp.sum(out.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        terms, spec(1, heads, n, d), spec(1, n, dtype=jnp.int32)).compile()


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_every_option_compiles_for_tpus(topology):
    """A bias per distance (its slice broadcast and rotated into place, its gradient's column sums), attention
    dropout 0.1 (the hashes' int32 multiplies, xors and logical shifts inside the kernels), a temperature per head
    (its gradient's row reductions) and a window of 64 over 1,024 positions (index maps that compute the key tile
    from the query tile, the window's mask from the tile's iotas) with global keys (merged by the kernel's
    log-sum-exp)."""
    assert compile_for_tpu(topology, 1024, window=64, global_keys=True) is not None


def test_a_windowed_call_costs_length_times_window():
    """The compiled program's FLOPs and bytes (XLA's count, which takes the kernels' cost estimates) for a window of
    64: 4x the length costs 4x, where the full call's tile pairs grow 16x (its FLOPs about 11x: most of the added
    pairs lie beyond the relative index's reach, 64 here, and run no position products)."""
    def cost(n, window):
        analysis = compile_for_tpu("v5e:2x2", n, window=window).cost_analysis()
        return analysis["flops"], analysis["bytes accessed"]
    short, long = cost(1024, 64), cost(4096, 64)
    assert [b / a for a, b in zip(short, long)] == pytest.approx([4, 4], rel=0.05)
    assert cost(4096, 0)[0] > 10 * cost(1024, 0)[0]
