"""A recipe's cost per trained token, as the train step computes it."""

import subprocess
import sys

import pytest

from configs import deberta
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.flops import model_flops
from deberta_jax.study import training_cost
from deberta_jax.train import steps
from deberta_jax.train.config_checks import resolved, validate


def run_config(**fields):
    config = deberta.get_config("micro")  # 8 rows of 32 tokens, 100 steps
    config.update_from_flattened_dict(fields)
    return resolved(config, validate(config, num_devices=1))


def test_mixed_rows_cost_their_padding():
    """Cut rows are computed whole: the same FLOPs over (min + L) / 2 real tokens per row."""
    mixed = run_config(**{"data.min_row_length": 8})
    plain, cost = training_cost.run_cost(training_cost.without_length_recipes(mixed)), training_cost.run_cost(mixed)
    assert cost.flops == plain.flops
    assert cost.per_token / plain.per_token == pytest.approx(2 * 32 / (8 + 32))


def test_a_long_phase_trains_the_same_tokens_at_its_own_length():
    run = run_config(**{"train.long_steps": 25, "data.long_seq_len": 128})
    cost, model = training_cost.run_cost(run), ModelConfig.from_dict(run.model.to_dict())
    short = model_flops(model, 8, 32, steps.prediction_budget(256, 0.15), train=True)
    long = model_flops(model, 2, 128, steps.prediction_budget(256, 0.15), train=True)
    assert long > short  # the attention's share grows with the length
    assert cost.flops == pytest.approx(75 * short + 25 * long)
    assert cost.tokens == 100 * 8 * 32
    run.train.long_share = 0.6  # 15 of the 25 steps long, 10 on rows of 32
    assert training_cost.run_cost(run).flops == pytest.approx(85 * short + 15 * long)


def test_a_missing_workdir_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deberta_jax.study.training_cost", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{tmp_path} is not a training workdir" in result.stderr.splitlines()[0]
