"""Natural text past the unigram plateau: BERT, NoPE and DeBERTa trained on the same Brown batches with a recipe
under which learned-absolute BERT does learn from context, then length-evaluated on Brown and WikiText-2.

    python -m deberta_jax.study.sweep --sweep configs/sweeps/natural.py --sweep.data_dir=DIR
    python -m deberta_jax.study.curves --workdir bert=runs/natural/bert-L64-s0 \
        --workdir nope=runs/natural/nope-L64-s0 --workdir deberta-emd=runs/natural/deberta-emd-L64-s0 \
        --out results/natural/curves

DIR holds brown/{train,valid}.txt and wikitext-2/test.txt. With the ablation recipe (`variants.recipe()`: 800
steps at learning rate 1e-3, dropout 0.1, 15% masking) BERT, NoPE and T5 never leave the unigram plateau on Brown.
Probes on the same 2 x 128 encoder (results/natural/README.md) found what moves BERT off it: a higher learning
rate (2e-3), no dropout, 30% masking (more predictions per step) and many more steps (10,000 steps of 32 x 64
tokens, 20M tokens, about 15 epochs of Brown train); pre-LayerNorm layers were no better than post-LN at equal
steps, so the published post-LN is kept. The recipe is the same for every variant. DeBERTa here is the
relative-only model (no EMD, `deberta-emd` in Table 4's naming), so no absolute position enters it anywhere.
Two seeds per variant (about 50 minutes of one CPU core each run); the seed sets the initialisation, the batch
order and the masks, so the runs of one seed still share their batches.

`:core` is the ablation sweep's variant set (`variants.core()`: DeBERTa with each Table 4 removal, RoPE, ALiBi,
T5 bias, NoPE) under this recipe, the ablation rerun with the recipe that moves BERT, at seed 0 only. It shares
`runs/natural` with the default set (same recipe, same workdir names), so the three runs above are trained once;
its report goes to results/natural-core.
"""

from ml_collections import config_dict

from configs.sweeps import variants

DEFAULT_DATA_DIR = "data"
NAMES = ("bert", "nope", "deberta-emd")


def recipe() -> dict:
    """The ablation's encoder and batch, trained longer, harder and without dropout (see the module docstring)."""
    out = variants.recipe()
    out["model"].update(vocab_size=4096, hidden_dropout=0.0, attention_dropout=0.0)
    out["train"].update(num_steps=10_000, learning_rate=2e-3, eval_every=250, checkpoint_every=2500)
    out["data"] = dict(mask_prob=0.3)
    return out


def get_config(arg: str = ""):
    if arg not in ("", "core", "smoke"):
        raise ValueError(f"unknown sweep arg {arg!r}; use '', 'core' or 'smoke'")
    sweep = config_dict.ConfigDict()
    sweep.title = ("DeBERTa terms and position schemes, natural-text recipe" if arg == "core"
                   else "BERT past the unigram plateau on natural text")
    sweep.description = (
        "Masked-LM encoders (2 x 128, 4 heads, vocab 4096) trained at length 64 on Brown train for 10,000 steps of "
        "32 sequences (learning rate 2e-3, no dropout, 30% masking), the same batches for every variant; chunked "
        "loss and accuracy on Brown valid and WikiText-2 test at 1x-8x the training length "
        + ("(one seed: 95% bootstrap intervals over documents). " if arg == "core" else
           "(mean of two seeds with a 95% t-interval over seeds, wide at two: results.json has each seed). ")
        + "BERT's learned table is shown with the 'clip' policy here; summary.md has "
        "'untrained' and 'interpolate' and the fixed-target protocol. `unigram` is the context-free floor.")
    sweep.data_dir = DEFAULT_DATA_DIR
    data = sweep.get_ref("data_dir")
    sweep.variants = variants.core() if arg == "core" else [v for v in variants.core() if v.name in NAMES]
    sweep.seeds = [0] if arg == "core" else [0, 1]
    sweep.seq_lens = [64]
    overrides = recipe()
    overrides["data"].update(train_files=data + "/brown/train.txt", eval_files=data + "/brown/valid.txt")
    sweep.common_overrides = config_dict.ConfigDict(overrides)
    sweep.workdir_root = "runs/natural"
    sweep.report_dir = "results/natural-core" if arg == "core" else "results/natural"
    sweep.table_policy = "clip"
    sweep.eval = config_dict.ConfigDict(dict(
        data_files={"brown/valid": data + "/brown/valid.txt", "wikitext-2/test": data + "/wikitext-2/test.txt"},
        multiples=[1, 2, 4, 8], extra=[], policies=["untrained", "clip", "interpolate"],
        protocols=["chunked", "fixed_target"], max_eval_tokens=30000, num_targets=32, bootstrap=1000))
    if arg == "smoke":  # seconds: for tests of the config
        sweep.common_overrides.model.update(dict(num_layers=1, hidden_size=32, intermediate_size=64, vocab_size=300))
        sweep.common_overrides.train.update(dict(num_steps=4, batch_size=4, warmup_steps=1, eval_every=4,
                                                 checkpoint_every=4, log_every=2))
        sweep.seq_lens = [16]
        sweep.eval.multiples = [1, 2]
        sweep.eval.max_eval_tokens, sweep.eval.num_targets, sweep.eval.bootstrap = 3000, 8, 50
    return sweep
