"""One attention layer's forward and backward, compiled for one TPU chip from this CPU: what each kernel costs.

Compares, on the same shapes (DeBERTa-base's heads, `--tokens` per chip, as many rows as fit that budget at each
length): DeBERTa's fused TPU kernel (`attention_kernel=pallas_tpu`), the same kernel without position terms
(flash attention for BERT), Pallas' own TPU flash attention (`jax.experimental.pallas.ops.tpu`), XLA's
`jax.nn.dot_product_attention`, and the dense kernel with DeBERTa's terms both ways (`relative_terms` gather and
shift). Per program: HBM the chip needs (arguments, outputs, temporaries, code), FLOPs and bytes by XLA's cost
analysis (a Pallas kernel's come from its cost estimate), the roofline time, and the gathers left in the optimized
HLO. Nothing runs on a TPU; needs libtpu (`pip install "jax[tpu]==<the installed jax>"`).

    python benchmarks/tpu_attention.py [--chip v5e] [--lengths 512,2048,8192] [--tokens 8192] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas.ops.tpu import flash_attention as pallas_flash  # noqa: E402

from deberta_jax.aot import analysis, chips  # noqa: E402
from deberta_jax.kernels.dense import dense_attention  # noqa: E402
from deberta_jax.kernels.pallas_tpu import pallas_tpu_attention  # noqa: E402
from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms  # noqa: E402
from deberta_jax.model import positions  # noqa: E402
from deberta_jax.model.attention import relative_products  # noqa: E402

HEADS, HEAD_DIM = 12, 64
BUCKETS, MAX_RELATIVE = 256, 512  # DeBERTa v3: 2 * 256 relative rows


def _deberta_terms(q, k, pos_key, pos_query, n, products: bool) -> ScoreTerms:
    rel = RelativeIndex(positions.relative_index_by_distance(n, n, position_buckets=BUCKETS,
                                                             max_relative_positions=MAX_RELATIVE))
    terms = ScoreTerms(q=q, k=k, key_len=n, relative=rel)
    if products:  # relative_terms="gather": [B, H, N, R] products, then a gather per (i, j)
        return dataclasses.replace(terms, c2p=relative_products(q, pos_key), p2c=relative_products(k, pos_query))
    return dataclasses.replace(terms, pos_key=pos_key, pos_query=pos_query)


def programs(n: int):
    """name -> (attention(q, k, v, pos_key, pos_query, mask) -> out)."""
    scale = 1.0 / np.sqrt(HEAD_DIM)
    return {
        "DeBERTa, fused TPU kernel": lambda q, k, v, pk, pq, m: pallas_tpu_attention(
            _deberta_terms(q, k, pk, pq, n, False), v, m),
        "DeBERTa, dense (shift)": lambda q, k, v, pk, pq, m: dense_attention(
            _deberta_terms(q, k, pk, pq, n, False), v, m),
        "DeBERTa, dense (gather)": lambda q, k, v, pk, pq, m: dense_attention(
            _deberta_terms(q, k, pk, pq, n, True), v, m),
        "BERT, fused TPU kernel": lambda q, k, v, pk, pq, m: pallas_tpu_attention(
            ScoreTerms(q=q, k=k, key_len=n), v, m),
        "BERT, Pallas TPU flash attention": lambda q, k, v, pk, pq, m: pallas_flash.flash_attention(
            q, k, v, segment_ids=pallas_flash.SegmentIds(m, m), sm_scale=scale),
        "BERT, jax.nn.dot_product_attention": lambda q, k, v, pk, pq, m: jnp.swapaxes(jax.nn.dot_product_attention(
            *(jnp.swapaxes(x, 1, 2) for x in (q, k, v)), mask=m[:, None, None, :].astype(bool)), 1, 2),
    }


def compile_one(attention, rows: int, n: int, device, chip: chips.Chip) -> dict:
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def step(q, k, v, pk, pq, mask):  # forward and backward, as a train step runs them
        def loss(q, k, v, pk, pq):
            return jnp.sum(attention(q, k, v, pk, pq, mask).astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, pk, pq)

    token = spec(rows, HEADS, n, HEAD_DIM)
    table = spec(HEADS, 2 * BUCKETS, HEAD_DIM)
    start = time.perf_counter()
    try:
        compiled = jax.jit(step).lower(token, token, token, table, table, spec(rows, n, dtype=jnp.int32)).compile()
    except Exception as err:  # noqa: BLE001 - XLA reports every failure (memory included) as one error type
        return dict(error=str(err).strip().splitlines()[0][:300])
    cost = analysis.program_cost(compiled)
    roofline = analysis.roofline(cost, chip, 0.0)
    return dict(hbm_gib=cost.hbm_bytes / chips.GIB, temp_gib=cost.temp_bytes / chips.GIB, gflops=cost.flops / 1e9,
                gbytes=cost.bytes_accessed / 1e9, roofline_ms=roofline.seconds * 1e3, bound=roofline.bound,
                gathers=cost.gathers, largest_gather_mib=cost.largest_gather_bytes / 2**20,
                compile_s=time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chip", default="v5e", help="TPU generation (one chip of it): v4, v5e, v5p, v6e")
    parser.add_argument("--lengths", default="512,2048,8192")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per chip (rows = tokens // length)")
    parser.add_argument("--only", default="", help="comma-separated substrings of program names to compile")
    parser.add_argument("--out", default="", help="write the records as JSON here")
    args = parser.parse_args()
    topology = f"{args.chip}:1x1" if args.chip in ("v5e", "v6e") else f"{args.chip}:1x1x1"
    tpu = chips.tpu_slice(topology)
    records = []
    print(f"one {args.chip} chip; {HEADS} heads x {HEAD_DIM}; bfloat16; forward + backward of one attention layer")
    print(f"{'program':40s} {'tokens x rows':>14s} {'HBM GiB':>8s} {'temp GiB':>8s} {'GFLOP':>8s} {'GB':>7s} "
          f"{'roofline ms':>11s} {'bound':>7s} {'gathers':>7s} {'largest MiB':>11s}")
    for n in (int(x) for x in args.lengths.split(",")):
        rows = max(1, args.tokens // n)
        for name, attention in programs(n).items():
            if args.only and not any(s in name for s in args.only.split(",")):
                continue
            record = dict(program=name, length=n, rows=rows, chip=args.chip,
                          **compile_one(attention, rows, n, tpu.devices[0], tpu.chip))
            records.append(record)
            if "error" in record:
                print(f"{name:40s} {n:>7d} x {rows:<4d}  not compiled: {record['error']}")
                continue
            print(f"{name:40s} {n:>7d} x {rows:<4d} {record['hbm_gib']:8.2f} {record['temp_gib']:8.2f} "
                  f"{record['gflops']:8.1f} {record['gbytes']:7.2f} {record['roofline_ms']:11.2f} "
                  f"{record['bound']:>7s} {record['gathers']:7d} {record['largest_gather_mib']:11.2f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
