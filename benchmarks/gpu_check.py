"""The device check's own steps (`bash benchmarks/gpu_check.sh` runs them with the others, each under a timeout):

  preflight  the jax and device it runs on, the kernel module imported on that jax, and the Triton calls of a
             small fused forward and backward compiled there (three on a GPU: forward, key pass, query pass; none
             means Pallas fell back to its interpreter, which it does silently on a non-CUDA platform);
  parity     the fused GPU kernel against the dense kernel on the same device at the production tiles and head
             size 64: DeBERTa-v3's table (its far pairs from 506 on) with the terms gathered from products, at 2,048
             tokens and a ragged 1,000, and the table grown to 2,048 with tile-local terms; key padding, attention
             dropout 0.1; float32 at the highest matmul precision and bfloat16; the output and every gradient by
             relative error, and the dropped entries counted against the dense kernel's mask;
  profile    one DeBERTa-base layer's forward and backward (2 x 8,192, bfloat16) under jax's profiler: device
             time in the fused kernels against the rest (XLA's position products, the tables' gradients).

Each prints JSON lines (`{"step": ..., ...}`), the last of a step with `"ok"`. `--rehearse` runs the same code on
this CPU at small shapes (Pallas interpreted).
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import gpu_attention  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from deberta_jax.kernels import dropout_masks  # noqa: E402
from deberta_jax.kernels.dense import dense_attention  # noqa: E402
from deberta_jax.kernels.pallas import Launches, pallas_attention  # noqa: E402
from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms  # noqa: E402
from deberta_jax.model import positions  # noqa: E402

KERNEL_NAMES = ("forward_kernel", "key_pass_kernel", "query_pass_kernel")
# Relative errors a leaf may show: float32 at the highest precision differs from the dense kernel by summation
# order only; a bfloat16 leaf may be off its float32 reference by at most twice the dense kernel's own bfloat16
# error plus this.
FLOAT32_TOLERANCE = 1e-4
BFLOAT16_SLACK = 1e-3


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def on_gpu() -> bool:
    return jax.devices()[0].platform == "gpu"


def layer_inputs(n: int, rows: int, heads: int, dtype, seed: int = 0, table: str = "published"):
    """(terms, v, key mask) with a relative table (`gpu_attention.TABLES`) and key padding on the last row (an
    eighth, or 37 tokens)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), jnp.float32).astype(dtype)
    buckets, max_relative = gpu_attention.table(table, n)
    rel = RelativeIndex(positions.relative_index_by_distance(n, n, position_buckets=buckets,
                                                             max_relative_positions=max_relative))
    d, table_rows = gpu_attention.HEAD_DIM, 2 * buckets
    terms = ScoreTerms(q=normal(rows, heads, n, d), k=normal(rows, heads, n, d), key_len=n, relative=rel,
                       pos_key=normal(heads, table_rows, d), pos_query=normal(heads, table_rows, d))
    mask = np.ones((rows, n), np.int32)
    mask[-1, n - max(n // 8, 37):] = 0
    return terms, normal(rows, heads, n, d), jnp.asarray(mask)


def values_and_grads(kernel, terms, v, mask, cotangent):
    """The output and the gradients of `sum(out * cotangent)` with respect to q, k, v and both tables."""
    def loss(q, k, v, pos_key, pos_query):
        t = ScoreTerms(q=q, k=k, key_len=terms.key_len, relative=terms.relative, pos_key=pos_key,
                       pos_query=pos_query)
        out = kernel(t, v, mask, dropout_rate=0.1, dropout_key=jax.random.key(3))
        return jnp.sum(out.astype(jnp.float32) * cotangent), out
    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(
        terms.q, terms.k, v, terms.pos_key, terms.pos_query)
    return dict(zip(("out", "dq", "dk", "dv", "d_pos_key", "d_pos_query"), (out, *grads)))


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def kept_count(kernel, n: int, heads: int, rate: float) -> int:
    """Attention-dropout entries the kernel keeps at one (sequence, head, query, key) grid, read off its output:
    with zero queries, keys and tables every real key weighs 1/n, and values one-hot in `key mod d` make output
    feature c of a query the count of its kept keys `= c (mod d)` over `n (1 - rate)`."""
    d = gpu_attention.HEAD_DIM
    zeros = jnp.zeros((1, heads, n, d), jnp.float32)
    rel = RelativeIndex(positions.relative_index_by_distance(n, n, position_buckets=256, max_relative_positions=512))
    terms = ScoreTerms(q=zeros, k=zeros, key_len=n, relative=rel, pos_key=jnp.zeros((heads, 512, d)),
                       pos_query=jnp.zeros((heads, 512, d)))
    v = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(n) % d, d), (1, heads, n, d))
    out = jax.jit(lambda t, v: kernel(t, v, jnp.ones((1, n), jnp.int32), dropout_rate=rate,
                                      dropout_key=jax.random.key(11)))(terms, v)
    return int(np.rint(np.asarray(out, np.float64) * n * (1 - rate)).sum())


def preflight(rehearse: bool) -> bool:
    device = jax.devices()[0]
    emit(step="preflight", jax=jax.__version__, python=sys.version.split()[0], platform=device.platform,
         device=device.device_kind, devices=jax.device_count())
    if not rehearse and device.platform != "gpu":
        emit(step="preflight", ok=False, error=f"no GPU: jax sees {device.platform}")
        return False
    n = 256
    terms, v, mask = layer_inputs(n, 1, 2, jnp.bfloat16)
    text = jax.jit(jax.grad(lambda q: jnp.sum(pallas_attention(
        ScoreTerms(q=q, k=terms.k, key_len=n, relative=terms.relative, pos_key=terms.pos_key,
                   pos_query=terms.pos_query), v, mask).astype(jnp.float32)))).lower(terms.q).compile().as_text()
    calls = text.count(f'custom_call_target="{gpu_attention.TRITON_CALL}"')
    want = 0 if rehearse else 3
    ok = calls == want
    emit(step="preflight", triton_calls=calls, expected=want, ok=ok,
         **({} if ok else {"error": "the fused kernel is not the three Triton calls it should be here"}))
    return ok


# The kernel's two ways with DeBERTa's terms, forced: products gathered in the tile (DeBERTa-v3's table), and
# tile-local products (the default for a table grown with the length).
MODES = {"products": Launches(max_product_width=1 << 30), "tile-local": Launches(max_product_width=0)}


def parity(rehearse: bool) -> bool:
    if rehearse:
        return parity_at([(256, "published", "products"), (200, "published", "products"),
                          (256, "grown", "tile-local")], 2, 2)
    return parity_at([(2048, "published", "products"), (1000, "published", "products"),
                      (2048, "grown", "tile-local")], 4, 2)


def parity_at(cases, heads: int, rows: int) -> bool:
    """The parity step for each (length, table, mode) (the suite runs it at the production shape on the CPU,
    interpreted)."""
    ok = True
    for n, table, mode in cases:
        fused = functools.partial(pallas_attention, launches=MODES[mode])
        cotangent = jnp.asarray(np.random.default_rng(n).normal(size=(rows, heads, n, gpu_attention.HEAD_DIM)),
                                jnp.float32)
        with jax.default_matmul_precision("highest"):
            terms, v, mask = layer_inputs(n, rows, heads, jnp.float32, table=table)
            reference = values_and_grads(dense_attention, terms, v, mask, cotangent)
            fused32 = values_and_grads(fused, terms, v, mask, cotangent)
        errors = {leaf: relative_error(fused32[leaf], reference[leaf]) for leaf in reference}
        passed = all(e < FLOAT32_TOLERANCE for e in errors.values())
        emit(step="parity", dtype="float32", tokens=n, table=table, mode=mode, relative_error=errors,
             tolerance=FLOAT32_TOLERANCE, passed=passed)
        ok &= passed
        terms16, v16, _ = layer_inputs(n, rows, heads, jnp.bfloat16, table=table)
        fused16 = values_and_grads(fused, terms16, v16, mask, cotangent)
        dense16 = values_and_grads(dense_attention, terms16, v16, mask, cotangent)
        errors = {leaf: relative_error(fused16[leaf], reference[leaf]) for leaf in reference}
        bounds = {leaf: 2 * relative_error(dense16[leaf], reference[leaf]) + BFLOAT16_SLACK for leaf in reference}
        passed = all(errors[leaf] <= bounds[leaf] for leaf in errors)
        emit(step="parity", dtype="bfloat16", tokens=n, table=table, mode=mode, relative_error=errors, bound=bounds,
             passed=passed)
        ok &= passed
        rate = 0.1
        fused_kept, dense_kept = (kept_count(kernel, n, heads, rate) for kernel in (fused, dense_attention))
        positions_ = np.arange(n)
        hashes = dropout_masks.attention_hashes(jax.random.key(11), 1, heads, positions_, positions_)
        mask_kept = int(np.asarray(dropout_masks.attention_keep(hashes[0], hashes[1], rate)).sum())
        passed = fused_kept == dense_kept == mask_kept
        entries = heads * n * n
        emit(step="parity", check="dropped entries", tokens=n, mode=mode, entries=entries, dropped=entries - fused_kept,
             dense_dropped=entries - dense_kept, mask_dropped=entries - mask_kept, passed=passed)
        ok &= passed
    emit(step="parity", ok=bool(ok))
    return bool(ok)


def profile(rehearse: bool) -> bool:
    n, rows = (256, 1) if rehearse else (8192, 2)
    loss = gpu_attention.programs(n)["deberta-pallas"]
    array_shapes, mask_shape = gpu_attention.shapes(rows, n, "published")
    args = gpu_attention.inputs(array_shapes, mask_shape, jnp.bfloat16) + [jax.random.key(0)]
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    jax.block_until_ready(step(*args))
    calls = 3
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            for _ in range(calls):
                jax.block_until_ready(step(*args))
        trace = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
        data = jax.profiler.ProfileData.from_file(trace[0])
    # Device planes on a GPU (its kernels, one line per stream); the host's threads where there is none.
    planes = [p for p in data.planes if p.name.startswith("/device:GPU")] or [
        p for p in data.planes if p.name.startswith("/host:CPU")]
    by_name = collections.Counter()
    for plane in planes:
        lines = list(plane.lines)
        # A GPU plane's kernels are on its stream lines; its "XLA Ops" / "XLA Modules" lines span the same time.
        streams = [line for line in lines if line.name.startswith("Stream")]
        for line in streams or lines:
            for event in line.events:
                by_name[event.name] += event.duration_ns
    fused = {name: sum(ns for event, ns in by_name.items() if name in event) / calls / 1e6 for name in KERNEL_NAMES}
    total = sum(by_name.values()) / calls / 1e6
    other = total - sum(fused.values())
    emit(step="profile", tokens=n, rows=rows, ms_per_call=dict(fused, other=round(other, 3), total=round(total, 3)),
         top=[(name, round(ns / calls / 1e6, 3)) for name, ns in by_name.most_common(12)], planes=len(planes))
    ok = rehearse or all(ms > 0 for ms in fused.values())
    emit(step="profile", ok=ok, **({} if ok else {"error": "the profile holds no time in a fused kernel"}))
    return ok


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("preflight", "parity", "profile"))
    parser.add_argument("--rehearse", action="store_true", help="this CPU, small shapes, the same code")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    ok = {"preflight": preflight, "parity": parity, "profile": profile}[args.step](args.rehearse)
    emit(step=args.step, seconds=round(time.perf_counter() - start, 1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
