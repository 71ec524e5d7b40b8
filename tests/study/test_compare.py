"""Comparing models across studies' results files, seed by seed."""

import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from deberta_jax.study import compare, report

L = 64


def records(model, seed, one_x, rises, fixed, policy="none", protocol="centred_target"):
    """Chunked loss at 1x and at each multiple (1x + rise), and the loss of the same targets in windows of each
    length: centred, or (`fixed_target`, results scored before the centred protocol) L/2 into each window, beside
    another offset that must not be read."""
    base = dict(model=model, seed=seed, source=f"runs/{model}-s{seed}", step=100, train_len=L, policy=policy,
                dataset="brown/valid", bucket="all", metric="loss", ci_low=None, ci_high=None, n_tokens=100)
    out = [dict(base, multiple=1.0, protocol="chunked", offset=None, eval_len=L, value=one_x)]
    out += [dict(base, multiple=float(m), protocol="chunked", offset=None, eval_len=L * m, value=one_x + r)
            for m, r in rises.items()]
    offset = L // 2 if protocol == "fixed_target" else None
    out += [dict(base, multiple=n / L, protocol=protocol, offset=offset, eval_len=n, value=v) for n, v in fixed.items()]
    if protocol == "fixed_target":
        out += [dict(base, multiple=2.0, protocol=protocol, offset=0, eval_len=2 * L, value=99.0)]
    return out


@pytest.fixture
def studies(tmp_path):
    first = records("plain", 0, 3.70, {2: 0.1, 4: 0.5}, {64: 4.0, 128: 4.2, 256: 4.5}, protocol="fixed_target")
    first += records("plain", 1, 3.80, {2: 0.2, 4: 0.7}, {64: 4.0, 128: 4.2, 256: 4.5}, protocol="fixed_target")
    second = records("recipe", 0, 3.71, {2: -0.05, 4: -0.10}, {64: 4.0, 128: 3.95, 256: 3.9})
    second += records("recipe", 1, 3.82, {2: -0.03, 4: -0.12}, {64: 4.0, 128: 3.99, 256: 3.99})
    report.write_results(first, [], str(tmp_path / "far"))
    report.write_results(second, [], str(tmp_path / "past"))
    return [str(tmp_path / "far" / report.RESULTS_FILE), str(tmp_path / "past" / report.RESULTS_FILE)]


def test_rises_and_costs_are_per_seed_then_averaged(studies):
    rises = compare.chunked_rises(compare.load(studies, ["plain", "recipe"]), baseline="plain")
    recipe = rises.xs(("brown/valid", "recipe"))
    assert recipe.loc[1, "1x vs baseline"] == pytest.approx(0.02)  # against the baseline's own seed 1
    assert recipe.loc["mean", "1x vs baseline"] == pytest.approx(0.015)
    assert recipe.loc["mean", "rise 4x"] == pytest.approx(-0.11)
    assert rises.xs(("brown/valid", "plain")).loc["mean", "rise 2x"] == pytest.approx(0.15)


def test_fixed_targets_say_whether_the_extra_keys_help(studies):
    fixed = compare.fixed_targets(compare.load(studies, ["plain", "recipe"]))
    verdict = compare.verdicts(fixed, flat_within=0.02)
    assert verdict[("brown/valid", "fixed_target", "plain")] == "+0.500: rises"  # its offset L/2 only
    assert verdict[("brown/valid", "centred_target", "recipe")] == "-0.055: falls"
    assert compare.verdicts(fixed, flat_within=0.06)[("brown/valid", "centred_target", "recipe")] == "-0.055: flat"


def test_verdicts_of_models_of_other_lengths_read_their_own_windows():
    """A model trained at 128 has no window of 64, one at 64 none of 512: each verdict runs from the model's own
    window of L to its own longest, and says when that falls short of the table's; a negative tolerance is
    refused."""
    fixed = pd.DataFrame({64: [4.0, None], 128: [4.1, 3.9], 256: [4.3, 3.905], 512: [None, 3.9]},
                         index=pd.MultiIndex.from_tuples([("brown", "short"), ("brown", "long")]))
    verdict = compare.verdicts(fixed, flat_within=0.02)
    assert verdict[("brown", "short")] == "+0.300 (to 256): rises"
    assert verdict[("brown", "long")] == "+0.000: flat"
    with pytest.raises(ValueError, match="flat_within=-0.1: give a non-negative number of nats"):
        compare.verdicts(fixed, flat_within=-0.1)


def test_a_model_with_an_absolute_table_is_read_under_one_policy(tmp_path):
    """BERT is scored under several policies past L; averaging them as one model would blend three models."""
    bert = [r for policy, rise in (("clip", 0.3), ("untrained", 2.0), ("interpolate", 0.6))
            for seed in (0, 1) for r in records("bert", seed, 3.9, {2: rise}, {64: 4.0}, policy=policy)]
    report.write_results(bert, [], str(tmp_path))
    path = [str(tmp_path / report.RESULTS_FILE)]
    assert compare.chunked_rises(compare.load(path, ["bert"]), None).loc[
        ("brown/valid", "bert", "mean"), "rise 2x"] == pytest.approx(0.3)
    assert compare.chunked_rises(compare.load(path, ["bert"], "untrained"), None).loc[
        ("brown/valid", "bert", "mean"), "rise 2x"] == pytest.approx(2.0)


def test_a_model_in_two_files_or_in_none_is_refused(studies, tmp_path):
    copy = tmp_path / "copy.json.gz"
    shutil.copy(studies[0], copy)
    with pytest.raises(ValueError, match="appear in more than one results file"):
        compare.load([studies[0], str(copy)], ["plain"])
    with pytest.raises(ValueError, match="--models: absent not in .*; their labels: plain, recipe"):
        compare.load(studies, ["plain", "absent"])


def paired(model, seed, diffs, counts, multiple=8):
    """A run's context use at one multiple, as `length_study.context_use_records` writes it."""
    value = sum(diffs) / sum(counts)
    return dict(model=model, seed=seed, source=f"runs/{model}-s{seed}", step=100, train_len=L, policy="none",
                dataset="brown/valid", bucket="all", metric=report.CONTEXT_USE + "window_global", protocol="chunked",
                offset=None, multiple=float(multiple), eval_len=L * multiple, value=value, ci_low=value - 0.01,
                ci_high=value + 0.01, n_tokens=sum(counts), doc_diff=diffs, doc_count=counts)


def test_context_use_per_seed_and_pooled_over_the_seeds_compared(studies, tmp_path):
    """The paired records of the seeds compared: each seed's row, and their mean with the documents resampled
    jointly; a model without paired records gets the line that says how to make them, not a figure."""
    rows = records("recipe", 0, 3.7, {}, {}) + records("recipe", 1, 3.7, {}, {})
    rows += [paired("recipe", 0, [-2.0, -1.0, 0.5, -3.0], [10, 10, 10, 10]),
             paired("recipe", 1, [-1.0, -2.0, -1.0, -2.0], [10, 10, 10, 10])]
    report.write_results(rows, [], str(tmp_path / "paired"))
    loaded = compare.load([str(tmp_path / "paired")], ["recipe"])
    text = "\n".join(compare.paired(loaded))
    lo, hi = report.pooled_interval(loaded[loaded["metric"].str.startswith(report.CONTEXT_USE)])
    assert "| recipe | none | 64 | 0 | -0.138 [-0.148, -0.128] |" in text
    assert f"| recipe | none | 64 | mean | -0.144 [{lo:.3f}, {hi:.3f}] |" in text
    assert lo < -0.144 < hi
    assert "No paired records" in compare.paired(compare.load(studies, ["plain"]))[2]


def test_the_command_writes_the_tables_and_the_plot(studies, tmp_path):
    result = subprocess.run([sys.executable, "-m", "deberta_jax.study.compare", "--results", studies[0], "--results",
                             studies[1], "--models", "recipe", "--baseline", "plain", "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    text = (tmp_path / "out" / "compare.md").read_text()
    assert "| brown/valid | recipe | mean | 3.765 | +0.015 | -0.040 | -0.110 |" in text
    assert (tmp_path / "out" / "fixed_targets.png").stat().st_size > 1000


def test_results_without_1x_or_fixed_targets(tmp_path):
    """No 1x: refused in a line naming the fix; no fixed-target records: the table says so, no plot."""
    rows = [r for r in records("plain", 0, 3.7, {2: 0.1}, {}) if r["protocol"] == "chunked"]
    report.write_results(rows, [], str(tmp_path / "chunked"))
    loaded = compare.load([str(tmp_path / "chunked")], ["plain"])
    text = compare.markdown(compare.chunked_rises(loaded, None), compare.fixed_targets(loaded), 0.02)
    assert "No fixed-target records" in text
    report.write_results([r for r in rows if r["multiple"] != 1.0], [], str(tmp_path / "no1x"))
    with pytest.raises(ValueError, match="no chunked loss at 1x"):
        compare.chunked_rises(compare.load([str(tmp_path / "no1x")], ["plain"]), None)


def test_a_report_written_by_the_study_is_read_seed_by_seed(tmp_path):
    """`report.write_report` adds each key's mean over seeds as a row of its own (seed "mean"): compare reads the
    seeds' rows only, so the mean is over the seeds compared, not over the seeds and their own mean."""
    rows = records("plain", 0, 3.70, {2: 0.1}, {64: 4.0, 128: 4.2}) + records("plain", 1, 3.80, {2: 0.3},
                                                                            {64: 4.0, 128: 4.4})
    report.write_report(rows, [], str(tmp_path))
    assert "mean" in set(report.load_results(tmp_path)["seed"].astype(str))
    loaded = compare.load([str(tmp_path)], ["plain"])
    assert sorted(loaded["seed"].unique()) == [0, 1]
    rises = compare.chunked_rises(loaded, None).xs(("brown/valid", "plain"))
    assert list(rises.index) == [0, 1, "mean"]
    assert rises.loc["mean", "rise 2x"] == pytest.approx(0.2)
    assert compare.fixed_targets(loaded).loc[("brown/valid", "centred_target", "plain"), 128] == pytest.approx(4.3)


def window_records(model, seed, one_x, losses, source=None):
    """The chunked loss of `model` scored with its own window (`model+window_global`) at each multiple."""
    rows = records(f"{model}+window_global", seed, one_x, {m: v - one_x for m, v in losses.items()}, {})
    return [dict(r, source=source or f"runs/{model}-s{seed}") for r in rows]


def test_the_trade_between_1x_and_context_use_reads_paired_records_or_one_runs_two_losses(tmp_path):
    """Each model's 1x cost against the baseline at the same seed, and its context use (full attention minus its own
    window on the same chunks): from the paired records with their pooled interval where the study has them, else
    from each seed's two overall losses of one run (the same mean, no interval); two runs' losses are refused."""
    rows = records("plain", 0, 3.70, {8: 0.30}, {}) + records("plain", 1, 3.80, {8: 0.20}, {})
    rows += window_records("plain", 0, 3.70, {8: 3.75}) + window_records("plain", 1, 3.80, {8: 3.82})
    rows += records("recipe", 0, 3.72, {8: -0.01}, {}) + records("recipe", 1, 3.83, {8: -0.03}, {})
    rows += [paired("recipe", 0, [-2.0, -1.0, 0.5, -3.0], [10, 10, 10, 10]),
             paired("recipe", 1, [-1.0, -2.0, -1.0, -2.0], [10, 10, 10, 10])]
    report.write_results(rows, [], str(tmp_path / "study"))
    loaded = compare.load([str(tmp_path / "study")], ["plain", "plain+window_global", "recipe"])
    table = compare.trade(loaded, "plain").set_index("model")
    assert set(table.index) == {"plain", "recipe"}  # the window's own row is read beside its model
    assert table.loc["recipe", "cost"] == pytest.approx(0.025)  # (0.02 + 0.03) / 2, seed against seed
    assert table.loc["recipe", "use"] == pytest.approx(-0.14375)
    lo, hi = report.pooled_interval(loaded[loaded["metric"].str.startswith(report.CONTEXT_USE)])
    assert (table.loc["recipe", "low"], table.loc["recipe", "high"], table.loc["recipe", "paired"]) == (
        pytest.approx(lo), pytest.approx(hi), True)
    assert table.loc["plain", "use"] == pytest.approx(((4.00 - 3.75) + (4.00 - 3.82)) / 2)
    assert np.isnan(table.loc["plain", "low"]) and not table.loc["plain", "paired"]
    text = "\n".join(compare.trade_markdown(compare.trade(loaded, "plain"), "plain"))
    assert "| brown/valid | plain | 2 | +0.000 | +0.215 * |" in text
    assert f"| brown/valid | recipe | 2 | +0.025 | -0.144 [{lo:+.3f}, {hi:+.3f}] |" in text
    assert compare.trade_multiples(compare.trade(loaded, "plain"), []) == [8.0]
    with pytest.raises(ValueError, match=r"--trade_at: no context use at \[32\]x; the models were scored at 8x"):
        compare.trade_multiples(compare.trade(loaded, "plain"), [32])

    rows = [r for r in rows if r["model"] != "plain+window_global"]
    rows += window_records("plain", 0, 3.70, {8: 3.75}, source="runs/another-s0")
    report.write_results(rows, [], str(tmp_path / "two-runs"))
    with pytest.raises(ValueError, match="plain and plain\\+window_global at seed 0 come from different runs"):
        compare.trade(compare.load([str(tmp_path / "two-runs")], ["plain", "plain+window_global"]), "plain")


def test_the_command_plots_the_trade_with_a_baseline(tmp_path):
    rows = records("plain", 0, 3.70, {8: 0.30, 32: 0.9}, {}) + window_records("plain", 0, 3.70, {8: 3.75, 32: 3.8})
    rows += records("recipe", 0, 3.72, {8: -0.01, 32: 0.0}, {}) + window_records("recipe", 0, 3.72, {8: 3.8, 32: 3.7})
    report.write_results(rows, [], str(tmp_path / "study"))
    result = subprocess.run([sys.executable, "-m", "deberta_jax.study.compare", "--results", str(tmp_path / "study"),
                             "--models", "recipe,recipe+window_global,plain+window_global", "--baseline", "plain",
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "| brown/valid | recipe | 1 | +0.020 | -0.090 * | +0.020 * |" in result.stdout
    assert (tmp_path / "out" / "trade.png").stat().st_size > 1000
    # Shared words dropped; a label they would empty keeps its whole name.
    assert compare.short_names(["deberta-emd-L64", "deberta-emd-kerple-L64"]) == ["deberta-emd-L64", "kerple"]
