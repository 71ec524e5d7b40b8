"""Where the train step's time goes: XLA's own per-op timings, summed by kind of op.

    .venv/bin/python benchmarks/profile_step.py --model deberta --seq 512 --batch 4
    .venv/bin/python benchmarks/profile_step.py --model bert,deberta --seq 128 --batch 16 --top 5

Runs the case of `train_step.py` (same model, step and synthetic batch) under `jax.profiler`, reads
the trace's events for the compiled program's instructions and prints, per model, the milliseconds
per step by category, then the `--top` instructions of each category with their shape and the JAX
operation they came from. The categories follow what a fusion contains, in this order of precedence:
  - `matmul`: a dot or convolution (with whatever XLA fused around it);
  - `scatter`, `gather`: e.g. the transposes of DeBERTa's c2p/p2c gathers and the gathers themselves
    (a gather fused into the softmax counts here);
  - `random bits`: threefry rounds (dropout masks);
  - `copy/transpose`: layout changes;
  - `reduction`, `elementwise`: the rest.
Profiling adds about 10% to the step; compare categories and models within one run, and take
step times from `train_step.py`. An instruction split into parallel tasks counts the wall time
during which any of its tasks ran; independent instructions may still overlap on two cores. On CPU
the trace has one event per executed instruction; on GPU the device events carry the same names,
but this script reads the host-side events only.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_step import jax_case, model_config  # noqa: E402

CATEGORIES = ("matmul", "scatter", "gather", "random bits", "copy/transpose", "reduction", "elementwise")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+) ([\w\-]+)\((.*)$")


def instructions(hlo_text: str) -> dict[str, dict]:
    """Every instruction of an HLO module: name -> shape, opcodes inside it (its fused computation's,
    for a fusion) and the JAX operation it was traced from."""
    computations, current, body = {}, None, []
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$", line)
        if header:
            current, body = header.group(1), []
        elif line.startswith("}") and current:
            computations[current] = body
            current = None
        elif current:
            body.append(line)
    result = {}
    for lines in computations.values():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            name, shape, opcode, rest = match.groups()
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            inner = computations.get(called.group(1), []) if called else []
            opcodes = {opcode} | {m.group(3) for m in map(_INSTRUCTION.match, inner) if m}
            source = re.search(r'op_name="([^"]+)"', rest)
            result[name] = dict(shape=shape, opcodes=opcodes, source=source.group(1) if source else "")
    return result


def category(opcodes: set[str]) -> str:
    if opcodes & {"dot", "convolution"}:
        return "matmul"
    if "scatter" in opcodes:
        return "scatter"
    if "gather" in opcodes:
        return "gather"
    if opcodes & {"xor", "shift-right-logical"}:
        return "random bits"
    if opcodes & {"copy", "transpose"}:
        return "copy/transpose"
    if opcodes & {"reduce", "reduce-window"}:
        return "reduction"
    return "elementwise"


def profile(run, compiled, steps: int) -> tuple[dict[str, float], dict[str, dict]]:
    """Milliseconds per step spent in each instruction of `compiled`, from a trace of `steps` runs,
    and the `instructions` of its HLO."""
    with tempfile.TemporaryDirectory() as directory:
        with jax.profiler.trace(directory, create_perfetto_trace=True):
            for _ in range(steps):
                run()
        (trace,) = glob.glob(os.path.join(directory, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(trace) as f:
            events = json.load(f)["traceEvents"]
    known = instructions(compiled.as_text())
    intervals = collections.defaultdict(list)
    for event in events:
        if event.get("ph") == "X" and event.get("name") in known:
            intervals[event["name"]].append((event["ts"], event["ts"] + event["dur"]))
    # An instruction split into parallel tasks leaves one event per task and thread: count the wall
    # time during which any of them ran, not their sum.
    totals = {}
    for name, spans in intervals.items():
        covered, end = 0.0, float("-inf")
        for start, stop in sorted(spans):
            covered += max(0.0, stop - max(start, end))
            end = max(end, stop)
        totals[name] = covered / 1e3 / steps
    return totals, known


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert,deberta", help="comma-separated: bert, deberta")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after 2 unprofiled ones)")
    parser.add_argument("--top", type=int, default=4, help="instructions listed per category")
    parser.add_argument("--dropout", type=float, default=None)
    args = parser.parse_args(argv)
    for family in args.model.split(","):
        cfg, train_config = model_config(family, args.size, args.seq, None, "dense", 512, args.dropout)
        _, run, compiled = jax_case(cfg, train_config, "train", args.seq, args.batch)
        for _ in range(2):
            run()
        times, known = profile(run, compiled, args.steps)
        by_category = collections.defaultdict(list)
        for name, ms in times.items():
            by_category[category(known[name]["opcodes"])].append((ms, name))
        total = sum(times.values())
        print(f"\n{family} {args.size}, {args.seq} x {args.batch}: {total:.1f} ms of XLA ops per step (profiled)")
        for cat in sorted(CATEGORIES, key=lambda c: -sum(ms for ms, _ in by_category[c])):
            ops = sorted(by_category[cat], reverse=True)
            ms = sum(t for t, _ in ops)
            print(f"  {cat:15s} {ms:7.1f} ms  {100 * ms / total:4.1f}%  ({len(ops)} instructions)")
            for t, name in ops[:args.top]:
                info = known[name]
                print(f"      {t:6.1f} ms  {info['shape'][:34]:34s} {info['source'][-70:]}")


if __name__ == "__main__":
    main()
