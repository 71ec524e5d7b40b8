"""The seed-rate summary: escape steps against the same-seed baseline, the binomial interval, and the refusals."""

import json
import subprocess
import sys

import pytest

from deberta_jax.study import seed_rate
from tests.helpers import REPO


def write_curves(path, seed, run, baseline, labels=("bert", "nope")):
    data = dict(unigram_floor=6.7, margin=0.1,
                workdirs={label: f"runs/natural/{label}-L64-s{seed}" for label in labels},
                curves={labels[0]: {str(s): v for s, v in run.items()},
                        labels[1]: {str(s): v for s, v in baseline.items()}})
    path.write_text(json.dumps(data))
    return str(path)


def test_escape_is_the_first_shared_step_a_margin_below_the_baseline():
    baseline = {250: 6.5, 500: 6.4, 750: 6.4, 1000: 6.4}
    assert seed_rate.escape_step({250: 6.45, 500: 6.31, 750: 6.29, 1000: 5.0}, baseline, 0.1) == 750
    assert seed_rate.escape_step({250: 6.45, 500: 6.35, 750: 6.39, 1000: 6.35}, baseline, 0.1) is None
    # A step only the run logged is not compared.
    assert seed_rate.escape_step({100: 1.0, 1000: 6.2}, baseline, 0.1) == 1000
    # "At least margin below": exactly margin below escapes (6.5 - 0.25 is exact in binary).
    assert seed_rate.escape_step({250: 6.25}, {250: 6.5}, 0.25) == 250


@pytest.mark.parametrize("margin", [-0.5, 0.0])
def test_a_margin_that_counts_a_seed_not_below_its_baseline_is_refused(tmp_path, margin):
    worse = write_curves(tmp_path / "a.json", 0, {250: 6.6}, {250: 6.4})
    with pytest.raises(ValueError, match=rf"^--margin={margin:g}: .* give a positive number of nats"):
        seed_rate.write_rate_report([worse], "bert", "nope", str(tmp_path / "out"), margin)
    assert not (tmp_path / "out").exists()


def test_rate_report_counts_seeds_and_gives_the_exact_binomial_interval(tmp_path):
    flat = {s: 6.4 for s in (250, 500, 750)}
    paths = [write_curves(tmp_path / "a.json", 0, {250: 6.4, 500: 6.41, 750: 6.38}, flat),
             write_curves(tmp_path / "b.json", 3, {250: 6.4, 500: 6.2, 750: 5.9}, flat),
             write_curves(tmp_path / "c.json", 1, {250: 6.4, 500: 6.35, 750: 6.1}, flat)]
    markdown = seed_rate.write_rate_report(paths, "bert", "nope", str(tmp_path / "out"))
    result = json.loads((tmp_path / "out" / "rate.json").read_text())
    assert (result["escaped"], result["seeds"]) == (2, 3)
    assert [row["seed"] for row in result["seeds_table"]] == [0, 1, 3]
    assert [row["escape_step"] for row in result["seeds_table"]] == [None, 750, 500]
    assert (result["median_step"], result["min_step"], result["max_step"]) == (625, 500, 750)
    # Clopper-Pearson for 2 of 3: [0.0943, 0.9916].
    assert result["rate_ci"] == pytest.approx([0.0943, 0.9916], abs=1e-4)
    assert "**2 of 3 seeds**" in markdown and (tmp_path / "out" / "gap_vs_step.png").stat().st_size > 0


def test_refuses_files_without_both_labels_or_a_seed_or_with_a_seed_twice(tmp_path):
    curve = {250: 6.4}
    only_bert = write_curves(tmp_path / "a.json", 0, curve, curve, labels=("bert", "rope"))
    with pytest.raises(ValueError, match="no curve labelled 'nope'"):
        seed_rate.read_curves(only_bert, "bert", "nope")
    twice = [write_curves(tmp_path / f"{name}.json", 2, curve, curve) for name in ("b", "c")]
    with pytest.raises(ValueError, match=r"seed\(s\) \[2\] given twice"):
        seed_rate.write_rate_report(twice, "bert", "nope", str(tmp_path / "out"))
    data = json.loads((tmp_path / "b.json").read_text())
    data["workdirs"]["bert"] = "runs/bert-final"
    (tmp_path / "d.json").write_text(json.dumps(data))
    result = subprocess.run([sys.executable, "-m", "deberta_jax.study.seed_rate", "--curves", str(tmp_path / "d.json"),
                             "--out", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "cannot read a seed" in result.stderr and "Traceback" not in result.stderr
