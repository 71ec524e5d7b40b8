"""A fingerprint of the train step `train.py` compiles on this machine: the optimized HLO with instruction names,
source locations and stack frames stripped, hashed. Two commits that print the same fingerprint run the same
program, so a change that should leave a backend's step alone can be checked exactly rather than timed (timings
on the shared CPU move by 10% between runs).

    python benchmarks/hlo_fingerprint.py [--config configs/deberta.py:tiny] [--seq 128] [--batch 16]
    git worktree add /tmp/before <commit> && (cd /tmp/before && python /path/to/benchmarks/hlo_fingerprint.py)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.getcwd())  # the checkout this is run from, so a worktree of another commit is measured

import jax  # noqa: E402

from deberta_jax.train import config_checks, programs, sharding  # noqa: E402


def structure(hlo_text: str) -> list[str]:
    """The program's instructions, shapes and layouts included, without instruction names, metadata or the
    stack-frame tables, sorted (the order XLA prints computations in is not part of the program)."""
    lines = []
    for line in hlo_text.splitlines():
        if line.startswith(("HloModule", "FileNames", "FunctionNames", "FileLocations", "StackFrames")) or \
                re.match(r'^\d+ ("|\{)', line):
            continue
        line = re.sub(r", metadata=\{[^}]*\}", "", line)
        lines.append(re.sub(r"%[\w.-]+", "%x", line.replace(".clone", "")))
    return sorted(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/deberta.py:tiny")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    config = config_checks.load_config_file(args.config)  # as train.py's --config loads it
    config.data.train_files = "unused.txt"  # validation wants a source; nothing is read
    config.data.seq_len, config.train.batch_size = args.seq, args.batch
    mesh = sharding.make_mesh(1, jax.devices()[:1])
    run = programs.build(config, config_checks.validate(config, num_devices=1), mesh)
    state = programs.abstract_with_sharding(run.abstract_state, run.state_sharding)
    compiled = run.train_step.lower(state, programs.abstract_batch(args.batch, args.seq, run.batch_sharding)).compile()
    lines = structure(compiled.as_text())
    print(f"{hashlib.sha256(chr(10).join(lines).encode()).hexdigest()[:16]}  {len(lines)} lines  {args.config} "
          f"{args.batch} x {args.seq} on {jax.default_backend()}")


if __name__ == "__main__":
    main()
