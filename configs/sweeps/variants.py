"""The run families that sweeps share: DeBERTa's ablations (the paper's Table 4) and the position schemes of the
length-generalization literature, each a model-family config plus `config.model` overrides.

DeBERTa variants follow Table 4 (full = disentangled c2p + p2c with EMD). The DeBERTa family config scales its
relative table with the training length (buckets = L/2, max distance = L); BERT's absolute table has 512 rows, so
its untrained rows past L exist for the length study's "untrained" policy.
"""

from ml_collections import config_dict

DEBERTA, BERT = "configs/deberta.py:tiny", "configs/bert.py:tiny"
_EMD = dict(use_emd=True)


def variant(name, config, *, train=None, data=None, **model):
    """A run family: a model-family config plus `config.model` overrides, and `config.train` / `config.data`
    overrides for recipes that change how it trains."""
    overrides = dict(model=model, **{k: v for k, v in dict(train=train, data=data).items() if v})
    return config_dict.ConfigDict(dict(name=name, config=config, overrides=overrides))


def core():
    """BERT, DeBERTa with each Table 4 ablation, the relative schemes of the literature, and NoPE as a floor."""
    return [
        variant("bert", BERT),
        variant("deberta", DEBERTA, **_EMD),
        variant("deberta-c2p", DEBERTA, **_EMD, pos_att_type="p2c"),
        variant("deberta-p2c", DEBERTA, **_EMD, pos_att_type="c2p"),
        variant("deberta-emd", DEBERTA),
        variant("rope", BERT, attention="rope", position_biased_input=False),
        variant("alibi", BERT, attention="alibi", position_biased_input=False),
        variant("t5-bias", BERT, attention="t5_bias", position_biased_input=False),
        variant("nope", BERT, position_biased_input=False),
    ]


def absolute_baselines():
    """The other absolute schemes: Vaswani's sinusoids and randomized positions (Ruoss et al. 2023)."""
    return [
        variant("sinusoidal", BERT, absolute_embedding="sinusoidal"),
        variant("bert-randomized", BERT, randomized_positions=True),
    ]


def deberta_extras():
    """The rest of Table 4 and DeBERTa's other position options."""
    return [
        variant("deberta-emd-c2p", DEBERTA, pos_att_type="p2c"),
        variant("deberta-emd-p2c", DEBERTA, pos_att_type="c2p"),
        variant("deberta-no-buckets", DEBERTA, **_EMD, position_buckets=0),
        variant("deberta-separate-keys", DEBERTA, **_EMD, share_att_key=False),
        variant("deberta-emd-abs-input", DEBERTA, position_biased_input=True),  # EMD needs it off
    ]


def eval_settings(data_files: dict, **changes) -> config_dict.ConfigDict:
    """The length study's settings every sweep shares (`deberta_jax.study.length_study.StudySettings`), with
    `changes`: 1x-8x the training length, every absolute-table policy, both protocols, 30k tokens per text."""
    settings = dict(data_files=data_files, multiples=[1, 2, 4, 8], extra=[],
                    policies=["untrained", "clip", "interpolate"], protocols=["chunked", "centred_target"],
                    max_eval_tokens=30000, num_spans=256, bootstrap=1000, methods=[])
    settings.update(changes)
    return config_dict.ConfigDict(settings)


def shrink_to_smoke(sweep: config_dict.ConfigDict, **model) -> None:
    """Make `sweep` train and evaluate in seconds, for tests of a config and of the runner: a one-layer 32-wide
    encoder (plus `model` changes), 4 steps at length 16, evaluated at 1x and 2x on 3,000 tokens.

    A smoke run never writes into committed results: its runs and report go to `<workdir_root>-smoke/` under the
    git-ignored runs/, away from the full sweep's workdirs and from the report_dir whose REPORT describes the full
    recipe. Call it after setting both."""
    sweep.workdir_root += "-smoke"
    sweep.report_dir = f"{sweep.workdir_root}/report"
    sweep.seq_lens = [16]
    sweep.common_overrides.model.update(dict(num_layers=1, hidden_size=32, intermediate_size=64, **model))
    sweep.common_overrides.train.update(dict(num_steps=4, batch_size=4, warmup_steps=1, eval_every=4,
                                             checkpoint_every=4, log_every=2))
    sweep.eval.multiples = [1, 2]
    sweep.eval.max_eval_tokens, sweep.eval.num_spans, sweep.eval.bootstrap = 3000, 8, 50


def recipe():
    """The shared CPU-scale recipe: a 2 x 128 encoder (4 heads) trained at length 64 for 800 steps of 32 rows."""
    return dict(model=dict(num_layers=2, hidden_size=128, num_heads=4, intermediate_size=512),
                train=dict(num_steps=800, batch_size=32, learning_rate=1e-3, warmup_steps=80, eval_every=400,
                           checkpoint_every=400, log_every=50))
