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


def test_gradient_accumulation_counts_each_micro_batchs_head():
    """Two micro-batches of 4 rows: the head scores each one's budget (2 x 77 positions, not one budget of 117 for
    the 8 rows), over the same trained tokens."""
    run = run_config(**{"train.grad_accum_steps": 2})
    cost, model = training_cost.run_cost(run), ModelConfig.from_dict(run.model.to_dict())
    assert 2 * steps.prediction_budget(4 * 32, 0.15) != steps.prediction_budget(8 * 32, 0.15)
    assert cost.flops == pytest.approx(100 * model_flops(model, 8, 32, 2 * steps.prediction_budget(128, 0.15),
                                                         train=True))
    assert cost.tokens == training_cost.run_cost(run_config()).tokens == 100 * 8 * 32


def test_a_window_counts_the_keys_it_reaches_and_no_more_than_the_row():
    """A window longer than the row sees the row's keys, as full attention does; a shorter one fewer."""
    model = ModelConfig.from_dict(run_config().model.to_dict())
    full = model_flops(model, 8, 32, 40, train=True)
    assert model_flops(model.with_options(attention_window=512), 8, 32, 40, train=True) == full
    narrow = model_flops(model.with_options(attention_window=8), 8, 32, 40, train=True)
    assert full - narrow == pytest.approx(3 * model.num_layers * 8 * 4 * 32 * (32 - 8) * model.hidden_size)


def test_a_missing_workdir_is_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "deberta_jax.study.training_cost", "--workdir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"{tmp_path} is not a training workdir" in result.stderr.splitlines()[0]
