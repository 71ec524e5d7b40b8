"""The report layer on DataFrames: results files round trip, Student-t intervals over seeds, Markdown tables."""

import gzip
import json
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from deberta_jax.study import report


def record(model, seed, eval_len, value, metric="loss", protocol="chunked", offset=None, bucket="all", ci=(None, None),
           policy="none", train_len=8):
    """A record with the fields, and their order, of `length_study.run_study`'s."""
    return dict(model=model, seed=seed, source=f"runs/{model}-s{seed}", step=None, checkpoint=None, config=model,
                method="none", train_len=train_len, multiple=eval_len / train_len, protocol=protocol, offset=offset,
                policy=policy, dataset="d", eval_len=eval_len, bucket=bucket, metric=metric, value=value,
                ci_low=ci[0], ci_high=ci[1], n_tokens=100 + seed if isinstance(seed, int) else 50)


def study_records(rng) -> list[dict]:
    """Three seeds of `a`, one of `b`: chunked (with bootstrap intervals and position buckets), fixed-target."""
    out = []
    for model, seeds in (("a", (0, 1, 2)), ("b", (0,))):
        for seed in seeds:
            for eval_len in (8, 16):
                v = float(rng.uniform(1, 3))
                out.append(record(model, seed, eval_len, v, ci=(v - 0.1, v + 0.2)))
                out += [record(model, seed, eval_len, float(rng.uniform(1, 3)), bucket=b) for b in (0, 4)]
                out += [record(model, seed, eval_len, float(rng.uniform(1, 3)), protocol="fixed_target", offset=o,
                               ci=(0.5, 3.5)) for o in (0, eval_len - 2)]
    return out


def test_load_results_reads_back_what_write_results_wrote(tmp_path):
    records = study_records(np.random.default_rng(0))
    frame = pd.concat([report.records_frame(records), report.aggregate_seeds(records)], ignore_index=True)
    skipped = [dict(model="a", seed=0, policy="strict", dataset="d", eval_len=32, reason="strict policy: ...")]
    report.write_results(frame, skipped, str(tmp_path))

    for path in (tmp_path, tmp_path / "results.json.gz"):  # the directory or the file
        pd.testing.assert_frame_equal(report.load_results(path), frame)
    loaded = report.load_results(tmp_path)
    assert loaded["offset"].dtype == "Int64"
    assert loaded["offset"].isna().sum() == (loaded["protocol"] == "chunked").sum()
    assert set(loaded["bucket"]) == {"all", 0, 4} and loaded["ci_low"].isna().any()
    assert (loaded["seed"] == "mean").sum() == loaded["n_seeds"].notna().sum()
    # The file keeps each run's records exactly as given, null for a missing value; one file, compressed, whose
    # bytes depend only on the results.
    data = json.loads(gzip.decompress((tmp_path / "results.json.gz").read_bytes()))
    assert data["records"][: len(records)] == records and data["skipped"] == skipped and data["notes"] == []
    assert {r["n_seeds"] for r in data["records"][len(records):]} == {1, 3}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json.gz"]
    first = (tmp_path / "results.json.gz").read_bytes()
    report.write_results(frame, skipped, str(tmp_path))
    assert (tmp_path / "results.json.gz").read_bytes() == first


def test_a_report_is_rebuilt_from_its_results_file_alone(tmp_path):
    records = study_records(np.random.default_rng(0))
    _, summary, plots = report.write_report(records, [], str(tmp_path), notes=["a text the tokenizer cannot read"])
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix != ".png"}
    (tmp_path / "summary.md").unlink()
    for plot in plots:
        os.remove(plot)
    _, rebuilt, rebuilt_plots = report.rebuild_report(str(tmp_path))
    assert rebuilt == summary and "a text the tokenizer cannot read" in rebuilt
    assert sorted(rebuilt_plots) == sorted(plots)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.suffix != ".png"} == written


def test_a_failed_write_keeps_the_previous_report_whole(tmp_path, monkeypatch):
    """A full disk half-way through the results file: the previous report stays as it was, and no temporary is
    left."""
    report.write_report(study_records(np.random.default_rng(0)), [], str(tmp_path))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert {"results.json.gz", "summary.md"} <= set(before)
    real_write = report.gzip.GzipFile.write

    def full_disk(self, data):
        real_write(self, data[: len(data) // 2])
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(report.gzip.GzipFile, "write", full_disk)
    with pytest.raises(OSError, match=f"{tmp_path}: no room to write the report .* nothing there was replaced"):
        report.write_report(study_records(np.random.default_rng(1)), [], str(tmp_path))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_disk_that_fills_on_the_last_plot_leaves_every_output_as_it_was(tmp_path, monkeypatch):
    """The results file and summary.md written, then no room for a plot: none of the new outputs replaces its
    predecessor (a mixed report would show figures its plots do not)."""
    report.write_report(study_records(np.random.default_rng(0)), [], str(tmp_path))
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def no_room(fig, path, dpi):
        raise OSError(27, "File too large")
    monkeypatch.setattr(report, "save_png", no_room)
    with pytest.raises(OSError, match="no room to write the report"):
        report.write_report(study_records(np.random.default_rng(1)), [], str(tmp_path))
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    leftover = tmp_path / f"results.json.gz.tmp-{host}-{int(dead.stdout)}-0a1b2c3d"
    leftover.write_text('{"records": [{"model"')  # torn by SIGKILL
    alive = tmp_path / f"summary.md.tmp-{host}-{os.getppid()}-0a1b2c3d"  # a live process's write: left alone
    alive.write_text("...")
    report.write_report(study_records(np.random.default_rng(0)), [], str(tmp_path))
    assert not leftover.exists() and alive.exists()
    assert report.load_results(tmp_path)["value"].notna().all()


def test_load_results_names_the_file_and_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}/results.json.gz not found: pass a results.json.gz"):
        report.load_results(tmp_path)
    (tmp_path / "results.json.gz").write_bytes(gzip.compress(json.dumps({"curves": {}}).encode()))
    with pytest.raises(ValueError, match="is not a results file: it needs a 'records' list"):
        report.load_results(tmp_path)
    for damaged in (gzip.compress(b'{"records": [')[:-9], b"not gzip", gzip.compress(b'{"records": [')):
        (tmp_path / "results.json.gz").write_bytes(damaged)  # cut short, not gzip'd, truncated JSON
        with pytest.raises(ValueError, match=f"{tmp_path}/results.json.gz cannot be read .*damaged or was cut short"):
            report.load_results(tmp_path)
    broken = record("a", 0, 8, 1.0)
    del broken["train_len"]
    with pytest.raises(ValueError, match="results column 'train_len' cannot be read as int64"):
        report.records_frame([broken])
    with pytest.raises(FloatingPointError, match="non-finite ci_low"):
        report.records_frame([record("a", 0, 8, 1.0, ci=(float("nan"), 2.0))])


@pytest.mark.parametrize("n_seeds", [2, 3, 10])
def test_mean_over_seeds_has_the_student_t_interval(n_seeds):
    rng = np.random.default_rng(n_seeds)
    values = rng.normal(2.0, 0.3, size=(2, n_seeds))  # two lengths
    records = [record("a", s, n, float(values[i, s]), ci=(0.0, 5.0)) for i, n in enumerate((8, 16))
               for s in range(n_seeds)]
    means = report.aggregate_seeds(records + [record("b", 0, 8, 1.5, ci=(1.25, 1.75))])
    a = means[means["model"] == "a"]
    lo, hi = stats.t.interval(0.95, n_seeds - 1, loc=values.mean(axis=1), scale=stats.sem(values, axis=1))
    np.testing.assert_allclose(a["value"], values.mean(axis=1), rtol=1e-15)
    np.testing.assert_allclose(a["ci_low"], lo, rtol=1e-12)
    np.testing.assert_allclose(a["ci_high"], hi, rtol=1e-12)
    assert list(a["n_seeds"]) == [n_seeds] * 2 and list(a["n_tokens"]) == [sum(range(100, 100 + n_seeds))] * 2
    assert a["source"].iloc[0] == ";".join(sorted(f"runs/a-s{s}" for s in range(n_seeds)))
    b = means[means["model"] == "b"].iloc[0]  # a single run keeps its bootstrap interval
    assert (b["value"], b["ci_low"], b["ci_high"], b["n_seeds"]) == (1.5, 1.25, 1.75, 1)


def test_markdown_table_renders_a_dataframe():
    frame = pd.DataFrame({"model": ["a", "b|c"], "L": [8, 16], "1x": ["1.000 [0.900, 1.100]", "–"]})
    assert report.markdown_table(frame) == ("| model | L | 1x |\n|---|---|---|\n"
                                            "| a | 8 | 1.000 [0.900, 1.100] |\n| b\\|c | 16 | – |")


def test_summary_tables_pivot_the_mean_rows():
    values = [1.0, 1.25, 1.75]
    records = [record("a", s, 8, v) for s, v in enumerate(values)] + [
        record("a", s, 10, 2.0) for s in range(3)] + [
        record("b", 0, 8, 1.5, ci=(1.4, 1.6), policy="clip"),
        record("b", 0, 8, 3.0, protocol="fixed_target", offset=6, policy="clip")]
    summary = report.markdown_summary(report.aggregate_seeds(records), [])
    half = stats.t.ppf(0.975, 2) * np.std(values, ddof=1) / np.sqrt(3)
    m = np.mean(values)
    assert (f"## d: chunked, masked-token loss\n\n| model | policy | L | 1x | L+2 |\n|---|---|---|---|---|\n"
            f"| a | none | 8 | {m:.3f} [{m - half:.3f}, {m + half:.3f}] | 2.000 [2.000, 2.000] |\n"
            "| b | clip | 8 | 1.500 [1.400, 1.600] | – |\n") in summary
    assert "| a | none | 8 | – | – |\n| b | clip | 8 | – | – |" in summary  # no accuracy was scored
    assert ("| model | policy | eval length | offset 6 |\n|---|---|---|---|\n| b | clip | 8 | 3.000 |"
            in summary)


def floor_records() -> list[dict]:
    """Chunked losses at 1x and 2x of the unigram floor and of three models: one well below it, one level with it
    and one below it only within its interval; `good` was loaded from the best checkpoints of two seeds, steps 100
    and 200."""
    out = []
    for model, seeds, value, ci in (("unigram", ("-",), 3.0, (2.98, 3.02)), ("good", (0, 1), 2.5, (2.45, 2.55)),
                                    ("flat", (0,), 2.99, (2.97, 3.01)), ("noisy", (0,), 2.9, (2.8, 2.96))):
        for seed in seeds:
            for eval_len in (8, 16):
                v = value + (seed if isinstance(seed, int) else 0) * 0.01
                step = 100 * (seed + 1) if model == "good" else None
                out.append(dict(record(model, seed, eval_len, v, ci=ci), step=step,
                                checkpoint="best" if step else None))
    return out


def test_a_model_not_clearly_below_the_unigram_floor_is_warned_of(tmp_path, monkeypatch):
    logged = []
    monkeypatch.setattr(report.logging, "warning", lambda fmt, *args: logged.append(fmt % args))
    _, summary, _ = report.write_report(floor_records(), [], str(tmp_path), notes=["another warning"])
    assert len(logged) == 1 and "flat (2.990 at 1x), noisy (2.900 at 1x) are not clearly below the unigram floor" \
        in logged[0]
    assert "good" not in logged[0] and "not scored at the training length" not in logged[0]
    head = summary.split("Mean over seeds")[0]
    assert "another warning" in head and logged[0] in head
    assert report.read_results_file(tmp_path)["notes"] == ["another warning", logged[0]]
    _, rebuilt, _ = report.rebuild_report(str(tmp_path))  # the warning read back is not repeated
    assert rebuilt == summary
    # Nor is one worded by an earlier version: the floor warnings are drawn anew.
    data = report.read_results_file(tmp_path)
    older = "d: flat (2.990) is not clearly below the unigram floor (3.000) at the training length"
    report.write_results(data["records"], [], str(tmp_path), notes=["another warning", older])
    _, rebuilt, _ = report.rebuild_report(str(tmp_path))
    assert rebuilt == summary and older not in rebuilt


def test_the_floor_warning_looks_at_the_shortest_length_scored(tmp_path):
    """Without 1x (multiples 2,4), the shortest length scored stands in for it, and the warning says 1x is missing."""
    records = [r for r in floor_records() if r["eval_len"] == 16]
    _, summary, _ = report.write_report(records, [], str(tmp_path))
    assert "flat (2.990 at 2x), noisy (2.900 at 2x) are not clearly below the unigram floor (3.000)" in summary
    assert "flat, noisy were not scored at the training length" in summary and "add 1 to the multiples" in summary


@pytest.mark.parametrize("change, message", [
    (dict(config="other"), "they were trained differently (config fingerprints a vs other)"),
    (dict(method="window"), "runs/a-s0 and runs/a-s1 under the length method 'window' would both be reported as 'a'"),
    (dict(step=200, checkpoint="latest"), "they are at different checkpoint steps (100 vs 200)"),
    (dict(seed=0, source="copy/a-s0"), "but both have seed 0: one run given twice, or a repeated run"),
    (dict(seed=0, source="runs/a-s0"), "has 2 records for one loss (chunked, policy none, length 8, d): one run"),
])
def test_records_that_are_not_seeds_of_one_model_are_never_averaged(change, message):
    """Records from anywhere (a results file, a sweep's cached evaluations) are grouped by what they are, not by their
    label: seed 1 of `a` changed in one identity field at a time."""
    base = [dict(record("a", seed, 8, 2.0 + seed), step=100, checkpoint="latest") for seed in (0, 1)]
    with pytest.raises(ValueError, match=re.escape(message)):
        report.aggregate_seeds([base[0], dict(base[1], **change)])
    # Each run's best checkpoint may be at another step.
    best = [dict(r, checkpoint="best", step=100 * (i + 1)) for i, r in enumerate(base)]
    assert report.aggregate_seeds(best)["n_seeds"].tolist() == [2]


def test_results_and_summary_name_each_checkpoint_step(tmp_path):
    _, summary, _ = report.write_report(floor_records(), [], str(tmp_path))
    assert "Checkpoints scored: good (seed 0): step 100; good (seed 1): step 200." in summary
    runs = [r for r in report.read_results_file(tmp_path)["records"] if r["seed"] != "mean"]
    assert {(r["model"], r["seed"], r["step"]) for r in runs} == {
        ("good", 0, 100), ("good", 1, 200), ("flat", 0, None), ("noisy", 0, None), ("unigram", "-", None)}


def test_plots_of_an_earlier_report_are_removed_and_nothing_else(tmp_path):
    earlier = ["loss_vs_length_other_data.png", "loss_by_position_other_data.png"]
    kept = ["my_plot.png", "loss_vs_length_notes.txt", "summary_old.md"]
    for name in earlier + kept:
        (tmp_path / name).write_bytes(b"x")
    _, _, plots = report.write_report(study_records(np.random.default_rng(0)), [], str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        kept + ["results.json.gz", "summary.md"] + [os.path.basename(p) for p in plots])
    assert {os.path.basename(p) for p in plots} == {"loss_vs_length_d.png", "loss_by_position_d.png"}


def test_plots_are_saved_in_a_palette_that_keeps_their_colours(tmp_path):
    """A plot's colours survive the palette, at fewer bytes: 99% of pixels within 16 of 255 levels of the RGBA
    render (observed 14), the rest anti-aliased edges (observed at most 52)."""
    import io

    import matplotlib.pyplot as plt
    from PIL import Image

    fig, ax = plt.subplots(figsize=(4, 3))
    for i in range(12):
        ax.plot(np.arange(10), np.arange(10) * (i + 1), marker="o", label=str(i))
    ax.legend()
    rendered = io.BytesIO()
    fig.savefig(rendered, dpi=100, format="png")
    report.save_png(fig, str(tmp_path / "plot.png"), dpi=100)
    plt.close(fig)
    saved = Image.open(tmp_path / "plot.png")
    assert saved.mode == "P" and (tmp_path / "plot.png").stat().st_size < len(rendered.getvalue())
    original = np.asarray(Image.open(rendered).convert("RGB"), np.int32)
    error = np.abs(np.asarray(saved.convert("RGB"), np.int32) - original).max(axis=-1)
    assert np.percentile(error, 99) <= 16 and error.max() <= 64


def test_the_context_gain_table_says_what_each_row_resolves():
    """Per seed: the largest half-width of the row's intervals over its lengths and the targets it scored; the mean
    over seeds: its pooled interval's, with the targets of one seed (not the sum over seeds)."""
    rows = []
    for seed, halves in ((0, (0.01, 0.03)), (1, (0.02, 0.005))):
        for eval_len, half in zip((16, 32), halves):
            diffs = [-0.5 * (seed + 1), 0.25, -1.0]
            rows.append(dict(record("a", seed, eval_len, -0.1, metric=report.CONTEXT_GAIN, protocol="centred_target",
                                    ci=(-0.1 - half, -0.1 + half)), n_tokens=30, doc_diff=diffs, doc_count=[10] * 3))
    frame = report.records_frame(rows)
    text = "\n".join(report.paired_markdown(pd.concat([frame, report.aggregate_seeds(frame)], ignore_index=True)))
    assert "## d: centred_target, context gain: loss of the same targets at N minus at L" in text
    assert "| a | none | 8 | 0 | -0.100 [-0.110, -0.090] | -0.100 [-0.130, -0.070] | 0.030 | 30 |" in text
    assert "| 8 | 1 | -0.100 [-0.120, -0.080] | -0.100 [-0.105, -0.095] | 0.020 | 30 |" in text
    mean = [line for line in text.splitlines() if "| mean |" in line][0]
    lo, hi = report.pooled_interval(frame[frame["eval_len"] == 16])
    lo32, hi32 = report.pooled_interval(frame[frame["eval_len"] == 32])
    assert mean.endswith(f"| {max(hi - lo, hi32 - lo32) / 2:.3f} | 30 |")
