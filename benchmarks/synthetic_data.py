"""Generation, tokenization and packing rates of the synthetic tasks (`deberta_jax.data.synthetic`).

    .venv/bin/python benchmarks/synthetic_data.py                      # every task, train split, defaults
    .venv/bin/python benchmarks/synthetic_data.py --split validation --params vocab=16,order=2

Prints one line per task: documents and tokens generated per second (`synthetic.documents`, the
chain's construction included), then the seconds to tokenize and pack those documents into rows of
`--seq-len` (`packing.pack_documents`, what a cache miss of `load_or_pack` costs on top). A run
reads its data once (the packed rows are cached), so these figures are to be set against the
minutes of a training run: data never dominates it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deberta_jax.data import packing, synthetic  # noqa: E402


def spec_of(task: str, split: str, params: str) -> str:
    return f"{synthetic.SYNTHETIC_PREFIX}{task}:{split}" + (f":{params}" if params else "")


def measure(spec: str, seq_len: int) -> str:
    """One report line: generation rates, then tokenize + pack time."""
    synthetic._build_chain.cache_clear()  # time the chain's construction too, as a fresh run pays it
    start = time.perf_counter()
    documents = synthetic.documents(spec)
    generate_s = time.perf_counter() - start
    tokens = sum(doc.count(" ") + 1 for doc in documents)
    tokenizer = synthetic.tokenizer(spec)
    start = time.perf_counter()
    packed = packing.pack_documents(documents, tokenizer, seq_len)
    pack_s = time.perf_counter() - start
    task = synthetic.parse(spec)
    return (f"{task.name:<8} {len(documents):>6} docs {tokens:>10,} tokens   generate {generate_s:6.2f} s: "
            f"{len(documents) / generate_s:>9,.0f} docs/s {tokens / generate_s:>12,.0f} tokens/s   "
            f"tokenize + pack (L={seq_len}) {pack_s:6.2f} s: {packed.num_rows:,} rows, "
            f"{tokens / pack_s:>10,.0f} tokens/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", default=",".join(synthetic.TASKS), help="comma-separated tasks")
    parser.add_argument("--split", default="train", choices=synthetic.SPLITS)
    parser.add_argument("--params", default="", help="PARAMS of the spec, e.g. vocab=16,order=2 (default: none)")
    parser.add_argument("--seq-len", type=int, default=128, help="row length for packing")
    args = parser.parse_args()
    print(f"synthetic data, split {args.split}, params {args.params or 'defaults'}:")
    for task in args.tasks.split(","):
        print(measure(spec_of(task, args.split, args.params), args.seq_len), flush=True)


if __name__ == "__main__":
    main()
