"""CPU-scale ablation: DeBERTa's score terms and EMD, and the position schemes of the length literature.

    python -m deberta_jax.study.sweep --sweep configs/sweeps/ablation.py --sweep.data_dir=DIR

DIR holds brown/{train,valid}.txt and wikitext-2/test.txt (default `data/` in the repository).

Every variant trains the same small encoder (2 layers, hidden 128, 4 heads, length 64, 800 steps of
32 sequences = 1.6M tokens, about 1.3 epochs of Brown train) with 3 seeds, then is evaluated at 1x-8x
its training length on Brown valid and WikiText-2 test. The size is chosen so the 27 runs plus their
evaluation fit in about an hour and a half of an idle 2-core CPU (1.5 to 2.5 min per run); at this
scale only large effects are visible, which is why the report gives intervals over seeds. Probe runs
at this size (1,500 steps) showed why 800: DeBERTa leaves the unigram plateau by step 500 and is
still improving, while BERT is still on it at 1,500, so more steps would not change that contrast.

`:cpu` (default) is the core comparison (DeBERTa's Table 4 removals and the length literature's schemes), plus
NoPE as a floor. `:full` adds the rest
of the paper's Table 4 and the other position options (about 1.7x the cost).
The variants are `configs/sweeps/variants.py`'s.
"""

from ml_collections import config_dict

from configs.sweeps import variants

# Where brown/{train,valid}.txt and wikitext-2/test.txt live; override with --sweep.data_dir=DIR.
DEFAULT_DATA_DIR = "data"


def get_config(arg: str = "cpu"):
    sweep = config_dict.ConfigDict()
    sweep.title = "DeBERTa terms and position schemes, CPU scale"
    sweep.description = (
        "Tiny masked-LM encoders (2 x 128, 4 heads, vocab 4096) trained at length 64 on Brown train; "
        "chunked loss/accuracy at 1x, 2x, 4x, 8x the training length (mean and 95% t-interval over seeds). "
        "Learned absolute tables (BERT, DeBERTa EMD) are shown with the 'clip' policy here; summary.md adds "
        "the 'untrained' policy and the centred-target protocol. A unigram-frequency floor is scored on the same "
        "targets.")
    sweep.data_dir = DEFAULT_DATA_DIR
    data = sweep.get_ref("data_dir")
    sweep.variants = variants.core()
    if arg == "full":
        sweep.variants += variants.deberta_extras() + variants.absolute_baselines()
    sweep.seeds = [0, 1, 2]
    sweep.seq_lens = [64]
    recipe = variants.recipe()
    recipe["model"]["vocab_size"] = 4096
    sweep.common_overrides = config_dict.ConfigDict(dict(
        data=dict(train_files=data + "/brown/train.txt", eval_files=data + "/brown/valid.txt"), **recipe))
    sweep.workdir_root = "runs/ablation"
    sweep.report_dir = "results/ablation"
    sweep.table_policy = "clip"
    sweep.eval = variants.eval_settings(
        {"brown/valid": data + "/brown/valid.txt", "wikitext-2/test": data + "/wikitext-2/test.txt"},
        policies=["untrained", "clip"])
    if arg == "smoke":  # seconds: for tests of the runner
        sweep.variants = sweep.variants[:2]
        sweep.seeds = [0]
        variants.shrink_to_smoke(sweep, vocab_size=300)
    elif arg not in ("cpu", "full"):
        raise ValueError(f"unknown sweep arg {arg!r}; use 'cpu', 'full' or 'smoke'")
    return sweep
