"""Training: `steps` (the state and the pure init / train / eval step functions), `optim` (AdamW and its
schedule), `sharding` (the device mesh), `checkpoint` (the workdir, orbax checkpoints, `load_workdir`),
`metrics_io` (metrics.jsonl and TensorBoard), `validation` (the experiment config, checked once at start-up)
and `workdir_lock` (one run per workdir).

May import `deberta_jax.data` and `deberta_jax.model`; nothing from study. `train.py` runs the loop.
"""
