"""Throughput, memory and FLOP utilization of the masked-LM train step (or eval forward), BERT vs DeBERTa.

    .venv/bin/python benchmarks/train_step.py --model bert,deberta --size tiny --seq 128 --batch 16
    .venv/bin/python benchmarks/train_step.py --model deberta --seq 512 --batch 4 --compare-transformers
    .venv/bin/python benchmarks/train_step.py --mode eval --model deberta --seq 8192 --batch 1 --kernel blockwise

Prints one JSON line per case (every combination of the comma-separated --model, --seq, --kernel):
  - `tokens_per_s`: tokens through the jitted step per second at the fastest timed step (`step_s`;
    the median is `median_step_s`), on a shared machine the least disturbed one. "train" is
    `steps.make_train_step` exactly as `train.py` runs it (forward, backward, AdamW, dropout on);
    "eval" is `steps.make_eval_step` (the forward pass and masked-LM sums evaluation runs);
  - `memory_mb`: XLA's buffer assignment for the compiled step (arguments + outputs + scratch -
    donated aliases), the step's peak device memory. CPUs report no live allocator statistics, so
    this is a compile-time figure, the same on any machine, and available for shapes too large to run
    (`--compile-only`);
  - `model_flops_per_token`: matmul FLOPs of the model (see `model_flops_per_token`), times 3 for a
    train step (forward + backward), and `mfu`: achieved model FLOP/s over `matmul_peak_flops`, the
    FLOP/s of a large float32 `jnp.dot` measured in the same process; `..._head_everywhere`: the same
    with the MLM head counted at every position (transformers' arithmetic; work our step skips);
  - with `--compare-transformers`: the same shape, configuration and step (AdamW, dropout on; or
    `no_grad` forward) with transformers' PyTorch `BertForMaskedLM` / `DebertaV2ForMaskedLM`, and
    `speedup_vs_torch`. transformers' head scores every position against the vocabulary; ours scores
    only the masked ones (`steps.prediction_budget`), as the training code does.
All cases are compiled first, then run in rounds (each case, and the matmul peak, once per round:
`--warmup` untimed rounds, then `--steps` timed ones), so that cases compared in one run share the
machine's load alike; each reports its fastest round. Seconds per case at the tiny size. Timings on a
shared CPU are indicative: compare cases measured in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from configs import bert, deberta  # noqa: E402
from deberta_jax.aot import chips  # noqa: E402
from deberta_jax.model.config import ModelConfig  # noqa: E402
from deberta_jax.model.flops import model_flops  # noqa: E402
from deberta_jax.train import optim, steps  # noqa: E402

FAMILIES = {"bert": bert, "deberta": deberta}
# DeBERTa-v3's released relative table (position_buckets, max_relative_positions), the same at any length; the
# configs' own grows with the training length.
PUBLISHED_TABLE = (256, 512)
MASK_PROB = 0.15


def model_config(family: str, size: str, seq: int, trained_length: int | None, kernel: str, block_size: int,
                 dropout: float | None = None, relative_terms: str = "auto",
                 dtype: str | None = None, relative_table: str = "grown") -> tuple[ModelConfig, object]:
    """The `configs/<family>.py:<size>` model trained at `trained_length` (default `seq`) and its train config.

    DeBERTa's relative table follows the training length (configs/deberta.py); BERT's absolute table
    keeps its 512 rows and, for eval lengths past it, clips (the cost is the same for every policy).
    """
    config = FAMILIES[family].get_config(size)
    config.data.seq_len = trained_length or seq
    model = dict(config.model.to_dict(), attention_kernel=kernel, attention_block_size=block_size,
                 relative_terms=relative_terms)
    if dropout is not None:
        model.update(hidden_dropout=dropout, attention_dropout=dropout)
    if kernel == "cudnn":  # cuDNN's kernel has no attention dropout; the hidden dropout stays
        model.update(attention_dropout=0.0)
    if dtype is not None:
        model.update(dtype=dtype)
    if family == "deberta" and relative_table == "published":
        model.update(position_buckets=PUBLISHED_TABLE[0], max_relative_positions=PUBLISHED_TABLE[1])
    model.update(max_position_embeddings=max(model["max_position_embeddings"], config.data.seq_len),
                 trained_length=config.data.seq_len, absolute_position_policy="clip")
    return ModelConfig.from_dict(model), config.train


def model_flops_per_token(cfg: ModelConfig, seq: int, batch: int, head_everywhere: bool = False) -> float:
    """Forward matmul FLOPs per token (2 per multiply-add) as the model's arithmetic defines them
    (`deberta_jax.model.flops.model_flops`), with the MLM head on the `prediction_budget` positions only, or with
    `head_everywhere` on every position, as transformers' models compute it (the convention of the "33 MFLOP per
    token" for BERT tiny at 128: FLOPs that the loss does not need, so an MFU counted with them flatters the step).
    Gathers, softmax and LayerNorm are not counted.
    """
    predicted = batch * seq if head_everywhere else steps.prediction_budget(batch * seq, MASK_PROB)
    return model_flops(cfg, batch, seq, predicted, train=False) / (batch * seq)


def matmul_peak(n: int = 2048, dtype: str = "float32") -> Callable[[], float]:
    """A step that times one `n x n` `jnp.dot` in `dtype` (the models') and returns its FLOP/s: the machine's
    practical matmul peak, measured in the rounds alongside the cases (the best round counts)."""
    a = jax.random.normal(jax.random.key(0), (n, n), dtype)
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    return lambda: 2 * n**3 / _timed(lambda: dot(a, a).block_until_ready())


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def synthetic_batch(cfg: ModelConfig, seq: int, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tokens with 15% of positions masked (labels and weights as `deberta_jax.data.batches` makes them)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(5, cfg.vocab_size, size=(batch, seq), dtype=np.int32)
    weights = (rng.random((batch, seq)) < MASK_PROB).astype(np.float32)
    return dict(input_ids=ids, attention_mask=np.ones_like(ids), labels=ids.copy(), weights=weights)


def memory_mb(compiled) -> float:
    m = compiled.memory_analysis()
    total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
    return total / 2**20


def jax_case(cfg: ModelConfig, train_config, mode: str, seq: int, batch: int) -> tuple[dict, Callable, object]:
    """Compile the jitted train or eval step: (compile time and memory, a function running one step,
    the compiled executable)."""
    schedule = optim.learning_rate_schedule(1e-4, 10, 1000, "linear")
    optimizer = optim.make_optimizer(train_config, schedule, cfg)
    graphdef = steps.model_graphdef(cfg)
    batch_arrays = {k: jnp.asarray(v) for k, v in synthetic_batch(cfg, seq, batch).items()}
    init = steps.make_init_fn(cfg, optimizer, seed=0)
    if mode == "train":
        step = jax.jit(steps.make_train_step(graphdef, optimizer, schedule, seed=0, grad_accum_steps=1,
                                             mask_prob=MASK_PROB), donate_argnums=0)
        abstract = jax.eval_shape(init)
    else:
        step = jax.jit(steps.make_eval_step(graphdef, mask_prob=MASK_PROB))
        abstract = jax.eval_shape(init).params
    start = time.perf_counter()
    compiled = step.lower(abstract, batch_arrays).compile()
    info = dict(compile_s=round(time.perf_counter() - start, 1), memory_mb=round(memory_mb(compiled), 1))
    state = [jax.jit(init)() if mode == "train" else jax.jit(lambda: init().params)()]

    def run():
        result = compiled(state[0], batch_arrays)
        jax.block_until_ready(result)
        if mode == "train":
            state[0] = result[0]  # the old state was donated
    return info, run, compiled


def torch_case(cfg: ModelConfig, mode: str, seq: int, batch: int) -> tuple[dict, Callable]:
    """The same shape and step with transformers' PyTorch masked-LM models (threads: torch's default)."""
    import torch
    import transformers

    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
                  num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
                  hidden_act=cfg.hidden_act, hidden_dropout_prob=cfg.hidden_dropout,
                  attention_probs_dropout_prob=cfg.attention_dropout, layer_norm_eps=cfg.layer_norm_eps,
                  max_position_embeddings=max(cfg.max_position_embeddings, seq))
    if cfg.attention == "disentangled":
        config = transformers.DebertaV2Config(
            **common, type_vocab_size=0, relative_attention=True, position_biased_input=False,
            max_relative_positions=cfg.max_relative_positions, position_buckets=cfg.position_buckets,
            pos_att_type=list(cfg.pos_att_type), norm_rel_ebd=cfg.norm_rel_ebd, share_att_key=cfg.share_att_key)
        model = transformers.DebertaV2ForMaskedLM(config)
    else:
        model = transformers.BertForMaskedLM(transformers.BertConfig(**common, type_vocab_size=1))
    data = synthetic_batch(cfg, seq, batch)
    ids = torch.from_numpy(data["input_ids"]).long()
    mask = torch.from_numpy(data["attention_mask"]).long()
    labels = torch.where(torch.from_numpy(data["weights"]) > 0, ids, torch.full_like(ids, -100))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.01)

    def train_step():
        model.train()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    def eval_step():
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, labels=labels)

    return (dict(torch_threads=torch.get_num_threads(), transformers=transformers.__version__),
            train_step if mode == "train" else eval_step)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="bert,deberta", help="comma-separated: bert, deberta")
    parser.add_argument("--size", default="tiny", help="configs/common.py size: micro, tiny, small, base")
    parser.add_argument("--seq", default="128", help="comma-separated sequence lengths")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--mode", choices=("train", "eval"), default="train")
    parser.add_argument("--kernel", default="dense",
                        help="comma-separated: dense, blockwise, pallas (fused; interpreted off a GPU), cudnn "
                             "(BERT: jax.nn.dot_product_attention, without attention dropout)")
    parser.add_argument("--block-size", type=int, default=512, help="keys per block of the blockwise kernel")
    parser.add_argument("--relative-terms", default="auto",
                        help="comma-separated: how the dense kernel computes DeBERTa's c2p / p2c (auto, gather, shift)")
    parser.add_argument("--trained-length", type=int, default=None,
                        help="length the model is configured as trained at (DeBERTa's relative table, BERT's "
                             "absolute table); default: --seq. Eval past training: "
                             "e.g. --seq 8192 --trained-length 512")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dropout", type=float, default=None,
                        help="hidden and attention dropout rate of both implementations (default: the config's); "
                             "0 shows what the masks cost")
    parser.add_argument("--dtype", default=None, help="the models' dtype (default: the config's), e.g. bfloat16 on "
                        "GPUs; the matmul peak MFU divides by is measured in it")
    parser.add_argument("--relative-table", choices=("grown", "published"), default="grown",
                        help="DeBERTa's relative table: the configs' (grows with the training length) or "
                             "DeBERTa-v3's published one (256 buckets up to 512)")
    parser.add_argument("--compile-only", action="store_true", help="report memory without running the step")
    parser.add_argument("--compare-transformers", action="store_true")
    args = parser.parse_args(argv)

    rows, runs = [], {}  # runs: (row index, "" or "torch_") -> step function
    for family in args.model.split(","):
        for seq in map(int, args.seq.split(",")):
            # Only the dense kernel's DeBERTa terms have two formulations.
            for kernel, relative_terms in ((name, terms) for name in args.kernel.split(",") for terms in (
                    args.relative_terms.split(",") if family == "deberta" and name == "dense" else ["auto"])):
                cfg, train_config = model_config(family, args.size, seq, args.trained_length, kernel, args.block_size,
                                                 args.dropout, relative_terms, args.dtype, args.relative_table)
                passes = 3 if args.mode == "train" else 1
                row = dict(model=family, size=args.size, mode=args.mode, kernel=kernel, seq=seq, batch=args.batch,
                           relative_terms=cfg.relative_terms_for(jax.default_backend()),
                           dropout=cfg.hidden_dropout,
                           model_flops_per_token=round(passes * model_flops_per_token(cfg, seq, args.batch)),
                           model_flops_per_token_head_everywhere=round(
                               passes * model_flops_per_token(cfg, seq, args.batch, head_everywhere=True)))
                info, runs[len(rows), ""], _ = jax_case(cfg, train_config, args.mode, seq, args.batch)
                row.update(info)
                if args.compare_transformers:
                    info, runs[len(rows), "torch_"] = torch_case(cfg, args.mode, seq, args.batch)
                    row.update(info)
                rows.append(row)
    if args.compile_only:
        for row in rows:
            print(json.dumps(row), flush=True)
        return

    # Rounds: every case (and the matmul peak) once per round, so that all of them see the same
    # share of a busy machine; each keeps its fastest timed round.
    peak, best_peak = matmul_peak(dtype=args.dtype or "float32"), 0.0
    times = {name: [] for name in runs}
    for round_index in range(args.warmup + args.steps):
        best_peak = max(best_peak, peak())
        for name, run in runs.items():
            elapsed = _timed(run)
            if round_index >= args.warmup:
                times[name].append(elapsed)
    for (index, prefix), elapsed in times.items():
        row = rows[index]
        tokens = row["batch"] * row["seq"]
        row[prefix + "step_s"] = round(min(elapsed), 4)
        row[prefix + "median_step_s"] = round(statistics.median(elapsed), 4)
        row[prefix + "tokens_per_s"] = round(tokens / min(elapsed), 1)
    chip = chips.gpu_of_device(jax.devices()[0])
    for row in rows:
        row.update(matmul_peak_flops=round(best_peak),
                   # 4 significant digits: a micro model's MFU on a busy CPU is well below 1e-3
                   **{"mfu" + suffix: float(
                       f'{row["tokens_per_s"] * row["model_flops_per_token" + suffix] / best_peak:.4g}')
                      for suffix in ("", "_head_everywhere")})
        if chip is not None:  # MFU against the datasheet's dense bfloat16 peak, as published MFU figures count it
            mfu = row["tokens_per_s"] * row["model_flops_per_token"] / chip.peak_flops
            row.update(datasheet_peak_flops=chip.peak_flops, mfu_datasheet=float(f"{mfu:.4g}"))
        if args.compare_transformers:
            row["speedup_vs_torch"] = round(row["tokens_per_s"] / row["torch_tokens_per_s"], 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
