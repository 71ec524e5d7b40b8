"""One attention layer on an NVIDIA GPU: DeBERTa's fused kernel against the other kernels, timed on a GPU or read at
compile level (memory, registers, spills) from a machine without one.

DeBERTa-base's heads (12 x 64), bfloat16, `--rows` sequences of each of `--lengths` tokens with key padding, and a
relative table that is either DeBERTa-v3's published one (256 log buckets up to 512, `--tables published`) or the
one this project's configs grow with the training length (`grown`: 2 x N/2 buckets up to N). Programs (`--only`
picks by substring): DeBERTa's fused GPU kernel (`deberta-pallas`, attention dropout 0.1), the dense and blockwise
kernels with the same dropout, and BERT's attention by cuDNN's fused kernel (`bert-cudnn`, no dropout: it has none)
and by the fused kernel without position terms (`bert-pallas`). Each program's value and every gradient
(`forward+backward`) and its value alone (`forward`).

Per program, one JSON line: the memory XLA's buffer assignment gives it and the Triton calls in its compiled HLO
(the fused kernel's forward, key pass and query pass; none means Pallas fell back to its interpreter). On a GPU
also the time of each call (`--warmup` untimed, then median and min of `--steps`, each `block_until_ready`) and the
device's peak memory (`memory_stats`, for the process: give each program its own process to read it alone). With
`--ptxas` (any machine with the CUDA plugin), the registers and spilled bytes per thread of each Triton kernel as
NVIDIA's assembler reports them.

On a GPU:      python benchmarks/gpu_attention.py --lengths 8192 --rows 2
From this CPU: python benchmarks/gpu_attention.py --target h100,a100 --tables published,grown --only deberta-pallas \
                 --ptxas      (needs the CUDA plugin, `pip install "jax[cuda12]==<the installed jax>"`)
Rehearsal:     python benchmarks/gpu_attention.py --rehearse   (the same code on this CPU at a small shape;
               Pallas interpreted, cuDNN skipped)
`--tuning` sets the fused kernel's knobs (`tuning`): e.g. `tile=64,backward_tile=32,forward=4x2,key_pass=8x1`.
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
TABLES = {"published": (256, 512), "grown": None}  # (position_buckets, max_relative_positions); grown: N // 2, N
TRITON_CALL = "__gpu$xla.gpu.triton"
PARTS = ("forward", "forward+backward")


def table(name: str, n: int) -> tuple[int, int]:
    """(position_buckets, max_relative_positions) of a relative table at length `n`."""
    return TABLES[name] or (n // 2, n)


def tuning(text: str | None):
    """The fused GPU kernel's knobs from `tile=64,backward_tile=32,max_product_width=2048,forward=4x2,key_pass=8x1,
    query_pass=4x2,table_pass=4x2` (any subset; warps x stages): (tile, Launches)."""
    from deberta_jax.kernels import pallas

    tile, fields = None, {}
    for item in filter(None, (text or "").split(",")):
        key, _, value = item.partition("=")
        if key == "tile":
            tile = int(value)
        elif key in ("backward_tile", "max_product_width"):
            fields[key] = int(value)
        elif key in ("forward", "key_pass", "query_pass", "table_pass"):
            warps, _, stages = value.partition("x")
            fields[key] = pallas.Launch(int(warps), int(stages))
        else:
            raise SystemExit(f"--tuning {text!r}: unknown knob {key!r} (tile, backward_tile, max_product_width, "
                             "forward, key_pass, query_pass, table_pass)")
    return tile, pallas.Launches(**fields)


def programs(n: int, table_name: str = "published", knobs: str | None = None):
    """name -> loss(q, k, v, pos_key, pos_query, mask, dropout_key) -> scalar."""
    import jax.numpy as jnp

    from deberta_jax.kernels import dispatch
    from deberta_jax.kernels.pallas import pallas_attention
    from deberta_jax.kernels.scores import RelativeIndex, ScoreTerms
    from deberta_jax.model import positions
    from deberta_jax.model.attention import relative_products

    buckets, max_relative = table(table_name, n)
    rel = RelativeIndex(positions.relative_index_by_distance(n, n, position_buckets=buckets,
                                                             max_relative_positions=max_relative))
    tile, launches = tuning(knobs)

    def kernel(name):
        if name == "pallas":
            return lambda *args, **kw: pallas_attention(*args, tile=tile, launches=launches, **kw)
        return dispatch.attention_kernel(name, 512)

    def deberta(name):
        def loss(q, k, v, pk, pq, mask, key):
            if name == "blockwise":  # the blockwise kernel takes the [B, H, N, R] products
                terms = ScoreTerms(q=q, k=k, key_len=n, relative=rel, c2p=relative_products(q, pk),
                                   p2c=relative_products(k, pq))
            else:
                terms = ScoreTerms(q=q, k=k, key_len=n, relative=rel, pos_key=pk, pos_query=pq)
            return jnp.sum(kernel(name)(terms, v, mask, dropout_rate=0.1, dropout_key=key).astype(jnp.float32))
        return loss

    def bert(name, dropout):
        def loss(q, k, v, pk, pq, mask, key):
            terms = ScoreTerms(q=q, k=k, key_len=n)
            out = kernel(name)(terms, v, mask, dropout_rate=dropout, dropout_key=key)
            return jnp.sum(out.astype(jnp.float32))
        return loss

    return {"deberta-pallas": deberta("pallas"), "deberta-dense": deberta("dense"),
            "deberta-blockwise": deberta("blockwise"), "bert-cudnn": bert("cudnn", 0.0),
            "bert-pallas": bert("pallas", 0.1)}


def shapes(rows: int, n: int, table_name: str, heads: int = HEADS, head_dim: int = HEAD_DIM):
    """Shapes of (q, k, v, pos_key, pos_query) and the key mask."""
    table_rows = 2 * (table(table_name, n)[0] or table(table_name, n)[1])
    return [(rows, heads, n, head_dim)] * 3 + [(heads, table_rows, head_dim)] * 2, (rows, n)


def inputs(array_shapes, mask_shape, dtype):
    """Random inputs (normal, scaled as a trained layer's projections are) and a key mask whose last row ends in an
    eighth of padding."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(1), len(array_shapes))
    arrays = [jax.random.normal(key, shape, jnp.float32).astype(dtype) for key, shape in zip(keys, array_shapes)]
    rows, n = mask_shape
    return arrays + [jnp.ones(mask_shape, jnp.int32).at[rows - 1, n - n // 8:].set(0)]


def timed(fn, args, warmup: int, steps: int) -> dict:
    """Median and min milliseconds of `steps` calls after `warmup` untimed ones, each waited for."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(1e3 * (time.perf_counter() - begin))
    return dict(median_ms=round(statistics.median(times), 3), min_ms=round(min(times), 3), steps=steps)


def measure(name, loss, part, device, array_shapes, mask_shape, table_name, args, on_gpu: bool) -> dict:
    """One program's row: compile (with ptxas when `args.ptxas`), memory, Triton calls, and on a GPU its times."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from deberta_jax.aot import ptxas

    sharding = SingleDeviceSharding(device)
    fn = jax.jit(loss if part == "forward" else jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    specs = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in array_shapes]
    specs.append(jax.ShapeDtypeStruct(mask_shape, jnp.int32, sharding=sharding))
    row = dict(program=name, part=part, tokens=mask_shape[1], rows=mask_shape[0], table=table_name,
               device=device.device_kind, tuning=args.tuning or "default")
    start = time.perf_counter()
    lowered = fn.lower(*specs, jax.random.key(0))
    kernels = {"forward_kernel", "key_pass_kernel", "query_pass_kernel"} if part != "forward" else {"forward_kernel"}
    if args.ptxas and name.endswith("pallas"):
        # The table pass runs where DeBERTa's terms are tile-local (a table that grows with the length).
        compiled, resources = ptxas.compile_with_resources(lowered, kernels, frozenset({"table_pass_kernel"}))
        row["ptxas"] = {r.name: dict(registers=r.registers, spill_stores=r.spill_stores,
                                     spill_loads=r.spill_loads, arch=r.arch) for r in resources}
    else:
        compiled = lowered.compile()
    memory = compiled.memory_analysis()
    row.update(compile_s=round(time.perf_counter() - start, 1),
               xla_memory_gib=round((memory.argument_size_in_bytes + memory.output_size_in_bytes
                                     - memory.alias_size_in_bytes + memory.temp_size_in_bytes) / 2**30, 3),
               triton_calls=compiled.as_text().count(f'custom_call_target="{TRITON_CALL}"'))
    if on_gpu or args.rehearse:
        row.update(timed(compiled, inputs(array_shapes, mask_shape, jnp.bfloat16) + [jax.random.key(0)],
                         args.warmup, args.steps))
        stats = device.memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            row["device_peak_gib"] = round(stats["peak_bytes_in_use"] / 2**30, 3)
    return row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="8192", help="comma-separated tokens per sequence")
    parser.add_argument("--rows", type=int, default=2, help="sequences per call")
    parser.add_argument("--tables", default="published", help="comma-separated: published, grown")
    parser.add_argument("--target", default=None, help="compile for these GPUs from here (h100, h200, a100; "
                        "comma-separated): memory and ptxas only")
    parser.add_argument("--only", default=None, help="comma-separated substrings of the programs to run")
    parser.add_argument("--parts", default=",".join(PARTS), help="forward, forward+backward")
    parser.add_argument("--tuning", default=None, help="the fused kernel's knobs (module docstring)")
    parser.add_argument("--ptxas", action="store_true", help="registers and spills of the Triton kernels")
    parser.add_argument("--rehearse", action="store_true", help="this CPU, a small shape, the same code paths")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=None, help="also append the rows to this JSON-lines file")
    args = parser.parse_args(argv)
    if args.target or args.ptxas:
        from deberta_jax.aot import chips
        chips.prepare_environment()
    import jax

    heads, head_dim = HEADS, HEAD_DIM
    if args.rehearse:
        args.lengths, args.rows, args.steps, args.warmup, heads = "256", 1, min(args.steps, 2), 1, 2
    if args.target:
        from deberta_jax.aot import chips
        devices = [chips.target(name).devices[0] for name in args.target.split(",")]
    else:
        devices = jax.devices()[:1]
        if devices[0].platform != "gpu" and not args.rehearse:
            sys.exit(f"no GPU here ({devices[0].platform}); pass --target h100|h200|a100 to compile for one "
                     "(memory, ptxas), or --rehearse")
    on_gpu = not args.target and devices[0].platform == "gpu"
    failed = False
    for device in devices:
        for n in map(int, args.lengths.split(",")):
            for table_name in args.tables.split(","):
                array_shapes, mask_shape = shapes(args.rows, n, table_name, heads, head_dim)
                for name, loss in programs(n, table_name, args.tuning).items():
                    if args.only and not any(part in name for part in args.only.split(",")):
                        continue
                    for part in args.parts.split(","):
                        if name == "bert-cudnn" and device.platform not in ("gpu", "cuda"):
                            row = dict(program=name, part=part, skipped="cuDNN needs a CUDA GPU")
                        else:
                            try:
                                row = measure(name, loss, part, device, array_shapes, mask_shape, table_name, args,
                                              on_gpu)
                            except Exception as err:  # noqa: BLE001 - a row per failure (XLA reports all alike)
                                failed = True
                                row = dict(program=name, part=part, tokens=n, table=table_name,
                                           error=f"{type(err).__name__}: {str(err).splitlines()[0][:300]}")
                        print(json.dumps(row), flush=True)
                        if args.out:
                            with open(args.out, "a") as f:
                                f.write(json.dumps(row) + "\n")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
