"""The fused GPU kernel compiles for NVIDIA GPUs from this machine's CPU with the CUDA plugin (no GPU, no driver):
Pallas lowers both kernels to Triton and XLA's GPU pipeline compiles them (Triton to PTX, the shared-memory check
against the target's limit), for Hopper and for Ampere, with every option the kernel carries; and a whole train step
with it compiles for an H100. What the interpreter's parity tests (test_fused_kernels.py) cannot show."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import SingleDeviceSharding

from configs import deberta
from deberta_jax.aot import build, chips
from deberta_jax.kernels.pallas import pallas_attention
from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms
from deberta_jax.model import positions

TRITON = "__gpu$xla.gpu.triton"


# Compiled for devices this process lacks: kept out of the suite's persistent compilation cache.
pytestmark = pytest.mark.usefixtures("no_persistent_cache")


@functools.cache
def compile_for_gpu(gpu, n, heads=2, d=64, dtype=jnp.bfloat16, bias=False, window=0):
    """The compiled value and gradients (every input) of one DeBERTa attention call on one `gpu`, with attention
    dropout 0.1, a temperature per query and head (a learned one's shape), DeBERTa-base's relative index, optionally
    a T5 bias and a window with each row's ends as global keys."""
    device = SingleDeviceSharding(chips.target(gpu).devices[0])
    spec = lambda *shape, dtype=dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)  # noqa: E731
    rel = positions.relative_index_by_distance(n, n, position_buckets=256, max_relative_positions=512)
    terms = ScoreTerms(q=spec(1, heads, n, d), k=spec(1, heads, n, d), key_len=n, window=window,
                       temperature=spec(1, heads, n, 1, dtype=jnp.float32))
    if bias:
        table = spec(32, heads, dtype=jnp.float32)
    else:
        terms = dataclasses.replace(terms, pos_key=spec(heads, 512, d), pos_query=spec(heads, 512, d),
                                    relative=RelativeIndex(rel))
        table = spec(1, dtype=jnp.float32)

    def loss(terms, table, v, key_mask):
        extra = {}
        if bias:
            extra = dict(bias=positions.t5_bias(table, n, n, 128),
                         bias_index=RelativeIndex(positions.t5_distance_buckets(n, n, 32, 128)))
        if window:
            extra["global_keys"] = positions.global_keys(key_mask)
        terms = dataclasses.replace(terms, **extra)
        out = pallas_attention(terms, v, key_mask, dropout_rate=0.1, dropout_key=jax.random.key(0))
        return jnp.sum(out.astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(
        terms, table, spec(1, heads, n, d), spec(1, n, dtype=jnp.int32)).compile()


@pytest.mark.parametrize("gpu", ["h100", "a100"])
def test_every_option_compiles_for_gpus(gpu):
    """DeBERTa's gathers, attention dropout's int32 hashes, a temperature per head and DeBERTa-base's saturating
    index (its far pairs' end sums) at 2,048 tokens, for Hopper and Ampere: the forward kernel and the backward's
    two passes are Triton calls of the compiled program."""
    text = compile_for_gpu(gpu, 2048).as_text()
    assert text.count(f'custom_call_target="{TRITON}"') == 3


def test_a_bias_and_a_window_with_global_keys_compile_for_an_h100():
    """T5's bias read per distance with its per-distance gradient, and a window of 256 whose band of key tiles the
    kernels compute from the query tile, with the global keys merged through the log-sum-exp."""
    compiled = compile_for_gpu("h100", 2048, bias=True, window=256)
    assert compiled.as_text().count(f'custom_call_target="{TRITON}"') == 3


def test_the_backward_memory_grows_linearly_past_the_relative_table():
    """Past DeBERTa-base's table (512 each way) the per-distance gradients have a fixed width, so the call's memory
    grows with the length, not its square: 4x the tokens take at most 4.5x the memory (observed ~4.2x)."""
    def gib(n):
        memory = compile_for_gpu("h100", n).memory_analysis()
        return (memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes) / 2**30
    assert gib(8192) < 4.5 * gib(2048)


def test_the_train_step_with_the_fused_kernel_compiles_for_an_h100():
    """The micro DeBERTa's train step as train.py builds it, attention dropout 0.1 through the fused kernel,
    bfloat16: every layer's attention is three Triton calls, and XLA reports its memory."""
    config = deberta.get_config("micro")
    config.model.num_layers = 1
    config.model.attention_kernel = "pallas"
    config.model.dtype = "bfloat16"
    report, = build.compile_run(config, chips.target("h100"), programs=["train"])
    assert report.error is None and report.fits
    assert report.cost.temp_bytes > 0
