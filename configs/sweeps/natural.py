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

`:seeds` asks how often BERT learns its positions at this budget: BERT and NoPE at seeds 0-4 (NoPE is what BERT
is without its table, so a seed whose BERT ends below its NoPE used the table), scored past the training length
with the log-length temperature and the sliding window too. `python -m deberta_jax.study.seed_rate` reads their
curves and gives the share of seeds, and the step, at which BERT leaves NoPE's plateau.

`:flat` asks what keeps DeBERTa flat past the training length: the relative-only model as above and with the
published v3 bucket setting (256 buckets, distances to 512: every distance of an 8x evaluation has its own row,
but only rows within the training length are ever trained), and RoPE and T5 bias, two seeds, each scored as
trained and under every length method (`deberta_jax.study.length_study.LENGTH_METHODS`: log-length temperature,
sliding window, interpolated distances).

`:core` is the ablation sweep's variant set (`variants.core()`: DeBERTa with each Table 4 removal, RoPE, ALiBi,
T5 bias, NoPE) under this recipe, the ablation rerun with the recipe that moves BERT, at seed 0 only. It shares
`runs/natural` with the default set (same recipe, same workdir names), so the three runs above are trained once;
its report goes to results/natural-core.

`:far` asks how far `:flat`'s answer reaches, and whether a temperature learned in training does better than one
applied at evaluation: relative-only DeBERTa, RoPE and T5 bias as in `:flat` (the same runs), and DeBERTa and RoPE
trained with Scalable-Softmax's learned temperature (`attention_temperature="learned"`: a slope per head times
log(keys seen), from the first step), two seeds, scored to 32x (2,048 tokens) as trained, with the log-length
temperature (not for the learned ones, which already scale by log(keys seen)), the window, and the window that
keeps each row's [CLS] and closing [SEP] visible to every query. Its report goes to results/natural-far.

`:scale` asks whether `:flat`'s answer holds at a second scale: a 4 x 128 encoder trained at length 128 for 5,000
steps of 32 x 128 (the same 20M tokens as the recipe above, the rest of the recipe unchanged), relative-only
DeBERTa, RoPE and T5 bias at two seeds, scored to 16x (2,048 tokens) as trained, with the log-length temperature and
with the window. About two hours of one CPU core per run; runs/natural-scale, report to results/natural-scale.

`:past` asks whether training, rather than evaluation, can make DeBERTa *use* keys past the training length instead
of only surviving them (the window is flat because it never looks past L): relative-only DeBERTa trained with the
training-side length recipes of `deberta_jax.data.row_lengths`, the rest of the recipe unchanged, two seeds, scored
to 32x as `:far` scores: `-long256` trains its last 1,000 of the 10,000 steps on 8 rows of 256 tokens (the same
tokens per step; short-then-long), `-learned-long256` does so with the learned temperature, and `-learned-mixed16`
trains the learned temperature on rows cut to 16-64 tokens (the key count varies inside the training length); the
`-learned-long<N>-mixed` runs end with a long phase of rows of N tokens each cut to 64-N, for N = 256, 512 and 2,048
(the last covers every key count the scoring reaches, at the highest cost per token), and `-half` alternates that
longest phase's steps with steps on full rows of 64 (`train.long_share=0.5`), so the model keeps training at the
length it is scored at most while it sees every key count; `-half2000` does so over the last 2,000 steps, as many
long steps as the phase it halves. Scalable-Softmax's slope only
scales a head's scores (its factor grows by log(n) / log(L) whatever it learns), so `-rate-long512-mixed` trains the
64-512 phase with a temperature whose growth with log(keys) is learned (`attention_temperature="learned_rate"`).
`-kerple` adds KERPLE's learned log-distance decay to DeBERTa's scores (`score_bias="kerple_log"`, two rates per
head: `-r1 log(1 + r2 |i - j|)`) and trains on rows of 64 only, at the plain model's cost per token: instead of
training on more keys, it down-weights the far ones at every length. `-kerple-long2048-mixed-half2000` gives the
decay `-half2000`'s phase (without the learned temperature): on rows of 64 the decay's rates only ever see distances
under 64 and stay near their start, so its shape past L is an extrapolation; the long rows fit it there, while the
decay's gain at 1x may pay for the phase's cost there. `-kerple-sigmoid-long2048-mixed-half2000` is that run with
sigmoid weights instead of a softmax (`attention_weights="sigmoid"`): each key weighs the sigmoid of its own score,
so the keys past L add what the decay leaves them without diluting the weights of the keys within L. Its
runs share runs/natural with `:far`, whose `deberta-emd` and
`deberta-emd-learned` are the baselines; its report goes to results/natural-past. `:past-scale` is the same recipes
at `:scale`'s size (4 x 128 at length 128, 5,000 steps: the last 500 on rows of 512, or on rows of 512, 1,024 or
2,048 cut to 128-N; or rows of 32-128 throughout), scored to 16x, in runs/natural-scale beside `:scale`'s baseline;
report to results/natural-past-scale.
"""

from ml_collections import config_dict

from configs.sweeps import variants
from deberta_jax.model.config import ModelConfig

DEFAULT_DATA_DIR = "data"
NAMES = ("bert", "nope", "deberta-emd")
SEED_NAMES = ("bert", "nope")
# The relative-only DeBERTa, and the relative schemes whose length behaviour the methods should also be tried on.
FLAT_NAMES = ("deberta-emd", "rope", "t5-bias")
# The published DeBERTa-v3 relative table, whatever the training length.
V3_BUCKETS = dict(position_buckets=256, max_relative_positions=512)
ARGS = ("", "core", "seeds", "flat", "far", "scale", "past", "past-scale", "smoke")
FAR_MULTIPLES = [1, 2, 4, 8, 16, 32]
_LEARNED = dict(attention_temperature="learned")
# The temperature whose growth with log(keys) is learned (its factor is 1 at L keys whatever it learns).
_RATE = dict(attention_temperature="learned_rate")
# The second scale: twice the layers at twice the training length, half the steps (the same tokens).
SCALE_MODEL = dict(num_layers=4)
SCALE_SEQ_LEN, SCALE_STEPS, SCALE_MULTIPLES = 128, 5_000, [1, 2, 4, 8, 16]
TITLES = {"": "BERT past the unigram plateau on natural text",
          "core": "DeBERTa terms and position schemes, natural-text recipe",
          "seeds": "How often BERT learns its positions: five seeds of BERT and NoPE, natural-text recipe",
          "flat": "Keeping DeBERTa flat past the training length: length methods and v3 buckets, natural-text recipe",
          "far": "How far the length methods reach, and a learned temperature: to 32x, natural-text recipe",
          "scale": "Keeping DeBERTa flat at a second scale: 4 x 128 trained at length 128, natural-text recipe",
          "past": "Past the window: training-side recipes for a DeBERTa that uses more keys than it trained on",
          "past-scale": "Past the window at a second scale: training-side recipes, 4 x 128 trained at length 128"}


def recipe() -> dict:
    """The ablation's encoder and batch, trained longer, harder and without dropout (see the module docstring)."""
    out = variants.recipe()
    out["model"].update(vocab_size=4096, hidden_dropout=0.0, attention_dropout=0.0)
    out["train"].update(num_steps=10_000, learning_rate=2e-3, eval_every=250, checkpoint_every=2500)
    out["data"] = dict(mask_prob=0.3)
    return out


def _variants(arg: str) -> list:
    if arg == "core":
        return variants.core()
    if arg == "seeds":
        return [v for v in variants.core() if v.name in SEED_NAMES]
    if arg == "scale":
        return [v for v in variants.core() if v.name in FLAT_NAMES]
    if arg == "far":
        chosen = [v for v in variants.core() if v.name in FLAT_NAMES]
        return chosen + [variants.variant(f"{v.name}-learned", v.config, **v.overrides.model, **_LEARNED)
                         for v in chosen if v.name != "t5-bias"]
    if arg == "flat":
        chosen = [v for v in variants.core() if v.name in FLAT_NAMES]
        return chosen + [variants.variant("deberta-emd-b256", variants.DEBERTA, **V3_BUCKETS)]
    return [v for v in variants.core() if v.name in NAMES]


# `-spread`'s share of long steps over the whole run: as many long steps as `-half<2N>` (half of a fifth).
SPREAD_SHARE = 0.1


def past_variants(seq_len: int, steps: int, reach: int) -> list:
    """The training-side recipes past the window (`deberta_jax.data.row_lengths`) for runs of `steps` at `seq_len`,
    scored to `reach` times it: the last 10% of the updates on rows 4x the training length (the same tokens per
    step), with and without the learned temperature; the learned temperature on rows cut to L/4-L tokens throughout;
    and the learned temperature with a long phase whose rows are cut to L-4L, L-8L or L-`reach`L tokens (`-mixed`),
    so that the last updates still see rows of L among the long ones, and the longest phase every key count the
    scoring reaches; the longest phase with every other step on full rows of L (`-half`), and over twice the steps
    so that it keeps the longest phase's number of long steps (`-half<2N>`); and the learned rate
    (`-rate`) with the L-8L phase, which trains how steeply attention sharpens
    with the key count where the slope cannot; and KERPLE's learned log-distance decay added to DeBERTa's scores
    (`-kerple`, `score_bias="kerple_log"`) on rows of L only, which down-weights far keys without a cut-off instead of
    training on them; and that decay with `-half<2N>`'s phase (`-kerple-long<N>-mixed-half<2N>`), so that the
    decay's two rates per head are fitted on distances past L, which rows of L never show them; and the decay with
    the same number of long steps spread through the whole run, one step in ten (`-kerple-long<N>-mixed-spread`), so
    that the rest of the model learns beside far keys from the start instead of adapting to them at the end, while
    nine steps in ten stay on rows of L; and the decay with `-half<2N>`'s phase under sigmoid weights
    (`-kerple-sigmoid-long<N>-mixed-half<2N>`, `attention_weights="sigmoid"`), where each key's weight is its own, so
    the far keys a longer row adds cannot take weight from the near ones (a softmax's dilution)."""
    def long(multiple, share=1.0, phase=steps // 10, **data):
        train = dict(long_steps=phase, **({"long_share": share} if share != 1 else {}))
        return dict(train=train, data=dict(long_seq_len=multiple * seq_len, **data))

    mixed = dict(data=dict(min_row_length=seq_len // 4))
    return [variants.variant(f"deberta-emd-long{4 * seq_len}", variants.DEBERTA, **long(4)),
            variants.variant(f"deberta-emd-learned-long{4 * seq_len}", variants.DEBERTA, **long(4), **_LEARNED),
            variants.variant(f"deberta-emd-learned-mixed{seq_len // 4}", variants.DEBERTA, **mixed, **_LEARNED),
            *(variants.variant(f"deberta-emd-learned-long{m * seq_len}-mixed", variants.DEBERTA,
                               **long(m, min_row_length=seq_len), **_LEARNED, **_room_for(m * seq_len))
              for m in (4, 8, reach)),
            variants.variant(f"deberta-emd-learned-long{reach * seq_len}-mixed-half", variants.DEBERTA,
                             **long(reach, share=0.5, min_row_length=seq_len), **_LEARNED,
                             **_room_for(reach * seq_len)),
            variants.variant(f"deberta-emd-learned-long{reach * seq_len}-mixed-half{steps // 5}", variants.DEBERTA,
                             **long(reach, share=0.5, phase=steps // 5, min_row_length=seq_len), **_LEARNED,
                             **_room_for(reach * seq_len)),
            variants.variant(f"deberta-emd-rate-long{8 * seq_len}-mixed", variants.DEBERTA,
                             **long(8, min_row_length=seq_len), **_RATE, **_room_for(8 * seq_len)),
            variants.variant("deberta-emd-kerple", variants.DEBERTA, score_bias="kerple_log"),
            variants.variant(f"deberta-emd-kerple-long{reach * seq_len}-mixed-half{steps // 5}", variants.DEBERTA,
                             **long(reach, share=0.5, phase=steps // 5, min_row_length=seq_len),
                             score_bias="kerple_log", **_room_for(reach * seq_len)),
            variants.variant(f"deberta-emd-kerple-long{reach * seq_len}-mixed-spread", variants.DEBERTA,
                             **long(reach, share=SPREAD_SHARE, phase=steps, min_row_length=seq_len),
                             score_bias="kerple_log", **_room_for(reach * seq_len)),
            variants.variant(f"deberta-emd-kerple-sigmoid-long{reach * seq_len}-mixed-half{steps // 5}",
                             variants.DEBERTA, **long(reach, share=0.5, phase=steps // 5, min_row_length=seq_len),
                             score_bias="kerple_log", attention_weights="sigmoid", **_room_for(reach * seq_len))]


def _room_for(length: int) -> dict:
    """A relative model trains on rows of at most `max_position_embeddings` tokens: raised where `length` needs it."""
    return dict(max_position_embeddings=length) if length > ModelConfig.max_position_embeddings else {}


def get_config(arg: str = ""):
    if arg not in ARGS:
        raise ValueError(f"unknown sweep arg {arg!r}; use one of {ARGS}")
    seeds = {"core": [0], "seeds": [0, 1, 2, 3, 4]}.get(arg, [0, 1])
    sweep = config_dict.ConfigDict()
    sweep.title = TITLES.get(arg, TITLES[""])
    scale = arg in ("scale", "past-scale")
    layers, seq_len, steps = (SCALE_MODEL["num_layers"], SCALE_SEQ_LEN, SCALE_STEPS) if scale else (2, 64, 10_000)
    multiples = SCALE_MULTIPLES if scale else FAR_MULTIPLES if arg in ("far", "past") else [1, 2, 4, 8]
    sweep.description = (
        f"Masked-LM encoders ({layers} x 128, 4 heads, vocab 4096) trained at length {seq_len} on Brown train for "
        f"{steps:,} steps of 32 sequences (learning rate 2e-3, no dropout, 30% masking), the same batches for every "
        f"variant; chunked loss and accuracy on Brown valid and WikiText-2 test at 1x-{multiples[-1]}x the training "
        "length "
        + ("(one seed: 95% bootstrap intervals over documents). " if len(seeds) == 1 else
           f"(mean of {len(seeds)} seeds with a 95% t-interval over seeds: results.json.gz has each seed). ")
        + "BERT's learned table is shown with the 'clip' policy here; summary.md has "
        "'untrained' and 'interpolate' and the centred-target protocol. `unigram` is the context-free floor."
        + (" `<model>+<method>` is the model scored with a length method: `log_length` scales each query's scores "
           f"by log(keys seen) / log({seq_len}) past {seq_len} keys, `window` lets each query attend to the "
           f"{seq_len} positions around it, `window_global` also to its row's [CLS] and closing [SEP], "
           f"`interpolate_distances` multiplies relative distances by {seq_len} / N; `-learned` runs trained a "
           "slope per head times log(keys seen) into every score." if arg not in ("", "core", "smoke") else "")
        + (f" `-long{4 * seq_len}` runs trained their last {steps // 10:,} steps on {32 // 4} rows of {4 * seq_len} "
           f"tokens (the same tokens per step); `-mixed{seq_len // 4}` runs trained on rows cut to a random length of "
           f"{seq_len // 4}-{seq_len} tokens; `-long<N>-mixed` runs trained their last {steps // 10:,} steps on "
           f"rows of N tokens each cut to a random length of {seq_len}-N (`-half`: every other one of those "
           f"steps on full rows of {seq_len} instead; `-half{steps // 5}`: the same over the last {steps // 5:,} "
           f"steps; `-spread`: one step in ten of the whole run on those rows); `-rate` runs trained the factor "
           f"1 + r_h log(n / {seq_len}) instead of the slope; `-kerple` runs add a learned log-distance decay per "
           f"head to the scores, `-sigmoid` runs weigh each key by sigmoid(score - log {seq_len}) instead of a "
           "softmax." if arg.startswith("past") else ""))
    sweep.data_dir = DEFAULT_DATA_DIR
    data = sweep.get_ref("data_dir")
    sweep.variants = past_variants(seq_len, steps, multiples[-1]) if arg.startswith("past") else _variants(arg)
    sweep.seeds = seeds
    sweep.seq_lens = [seq_len]
    overrides = recipe()
    if scale:
        overrides["model"].update(SCALE_MODEL)
        overrides["train"].update(num_steps=steps, checkpoint_every=1250)
    overrides["data"].update(train_files=data + "/brown/train.txt", eval_files=data + "/brown/valid.txt")
    sweep.common_overrides = config_dict.ConfigDict(overrides)
    sweep.workdir_root = "runs/natural-scale" if scale else "runs/natural"
    sweep.report_dir = "results/natural" + (f"-{arg}" if arg not in ("", "smoke") else "")
    sweep.table_policy = "clip"
    far = ["log_length", "window", "window_global"]
    methods = {"seeds": ["log_length", "window"], "flat": ["log_length", "window", "interpolate_distances"],
               "far": far, "scale": far, "past": far, "past-scale": far}
    sweep.eval = variants.eval_settings(
        {"brown/valid": data + "/brown/valid.txt", "wikitext-2/test": data + "/wikitext-2/test.txt"},
        multiples=multiples, methods=methods.get(arg, methods["flat"] if arg == "smoke" else []))
    if arg == "smoke":  # seconds: for tests of the config
        variants.shrink_to_smoke(sweep, vocab_size=300)
    return sweep
