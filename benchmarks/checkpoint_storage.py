"""Checkpoints on a local disk, in gs:// and in s3://: save and restore time, and what checkpointing costs the train
step, for the `tiny` and `small` DeBERTa train states (parameters and AdamW moments), in one run.

    .venv/bin/python benchmarks/checkpoint_storage.py          # local API servers: fake-gcs-server and moto's S3
    .venv/bin/python benchmarks/checkpoint_storage.py --bucket gs://my-bucket/bench --bucket s3://other/bench

A store without `--bucket` is served by a server the script starts on a free local port (both installed by
requirements-test.txt): the figures then measure each protocol path over loopback, not a data-center network. gs://
is orbax writing to the bucket (tensorstore's uploads, orbax's commit files, the digests read from the listing);
s3:// is orbax saving to a local stage, then every file uploaded and the commit marker last (`staged_checkpoints`).
Per size and store it prints one JSON line:
  - `save_s`: one `checkpoint.save` (orbax save, commit, the digest record, and in s3:// the upload), median over
    `--rounds`;
  - `restore_s`: a new manager opened on the folder and `checkpoint.restore` of its newest step (listing, in s3://
    the download, digest check, read, finite check), as a resumed run does;
  - `step_s`: a train step alone; `step_s_checkpoint_every_K`: a train step when every K-th step also saves,
    measured as K steps plus a save, divided by K (K = `--every`);
  - `checkpoint_mb`: the checkpoint's size.
Rounds alternate between the stores, so all share the machine's load alike; compare them within one run.
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
    parser.add_argument("--bucket", action="append", default=[],
                        help="gs://bucket/folder or s3://bucket/folder to use instead of that store's local server "
                             "(repeatable)")
    parser.add_argument("--stores", default="local,gs,s3", help="which stores to time, comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--every", type=int, default=10, help="steps per checkpoint for step_s_checkpoint_every_K")
    parser.add_argument("--batch", type=int, default=8, help="rows per step (the state's size does not depend on it)")
    return parser.parse_args()


@contextlib.contextmanager
def store_roots(stores: list[str], given: list[str], scratch: str):
    """{store: folder to checkpoint into}: a given bucket, else one on a local server started here."""
    from tests.gcs_server import GcsServer
    from tests.s3_server import S3Server

    servers = {"gs": lambda: GcsServer(os.path.join(scratch, "objects")), "s3": S3Server}
    roots, started = {}, []
    try:
        for store in stores:
            url = next((g for g in given if g.startswith(f"{store}://")), None)
            if store == "local":
                roots[store] = os.path.join(scratch, "local")
            elif url:
                roots[store] = url
            else:
                server = servers[store]().start()
                started.append(server)
                os.environ.update(server.environment)
                roots[store] = server.make_bucket("checkpoint-bench") + "/bench"
        yield roots
    finally:
        for server in started:
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

    stores = args.stores.split(",")
    with tempfile.TemporaryDirectory() as scratch, store_roots(stores, args.bucket, scratch) as store_root:
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
            roots = {store: f"{root}/{size}" for store, root in store_root.items()}
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
                    reader = checkpoint.checkpoint_manager(roots[kind], read_only=True)
                    checkpoint.restore(reader, reader.latest_step(), targets)
                    reader.close()
                    restored = time.perf_counter()
                    times[kind]["save_s"].append(saved - stepped)
                    times[kind]["restore_s"].append(restored - saved)
                    times[kind]["block_s"].append((saved - start) / args.every)
            step_s = statistics.median(step_times)
            for kind, manager in managers.items():
                size_mb = storage.tree_bytes(
                    storage.path(roots[kind]) / checkpoint.CHECKPOINT_DIR / str(manager.latest_step())) / 2**20
                manager.close()
                print(json.dumps({
                    "size": size, "storage": kind, "where": "local disk" if kind == "local" else roots[kind],
                    "checkpoint_mb": round(size_mb, 3),
                    "save_s": round(statistics.median(times[kind]["save_s"]), 3),
                    "restore_s": round(statistics.median(times[kind]["restore_s"]), 3),
                    "step_s": round(step_s, 4),
                    f"step_s_checkpoint_every_{args.every}": round(statistics.median(times[kind]["block_s"]), 4),
                }), flush=True)


if __name__ == "__main__":
    main()
