"""Checkpoints on a local disk against checkpoints in a bucket: save and restore time, and what checkpointing costs the
train step, for the `tiny` and `small` DeBERTa train states (parameters and AdamW moments), in one run.

    .venv/bin/python benchmarks/checkpoint_storage.py                    # a local GCS API server (fake-gcs-server)
    .venv/bin/python benchmarks/checkpoint_storage.py --bucket gs://my-bucket/bench   # a real bucket

Without `--bucket` the script starts fake-gcs-server (installed by requirements-test.txt) on a free local port: the
figures then measure the GCS protocol path (orbax's commit-file protocol, tensorstore's uploads, the digests read from
the listing) over loopback, not a data-center network. Per size it prints one JSON line:
  - `save_s` / `restore_s`: one `checkpoint.save` (orbax save, commit, and the digest record) and one
    `checkpoint.restore` (digest check, read, finite check), median over `--rounds`;
  - `step_s`: a train step alone; `step_s_checkpoint_every_K`: a train step when every K-th step also saves,
    measured as K steps plus a save, divided by K (K = `--every`);
  - `checkpoint_mb`: the checkpoint's size.
Rounds alternate local and bucket, so both share the machine's load alike; compare them within one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,small", help="configs/deberta.py sizes, comma-separated")
    parser.add_argument("--bucket", default=None, help="gs://bucket/folder to use instead of a local GCS server")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="steps per checkpoint for step_s_checkpoint_every_K")
    parser.add_argument("--batch", type=int, default=8, help="rows per step (the state's size does not depend on it)")
    return parser.parse_args()


@contextlib.contextmanager
def bucket_root(given: str | None, scratch: str):
    if given:
        yield given
        return
    from tests.gcs_server import GcsServer

    server = GcsServer(os.path.join(scratch, "objects")).start()
    os.environ.update(server.environment)
    try:
        yield server.make_bucket("checkpoint-bench") + "/bench"
    finally:
        server.stop()


def main():
    args = parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    from configs import deberta
    from deberta_jax import storage
    from deberta_jax.data import batches
    from deberta_jax.data.packing import PackedData
    from deberta_jax.data.tokenizer import SpecialIds
    from deberta_jax.train import checkpoint, config_checks, sharding
    from deberta_jax.train import programs as run_programs

    with tempfile.TemporaryDirectory() as scratch, bucket_root(args.bucket, scratch) as remote:
        for size in args.sizes.split(","):
            config = deberta.get_config(size)
            config.train.batch_size = args.batch
            model_config = config_checks.validate(config, num_devices=jax.device_count())
            programs = run_programs.build(config, model_config, sharding.make_mesh(1))
            state = programs.init()
            special = SpecialIds(pad=0, unk=1, cls=2, sep=3, mask=4)
            masker = batches.Masker(special, model_config.vocab_size, config.data.mask_prob, False)
            rng = np.random.default_rng(0)
            ids = rng.integers(5, model_config.vocab_size, (args.batch, config.data.seq_len), dtype=np.int32)
            packed = PackedData(ids, np.ones_like(ids), np.ones_like(ids, dtype=bool))
            batch = sharding.global_batch(
                batches.train_batch(packed, masker, batch_size=args.batch, step=0, seed=0, process_index=0,
                                    process_count=1), programs.batch_sharding)
            targets = run_programs.abstract_with_sharding(programs.abstract_state, programs.state_sharding)

            def steps(n, state, train_step=programs.train_step, batch=batch):
                for _ in range(n):
                    state, metrics = train_step(state, batch)
                jax.block_until_ready(metrics)
                return state

            state = steps(2, state)  # compiled
            roots = {"local": os.path.join(scratch, f"local-{size}"), "bucket": f"{remote}/{size}"}
            managers = {kind: checkpoint.checkpoint_manager(root, keep=2) for kind, root in roots.items()}
            times = {kind: {"save_s": [], "restore_s": [], "block_s": []} for kind in roots}
            step_times = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                state = steps(args.every, state)
                step_times.append((time.perf_counter() - start) / args.every)
                for kind, manager in managers.items():
                    start = time.perf_counter()
                    state = steps(args.every, state)
                    stepped = time.perf_counter()
                    checkpoint.save(manager, state)
                    saved = time.perf_counter()
                    checkpoint.restore(manager, int(state.step), targets)
                    restored = time.perf_counter()
                    times[kind]["save_s"].append(saved - stepped)
                    times[kind]["restore_s"].append(restored - saved)
                    times[kind]["block_s"].append((saved - start) / args.every)
            step_s = statistics.median(step_times)
            for kind, manager in managers.items():
                size_mb = storage.tree_bytes(storage.path(manager.directory) / str(manager.latest_step())) / 2**20
                manager.close()
                print(json.dumps({
                    "size": size, "storage": kind, "where": roots[kind] if kind == "bucket" else "local disk",
                    "checkpoint_mb": round(size_mb, 3),
                    "save_s": round(statistics.median(times[kind]["save_s"]), 3),
                    "restore_s": round(statistics.median(times[kind]["restore_s"]), 3),
                    "step_s": round(step_s, 4),
                    f"step_s_checkpoint_every_{args.every}": round(statistics.median(times[kind]["block_s"]), 4),
                }), flush=True)


if __name__ == "__main__":
    main()
