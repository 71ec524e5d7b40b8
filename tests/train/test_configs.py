"""Experiment configs: every preset validates, the families differ only where they should, and each
bad value fails at start-up with an error naming its field."""

import subprocess
import sys

import pytest

from configs import bert, common, deberta
from deberta_jax.data import row_lengths
from deberta_jax.model import biases
from deberta_jax.model.config import OWN_VARIANTS, ConfigError
from deberta_jax.train.config_checks import resolved, validate
from tests.helpers import REPO, variant_config

FAMILIES = {"bert": bert, "deberta": deberta}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("size", sorted(common.SIZES))
def test_every_preset_validates_with_trained_length_from_seq_len(family, size):
    config = FAMILIES[family].get_config(size)
    model = validate(config, num_devices=1)
    assert model.trained_length == config.data.seq_len
    assert resolved(config, model).model.trained_length == config.data.seq_len


def test_sizes_have_the_requested_shapes():
    tiny, base = bert.get_config("tiny"), deberta.get_config("base")
    assert (tiny.model.num_layers, tiny.model.hidden_size, tiny.model.num_heads, tiny.model.intermediate_size,
            tiny.model.vocab_size, tiny.data.seq_len) == (4, 256, 4, 1024, 8192, 128)
    assert (base.model.num_layers, base.model.hidden_size, base.model.num_heads, base.model.intermediate_size,
            base.data.seq_len) == (12, 768, 12, 3072, 512)


def test_families_share_data_and_recipe_and_differ_in_position_scheme():
    b, d = bert.get_config("tiny"), deberta.get_config("tiny")
    assert b.data.to_dict() == d.data.to_dict() and b.train.to_dict() == d.train.to_dict() and b.seed == d.seed
    bm, dm = validate(b, 1), validate(d, 1)
    assert (bm.attention, bm.position_biased_input, bm.layer_norm_eps) == ("entangled", True, 1e-12)
    assert (dm.attention, dm.position_biased_input, dm.pos_att_type) == ("disentangled", False, ("c2p", "p2c"))
    assert (dm.share_att_key, dm.norm_rel_ebd, dm.use_emd) == (True, "layer_norm", False)


def test_deberta_relative_table_follows_seq_len():
    assert (validate(deberta.get_config("base"), 1).position_buckets,
            validate(deberta.get_config("base"), 1).max_relative_positions) == (256, 512)  # the paper's values
    config = deberta.get_config("tiny")
    assert (config.model.position_buckets, config.model.max_relative_positions) == (64, 128)
    config.data.seq_len = 256  # what --config.data.seq_len=256 does
    assert (config.model.position_buckets, config.model.max_relative_positions) == (128, 256)
    # Overriding the table (the published v3 setting at a short training length) leaves the training length alone,
    # whichever order the overrides come in.
    config.update_from_flattened_dict({"model.position_buckets": 256, "model.max_relative_positions": 512})
    assert (config.data.seq_len, config.model.position_buckets, config.model.max_relative_positions) == (256, 256, 512)
    config.data.seq_len = 64
    assert (config.data.seq_len, config.model.position_buckets, config.model.max_relative_positions) == (64, 256, 512)


def test_unknown_size_is_rejected():
    with pytest.raises(ValueError, match="unknown config size 'huge'"):
        bert.get_config("huge")


BAD_VALUES = [
    ("seed", -1, "config.seed=-1"),
    ("data.train_files", "", "config.data.train_files=''"),
    ("data.tokenizer", "/no/such/tokenizer.json", "config.data.tokenizer='/no/such/tokenizer.json' does not exist"),
    ("data.seq_len", 4, "config.data.seq_len=4"),
    ("data.mask_prob", 0.0, "config.data.mask_prob=0.0"),
    ("model.attention", "sparse", "config.model.attention='sparse'"),
    ("model.num_heads", 3, "config.model.num_heads=3"),
    ("model.dtype", "float16", "config.model.dtype='float16'"),
    ("train.num_steps", 0, "config.train.num_steps=0"),
    ("train.batch_size", 0, "config.train.batch_size=0"),
    ("train.grad_accum_steps", 0, "config.train.grad_accum_steps=0"),
    ("train.warmup_steps", -5, "config.train.warmup_steps=-5"),
    ("train.schedule", "step", "config.train.schedule='step' is not a schedule"),
    ("train.learning_rate", -1e-3, "config.train.learning_rate=-0.001"),
    ("train.b2", 1.0, "config.train.b2=1.0"),
    ("train.eps", 0.0, "config.train.eps=0.0"),
    ("train.grad_clip_norm", 0.0, "config.train.grad_clip_norm=0.0"),
    ("train.eval_batches", 0, "config.train.eval_batches=0"),
    ("train.keep_checkpoints", 0, "config.train.keep_checkpoints=0"),
    ("data.min_row_length", 4, "config.data.min_row_length=4 must be 0 (every row full) or a length in [8, "),
    ("data.min_row_length", 33, "config.data.min_row_length=33 must be 0"),
    ("data.long_seq_len", 64, "config.data.long_seq_len=64 is set but config.train.long_steps=0"),
    ("train.long_steps", 101, "config.train.long_steps=101 exceeds config.train.num_steps=100"),
    ("train.long_steps", -1, "config.train.long_steps=-1 must be an integer >= 0"),
    ("train.long_share", 0.5, "config.train.long_share=0.5 is set but config.train.long_steps=0"),
]


@pytest.mark.parametrize("field,value,message", BAD_VALUES, ids=[b[0] for b in BAD_VALUES])
def test_bad_value_names_its_field(field, value, message):
    config = deberta.get_config("micro")
    config.update_from_flattened_dict({field: value})
    with pytest.raises(ValueError) as info:
        validate(config, num_devices=1)
    assert message in str(info.value)


def test_batch_not_divisible_by_devices():
    config = bert.get_config("micro")
    config.train.batch_size = 30
    with pytest.raises(ConfigError,
                       match="^config.train.batch_size=30 is not divisible by 8 devices; use a multiple of 8$"):
        validate(config, num_devices=8)
    config.train.batch_size, config.train.grad_accum_steps = 32, 3
    with pytest.raises(ConfigError, match="by 2 devices x 3 accumulation steps = 6; use a multiple of 6"):
        validate(config, num_devices=2)
    config.train.grad_accum_steps = 4
    validate(config, num_devices=8)


def test_a_long_phase_needs_longer_rows_of_the_same_tokens():
    config = bert.get_config("micro")  # 8 rows of 32 tokens, an absolute table of 512
    config.train.long_steps = 10
    for long_len, problem in [(0, "must be an integer above data.seq_len=32"),
                              (1024, r"must be .*, at most 512 \(the size of the model.s absolute position table\)"),
                              (96, "must divide the 256 tokens of a step")]:
        config.data.long_seq_len = long_len
        with pytest.raises(ConfigError, match=f"^config.data.long_seq_len={long_len} {problem}"):
            validate(config, num_devices=1)
    config.data.long_seq_len = 128  # 2 rows: not a whole share of 4 devices
    with pytest.raises(ConfigError, match="divisible by 4 "):
        validate(config, num_devices=4)
    validate(config, num_devices=2)
    for share, problem in [(0.0, r"must be a number in \(0, 1\]"), (1.5, r"must be a number in \(0, 1\]"),
                           (0.04, "leaves none of the config.train.long_steps=10 steps on long rows")]:
        config.train.long_share = share
        with pytest.raises(ConfigError, match=f"^config.train.long_share={share} {problem}"):
            validate(config, num_devices=2)
    config.train.long_share = 0.05  # rounds to one long step of ten
    validate(config, num_devices=2)


def test_seq_len_longer_than_absolute_table():
    config = bert.get_config("micro")
    config.data.seq_len = 1024
    with pytest.raises(ConfigError, match=r"config.data.seq_len=1024 exceeds config.model.max_position_embeddings=512"):
        validate(config, num_devices=1)
    config.model.max_position_embeddings = 1024
    assert validate(config, num_devices=1).trained_length == 1024


def test_unknown_model_field_and_explicit_trained_length_are_rejected():
    config = deberta.get_config("micro")
    config.model.hidden_sise = 64
    with pytest.raises(ConfigError, match="hidden_sise"):
        validate(config, num_devices=1)
    config = deberta.get_config("micro")
    config.model.trained_length = 16
    with pytest.raises(ConfigError, match="config.model.trained_length=16 is derived from config.data.seq_len"):
        validate(config, num_devices=1)


def test_train_py_rejects_a_bad_field_before_reading_data(tmp_path):
    """The command line path: the error names the field; no data file is touched (they do not exist)."""
    result = subprocess.run(
        [sys.executable, "train.py", "--config", "configs/deberta.py:micro", "--workdir", str(tmp_path / "run"),
         "--config.data.train_files=/no/such/file.txt", "--config.train.schedule=exponential"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "config.train.schedule='exponential' is not a schedule" in result.stderr
    assert "/no/such/file.txt" not in result.stderr


def _variant_config(plan, variant):
    """A sweep run's training config at its first training length."""
    config = variant_config(variant, "tiny", plan.common_overrides)
    config.data.seq_len = plan.seq_lens[0]
    return config


@pytest.mark.parametrize("arg", ["", "core", "seeds", "flat", "past", "past-scale", "smoke"])
def test_natural_sweep_gives_every_variant_the_same_valid_recipe(arg):
    """The recipe that moves BERT off the plateau is recorded in the config and shared by every variant."""
    from configs.sweeps import natural, variants
    from deberta_jax.study import sweep

    plan = natural.get_config(arg)
    resolved = {}
    for variant in plan.variants:
        config = _variant_config(plan, variant)
        validate(config, num_devices=1)
        resolved[variant.name] = config
    expected = {"core": [v.name for v in variants.core()], "seeds": natural.SEED_NAMES,
                "flat": [*natural.FLAT_NAMES, "deberta-emd-b256"],
                "past": ["deberta-emd-long256", "deberta-emd-learned-long256", "deberta-emd-learned-mixed16",
                         "deberta-emd-learned-long256-mixed", "deberta-emd-learned-long512-mixed",
                         "deberta-emd-learned-long2048-mixed", "deberta-emd-learned-long2048-mixed-half",
                         "deberta-emd-learned-long2048-mixed-half2000", "deberta-emd-rate-long512-mixed",
                         "deberta-emd-kerple", "deberta-emd-kerple-long2048-mixed-half2000",
                         "deberta-emd-kerple-long2048-mixed-spread",
                         "deberta-emd-kerple-sigmoid-long2048-mixed-half2000"],
                "past-scale": ["deberta-emd-long512", "deberta-emd-learned-long512", "deberta-emd-learned-mixed32",
                               "deberta-emd-learned-long512-mixed", "deberta-emd-learned-long1024-mixed",
                               "deberta-emd-learned-long2048-mixed", "deberta-emd-learned-long2048-mixed-half",
                               "deberta-emd-learned-long2048-mixed-half1000", "deberta-emd-rate-long1024-mixed",
                               "deberta-emd-kerple", "deberta-emd-kerple-long2048-mixed-half1000",
                               "deberta-emd-kerple-long2048-mixed-spread",
                               "deberta-emd-kerple-sigmoid-long2048-mixed-half1000"],
                }.get(arg, natural.NAMES)
    assert sorted(resolved) == sorted(expected)
    if arg == "flat":  # the published v3 table at the training length of the others
        v3 = resolved["deberta-emd-b256"]
        assert (v3.model.position_buckets, v3.model.max_relative_positions, v3.data.seq_len) == (256, 512, 64)
    assert sweep.study_settings(plan).methods == tuple(plan.eval.methods)
    if arg.startswith("past"):  # the length recipes are the only differences from the others' recipe
        lengths = {name: (c.train.long_steps, c.data.long_seq_len, c.data.min_row_length, c.data.seq_len)
                   for name, c in resolved.items()}
        shares = {name: c.train.long_share for name, c in resolved.items()}
        steps, n, reach = (500, 128, 16) if arg == "past-scale" else (1000, 64, 32)
        assert sorted(lengths.values()) == sorted([(steps, 4 * n, 0, n), (steps, 4 * n, 0, n), (0, 0, n // 4, n),
                                                   (steps, 4 * n, n, n), (steps, 8 * n, n, n),
                                                   (steps, reach * n, n, n), (steps, reach * n, n, n),
                                                   (2 * steps, reach * n, n, n), (steps, 8 * n, n, n),
                                                   (0, 0, 0, n), (2 * steps, reach * n, n, n),
                                                   (10 * steps, reach * n, n, n), (2 * steps, reach * n, n, n)])
        half = f"deberta-emd-learned-long{reach * n}-mixed-half"  # every other step of the longest phase on L
        kerple_half = f"deberta-emd-kerple-long{reach * n}-mixed-half{2 * steps}"
        sigmoid_half = f"deberta-emd-kerple-sigmoid-long{reach * n}-mixed-half{2 * steps}"
        assert (shares.pop(half) == shares.pop(f"{half}{2 * steps}") == shares.pop(kerple_half)
                == shares.pop(sigmoid_half) == 0.5)
        # Spread through the whole run, the same number of long steps as the half phase of twice the steps.
        spread = f"deberta-emd-kerple-long{reach * n}-mixed-spread"
        assert resolved[spread].train.long_steps == resolved[spread].train.num_steps
        assert resolved[spread].model.score_bias == "kerple_log"
        assert (row_lengths.long_step_count(resolved[spread].train.long_steps, shares.pop(spread))
                == row_lengths.long_step_count(2 * steps, 0.5))
        assert set(shares.values()) == {1.0}
        assert lengths[half] == lengths[f"deberta-emd-learned-long{reach * n}-mixed"]
        assert resolved[f"deberta-emd-rate-long{8 * n}-mixed"].model.attention_temperature == "learned_rate"
        assert resolved["deberta-emd-kerple"].model.score_bias == "kerple_log"  # rows of L only, as the baseline
        assert (resolved[kerple_half].model.score_bias, resolved[kerple_half].model.attention_temperature) == (
            "kerple_log", resolved["deberta-emd-kerple"].model.attention_temperature)
        # The same run as the decay's half phase but for the weights: the comparison isolates the sigmoid.
        assert ({k: v for k, v in resolved[sigmoid_half].to_dict().items() if k not in ("model", "workdir")}
                == {k: v for k, v in resolved[kerple_half].to_dict().items() if k not in ("model", "workdir")})
        assert {k for k, v in resolved[sigmoid_half].model.items() if resolved[kerple_half].model[k] != v} == {
            "attention_weights"}
        assert resolved[sigmoid_half].model.attention_weights == "sigmoid"
        # Relative models train on rows of at most max_position_embeddings: the longest phase needs room.
        assert resolved[f"deberta-emd-learned-long{reach * n}-mixed"].model.max_position_embeddings == reach * n
    recipes = {name: (c.data.mask_prob, c.model.hidden_dropout, c.model.attention_dropout,
                      {k: v for k, v in c.train.to_dict().items() if k not in ("long_steps", "long_share")})
               for name, c in resolved.items()}
    assert len(set(map(repr, recipes.values()))) == 1  # one recipe for all
    if arg != "smoke":
        first = next(iter(resolved.values()))
        assert next(iter(recipes.values()))[:3] == (0.3, 0.0, 0.0) and first.train.learning_rate == 2e-3


def test_natural_core_sweep_reuses_the_default_sweeps_runs():
    """`natural.py:core` trains the default set's seed-0 variants with the very same commands, in the same
    workdirs, so those runs of the committed natural study are shared rather than trained twice."""
    from configs.sweeps import natural
    from deberta_jax.study import sweep

    default = {run["name"]: run for run in sweep.planned_runs(natural.get_config(""))}
    core = {run["name"]: run for run in sweep.planned_runs(natural.get_config("core"))}
    shared = {name for name in default if name.endswith("-s0")}
    assert shared < set(core) and set(default) - shared == {f"{name}-L64-s1" for name in natural.NAMES}
    for name in shared:
        run = default[name]
        assert core[name]["command"] == run["command"] and core[name]["workdir"] == run["workdir"]


@pytest.mark.parametrize("kernel", ["pallas", "pallas_tpu"])
def test_the_fused_kernels_train_with_attention_dropout(kernel):
    """Both fused kernels draw the dense kernel's dropout mask inside their tiles: a run trains with the published
    0.1 through either."""
    config = deberta.get_config("micro")
    config.model.attention_kernel = kernel
    model = validate(config, num_devices=1)
    assert (model.attention_kernel, model.attention_dropout) == (kernel, 0.1)


def _sweep_plans():
    """(label, plan) of every sweep config that trains runs: each variant of it is a run family train.py starts."""
    from configs.sweeps import ablation, natural, synthetic
    plans = [("ablation:full", ablation.get_config("full")), ("synthetic:markov", synthetic.get_config("markov"))]
    return plans + [(f"natural:{arg}", natural.get_config(arg)) for arg in natural.ARGS if arg != "smoke"]


def test_every_sweep_variant_trains_and_is_scored_with_the_tpu_kernel():
    """Every variant the sweeps train (DeBERTa and its ablations, BERT, RoPE, ALiBi, T5 bias, NoPE, the absolute
    baselines, the learned temperature) validates as a training config with attention_kernel=pallas_tpu and the
    published attention dropout 0.1, and takes every length method the study applies to it (log_length, window,
    window_global, interpolate_distances) with the kernel; a variant with sigmoid weights, which only the dense and
    blockwise kernels carry, is refused at start-up naming the kernel."""
    from deberta_jax.study import length_study

    seen, methods_seen, checked = set(), set(), set()
    for label, plan in _sweep_plans():
        for variant in plan.variants:
            config = _variant_config(plan, variant)
            config.model.update(attention_kernel="pallas_tpu", attention_dropout=0.1)
            key = repr((config.data.seq_len, sorted(config.model.to_dict().items())))
            if key in checked:  # the same run family in another sweep
                continue
            checked.add(key)
            if config.model.attention_weights != "softmax":
                with pytest.raises(ConfigError, match=r"attention_kernel='pallas_tpu'.*softmax only.*'dense'"):
                    validate(config, num_devices=1)
                continue
            model = validate(config, num_devices=1)
            assert (model.attention_kernel, model.attention_dropout) == ("pallas_tpu", 0.1), (label, variant.name)
            seen.add(model.attention)
            for method, options in length_study.LENGTH_METHODS.items():
                options = options(model)
                if options is None:  # nothing to act on (a learned temperature, no relative distances)
                    continue
                scored = model.with_options(**options)
                assert scored.attention_kernel == "pallas_tpu", (label, variant.name, method)
                methods_seen.add(method)
    assert seen >= set(OWN_VARIANTS) and seen - set(OWN_VARIANTS) <= set(biases.SCHEMES)
    assert methods_seen == {"log_length", "window", "window_global", "interpolate_distances"}


def test_the_cudnn_anchor_refuses_attention_dropout_at_start_up():
    """cuDNN's kernel through jax.nn.dot_product_attention draws no attention dropout: a run that asks for it is
    refused naming the field, not trained without it."""
    config = bert.get_config("micro")
    config.model.attention_kernel = "cudnn"
    with pytest.raises(ConfigError, match=r"^config.model.attention_kernel='cudnn' .*attention_dropout=0.1"):
        validate(config, num_devices=1)
    config.model.attention_dropout = 0.0
    assert validate(config, num_devices=1).attention_kernel == "cudnn"
