"""Defaults shared by every model family: data, optimizer, schedule, logging and model shapes by size.

BERT and DeBERTa runs of one size get the *same* data, shapes and training recipe from here; the
family files (`bert.py`, `deberta.py`) only choose the attention variant and its position knobs, so
a comparison between them isolates the position scheme.

`config.model` lists every `ModelConfig` field (so any of them can be overridden from the command
line, e.g. `--config.model.pos_att_type=c2p`); `trained_length` is absent because `train.py` sets it
to `config.data.seq_len`.
"""

from __future__ import annotations

import dataclasses

from ml_collections import config_dict

from deberta_jax.model.config import ModelConfig

WIKITEXT_103 = "hf:wikitext:wikitext-103-raw-v1"

# Shapes and recipe per size. `micro` is the runlocal-style preset for tests and smoke runs
# (seconds on a laptop CPU); `tiny` trains on a 2-core CPU in minutes; `base` is BERT-base /
# DeBERTa-base (12 x 768, 12 heads, 3072, length 512) with BERT's batch of 256 sequences; `large` is BERT-large /
# DeBERTa-large (24 x 1024, 16 heads, 4096) with the same recipe.
SIZES = {
    "micro": dict(
        model=dict(num_layers=2, hidden_size=32, num_heads=4, intermediate_size=64, vocab_size=512),
        seq_len=32, batch_size=8, num_steps=100, learning_rate=1e-3, warmup_steps=10,
        log_every=10, eval_every=50, eval_batches=4, checkpoint_every=50),
    "tiny": dict(
        model=dict(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=1024, vocab_size=8192),
        seq_len=128, batch_size=32, num_steps=2000, learning_rate=5e-4, warmup_steps=100,
        log_every=25, eval_every=250, eval_batches=None, checkpoint_every=500),
    "small": dict(
        model=dict(num_layers=6, hidden_size=512, num_heads=8, intermediate_size=2048, vocab_size=32768),
        seq_len=256, batch_size=128, num_steps=100_000, learning_rate=3e-4, warmup_steps=2_000,
        log_every=100, eval_every=2_000, eval_batches=None, checkpoint_every=5_000),
    "base": dict(
        model=dict(num_layers=12, hidden_size=768, num_heads=12, intermediate_size=3072, vocab_size=32768),
        seq_len=512, batch_size=256, num_steps=1_000_000, learning_rate=1e-4, warmup_steps=10_000,
        log_every=100, eval_every=10_000, eval_batches=None, checkpoint_every=10_000),
    "large": dict(
        model=dict(num_layers=24, hidden_size=1024, num_heads=16, intermediate_size=4096, vocab_size=32768),
        seq_len=512, batch_size=256, num_steps=1_000_000, learning_rate=1e-4, warmup_steps=10_000,
        log_every=100, eval_every=10_000, eval_batches=None, checkpoint_every=10_000),
}


def get_base_config(size: str) -> config_dict.ConfigDict:
    """The family-independent config for `size`; `data.seq_len` is a FieldReference callers may link to."""
    if size not in SIZES:
        raise ValueError(f"unknown config size {size!r}; choose one of {sorted(SIZES)}, e.g. configs/bert.py:tiny")
    preset = SIZES[size]
    config = config_dict.ConfigDict()
    config.seed = 0

    config.data = config_dict.ConfigDict()
    # Data specs: local files (comma-separated paths or globs), hf:NAME[:CONFIG][:SPLIT] (the default, WikiText-103
    # from the Hub) or synthetic:TASK[:SPLIT][:PARAMS] (deberta_jax.data.synthetic).
    config.data.train_files = f"{WIKITEXT_103}:train"
    config.data.eval_files = f"{WIKITEXT_103}:validation"  # "" disables evaluation
    config.data.tokenizer = config_dict.placeholder(str)  # existing tokenizer.json; None trains one on train_files
    config.data.cache_dir = ".cache/packed"  # packed-token cache, shared between runs
    config.data.seq_len = config_dict.FieldReference(preset["seq_len"])
    config.data.mask_prob = 0.15
    # Training-side length recipes (deberta_jax.data.row_lengths): rows cut to random lengths from min_row_length
    # up (0: every row full), and rows of long_seq_len tokens for the last train.long_steps updates (0: none).
    config.data.min_row_length = 0
    config.data.long_seq_len = 0
    config.data.whole_word_masking = False

    model = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.name != "trained_length"}
    model["pos_att_type"] = "|".join(model["pos_att_type"])  # a string is easy to override: c2p, p2c, c2p|p2c
    model.update(**preset["model"])
    config.model = config_dict.ConfigDict(model)

    # Devices form a (data, fsdp) mesh: fsdp > 1 splits parameters and optimizer state over that many
    # devices (FSDP, for models that outgrow one device's memory); the batch is split over all of them.
    config.mesh = config_dict.ConfigDict()
    config.mesh.fsdp = 1

    config.train = config_dict.ConfigDict()
    config.train.num_steps = preset["num_steps"]
    config.train.batch_size = preset["batch_size"]  # global, in sequences, across devices and micro-batches
    config.train.grad_accum_steps = 1
    config.train.learning_rate = preset["learning_rate"]
    config.train.warmup_steps = preset["warmup_steps"]
    config.train.long_steps = 0  # the last updates, trained on rows of data.long_seq_len (short-then-long)
    config.train.long_share = 1.0  # of those, the share on long rows; the rest (spread evenly) on rows of seq_len
    config.train.schedule = "linear"  # decay after warmup: "linear" or "cosine", to 0 at num_steps
    # AdamW as in RoBERTa/DeBERTa (b2=0.98, eps=1e-6 are steadier than BERT's 0.999/1e-8 for post-LN).
    config.train.weight_decay = 0.01
    config.train.b1 = 0.9
    config.train.b2 = 0.98
    config.train.eps = 1e-6
    config.train.grad_clip_norm = 1.0
    config.train.log_every = preset["log_every"]
    config.train.eval_every = preset["eval_every"]
    config.train.eval_batches = config_dict.FieldReference(preset["eval_batches"], field_type=int)  # None: all
    config.train.checkpoint_every = preset["checkpoint_every"]
    config.train.keep_checkpoints = 2  # the latest N, plus the best by eval loss
    return config
