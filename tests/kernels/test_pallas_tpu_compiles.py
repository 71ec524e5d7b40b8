"""The fused TPU kernel with every option it implements compiles for TPUs (Mosaic lowers its kernels, forward and
backward) from this machine's CPU with libtpu: what the interpreter's parity tests (test_pallas_tpu.py) cannot
show. The whole train step with the kernel is compiled in tests/aot/test_aot.py."""


import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from deberta_jax.aot.chips import tpu_slice
from deberta_jax.kernels.pallas_tpu import pallas_tpu_attention
from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms
from deberta_jax.model import positions


@pytest.fixture(autouse=True)
def no_persistent_cache():
    """The suite's persistent compilation cache cannot hold executables for devices this process lacks."""
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", True)


def compile_for_tpu(topology, n, heads=2, d=64, dtype=jnp.bfloat16, dropout_rate=0.1, **options):
    """The compiled value and gradients (every input) of one DeBERTa attention call with `options` (ScoreTerms
    fields) on one chip of `topology`."""
    device = SingleDeviceSharding(tpu_slice(topology).devices[0])
    spec = lambda *shape, dtype=dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)  # noqa: E731
    rel = positions.relative_index_by_distance(n, n, position_buckets=32, max_relative_positions=64)
    terms = ScoreTerms(q=spec(1, heads, n, d), k=spec(1, heads, n, d), pos_key=spec(heads, 64, d),
                       pos_query=spec(heads, 64, d), relative=RelativeIndex(rel), key_len=n, **options)

    def loss(terms, v, key_mask):
        out = pallas_tpu_attention(terms, v, key_mask, dropout_rate=dropout_rate,
                                   dropout_key=jax.random.key(0) if dropout_rate else None)
        return jnp.sum(out.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(
        terms, spec(1, heads, n, d), spec(1, n, dtype=jnp.int32)).compile()


@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_every_option_compiles_for_tpus(topology):
    """Attention dropout 0.1 (the hashes' int32 multiplies, xors and logical shifts inside the kernels)."""
    assert compile_for_tpu(topology, 256) is not None
