"""One attention layer's forward and backward on an NVIDIA GPU: DeBERTa's fused kernel against the other kernels.

DeBERTa-base's heads (12 x 64) and relative table (v3: 256 buckets up to 512), bfloat16, `--rows` sequences of each
of `--lengths` tokens, a key padding mask; DeBERTa's fused GPU kernel (`attention_kernel=pallas`, attention dropout
0.1), the dense and blockwise kernels with the same dropout, and BERT's attention by cuDNN's fused kernel
(`jax.nn.dot_product_attention`, no dropout: it has none) and by the fused kernel without position terms. Per
program: the memory XLA's buffer assignment gives it (arguments, outputs and temporaries: the same on any machine)
and, on a GPU, the median time of `--steps` calls of the value and every gradient.

On a GPU:      python benchmarks/gpu_attention.py --lengths 8192 --rows 2
From this CPU: python benchmarks/gpu_attention.py --target h200 --lengths 8192 --rows 2   (memory only; needs
               the CUDA plugin, `pip install "jax[cuda12]==<the installed jax>"`)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

HEADS, HEAD_DIM = 12, 64
BUCKETS, MAX_RELATIVE = 256, 512


def programs(n: int):
    """name -> (loss(q, k, v, pos_key, pos_query, mask, dropout_key) -> scalar, whether it has position terms)."""
    import jax.numpy as jnp

    from deberta_jax.kernels import dispatch
    from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms
    from deberta_jax.model import positions
    from deberta_jax.model.attention import relative_products

    rel = RelativeIndex(positions.relative_index_by_distance(n, n, position_buckets=BUCKETS,
                                                             max_relative_positions=MAX_RELATIVE))

    def deberta(kernel, products=False):
        def loss(q, k, v, pk, pq, mask, key):
            terms = ScoreTerms(q=q, k=k, key_len=n, relative=rel)
            if products:  # the blockwise kernel takes the [B, H, N, R] products
                terms = ScoreTerms(q=q, k=k, key_len=n, relative=rel, c2p=relative_products(q, pk),
                                   p2c=relative_products(k, pq))
            else:
                terms = ScoreTerms(q=q, k=k, key_len=n, relative=rel, pos_key=pk, pos_query=pq)
            out = dispatch.attention_kernel(kernel, 512)(terms, v, mask, dropout_rate=0.1, dropout_key=key)
            return jnp.sum(out.astype(jnp.float32))
        return loss

    def bert(kernel, dropout):
        def loss(q, k, v, pk, pq, mask, key):
            terms = ScoreTerms(q=q, k=k, key_len=n)
            out = dispatch.attention_kernel(kernel, 512)(terms, v, mask, dropout_rate=dropout, dropout_key=key)
            return jnp.sum(out.astype(jnp.float32))
        return loss

    return {
        "DeBERTa, fused GPU kernel (pallas)": deberta("pallas"),
        "DeBERTa, dense": deberta("dense"),
        "DeBERTa, blockwise": deberta("blockwise", products=True),
        "BERT, cuDNN (jax.nn.dot_product_attention, no dropout)": bert("cudnn", 0.0),
        "BERT, fused GPU kernel (pallas)": bert("pallas", 0.1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192", help="comma-separated tokens per sequence")
    parser.add_argument("--rows", type=int, default=2, help="sequences per call")
    parser.add_argument("--target", default=None, help="compile for this GPU from here (h100, h200, a100): memory only")
    parser.add_argument("--only", default=None, help="run only the programs whose name contains this")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    if args.target:
        from deberta_jax.aot import chips
        chips.prepare_environment()
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    if args.target:
        from deberta_jax.aot import chips
        device = chips.target(args.target).devices[0]
    else:
        device = jax.devices()[0]
        if device.platform != "gpu":
            sys.exit(f"no GPU here ({device.platform}); pass --target h100|h200|a100 to compile for one (memory only)")
    sharding = SingleDeviceSharding(device)
    rows = []
    for n in map(int, args.lengths.split(",")):
        rel_rows = 2 * BUCKETS
        shapes = [(args.rows, HEADS, n, HEAD_DIM)] * 3 + [(HEADS, rel_rows, HEAD_DIM)] * 2
        for name, loss in programs(n).items():
            if args.only and args.only not in name:
                continue
            grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
            specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
            specs.append(jax.ShapeDtypeStruct((args.rows, n), jnp.int32, sharding=sharding))
            start = time.perf_counter()
            try:
                compiled = grad.lower(*specs, jax.random.key(0)).compile()
            except Exception as err:  # noqa: BLE001 - XLA reports every failure (memory included) as one type
                rows.append(dict(program=name, tokens=n, rows=args.rows, error=str(err).splitlines()[0][:300]))
                print(json.dumps(rows[-1]), flush=True)
                continue
            memory = compiled.memory_analysis()
            row = dict(program=name, tokens=n, rows=args.rows, compile_s=round(time.perf_counter() - start, 1),
                       memory_gib=round((memory.argument_size_in_bytes + memory.output_size_in_bytes
                                         - memory.alias_size_in_bytes + memory.temp_size_in_bytes) / 2**30, 3))
            if not args.target:
                keys = jax.random.split(jax.random.key(1), 5)
                arrays = [jax.random.normal(key, s, jnp.bfloat16) for key, s in zip(keys, shapes)]
                arrays.append(jnp.ones((args.rows, n), jnp.int32).at[-1, n - n // 8:].set(0))
                jax.block_until_ready(compiled(*arrays, jax.random.key(0)))  # warm-up
                times = []
                for _ in range(args.steps):
                    begin = time.perf_counter()
                    jax.block_until_ready(compiled(*arrays, jax.random.key(0)))
                    times.append(time.perf_counter() - begin)
                row["median_ms"] = round(1e3 * statistics.median(times), 2)
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
