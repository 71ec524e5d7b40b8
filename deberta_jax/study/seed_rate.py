"""How often a model learns what its position-free twin cannot, across seeds: the share of seeds whose `run` leaves
the plateau of its `baseline` (the same model without positions, trained on the same batches at the same seed),
and the step at which it does.

    python -m deberta_jax.study.seed_rate --run bert --baseline nope --out results/natural-seeds/rate \
        --curves results/natural/curves/curves.json --curves results/natural/curves-s1/curves.json ...

Each `--curves` file is one seed's `deberta_jax.study.curves` output holding both labels; the seed is read from the
run's workdir name (`...-s<seed>`). A seed's run "leaves the baseline's plateau" at the first evaluation where its
eval loss is `margin` nats below the baseline's at the same step. A single run is an anecdote here: float
differences between machines move the step at which a run escapes (the same command diverged after 500 steps on
two CPUs), so the result is a rate with its binomial interval (Clopper-Pearson), not one outcome.

Writes `rate.md` (summary and a row per seed), `rate.json` and `gap_vs_step.png` (run minus baseline per seed).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
from absl import app, flags
from scipy import stats

from deberta_jax import storage
from deberta_jax.data import errors
from deberta_jax.study import length_study, report
from deberta_jax.study.curves import DEFAULT_MARGIN, plot_by_step
from deberta_jax.study.report import CONFIDENCE


def read_curves(path: str, run: str, baseline: str) -> dict:
    """`{"seed", "run", "baseline"}` from one curves.json: the seed and each label's `{step: eval loss}`."""
    try:
        data = json.loads(storage.read_text(path))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}): truncated or not a curves file; rebuild it with "
                         "python -m deberta_jax.study.curves") from None
    missing = [label for label in (run, baseline) if label not in data.get("curves", {})]
    if missing:
        raise ValueError(f"{path} has no curve labelled {', '.join(map(repr, missing))} (it has "
                         f"{sorted(data.get('curves', {}))}); rebuild it with python -m deberta_jax.study.curves "
                         f"--workdir {run}=... --workdir {baseline}=...")
    seed = length_study.workdir_seed(data["workdirs"][run])
    if seed is None:
        raise ValueError(f"{path}: cannot read a seed from {run}'s workdir {data['workdirs'][run]!r} (expected a "
                         "name ending in -s<seed>, as the sweep runner names them)")
    curve = lambda label: {int(step): loss for step, loss in data["curves"][label].items()}  # noqa: E731
    return dict(seed=seed, run=curve(run), baseline=curve(baseline))


def escape_step(run: dict[int, float], baseline: dict[int, float], margin: float) -> int | None:
    """The first step both logged at which `run` is at least `margin` below `baseline`, or None."""
    return next((s for s in sorted(set(run) & set(baseline)) if run[s] <= baseline[s] - margin), None)


def seed_table(seeds: list[dict], margin: float) -> pd.DataFrame:
    """One row per seed: the escape step, and both final losses at the last step both logged."""
    rows = []
    for entry in sorted(seeds, key=lambda e: e["seed"]):
        last = max(set(entry["run"]) & set(entry["baseline"]))
        rows.append(dict(seed=entry["seed"], escape_step=escape_step(entry["run"], entry["baseline"], margin),
                         final_step=last, run_loss=entry["run"][last], baseline_loss=entry["baseline"][last],
                         gap=entry["run"][last] - entry["baseline"][last]))
    table = pd.DataFrame(rows)
    if table["seed"].duplicated().any():
        raise ValueError(f"seed(s) {sorted(table['seed'][table['seed'].duplicated()])} given twice; pass one curves "
                         "file per seed")
    return table


def summarize(table: pd.DataFrame) -> dict:
    """The share of seeds that escape with its `CONFIDENCE` Clopper-Pearson interval, and their escape steps."""
    escaped = table["escape_step"].dropna().astype(int)
    k, n = len(escaped), len(table)
    interval = stats.binomtest(k, n).proportion_ci(confidence_level=CONFIDENCE, method="exact")
    return dict(seeds=n, escaped=k, rate=k / n, rate_ci=[float(interval.low), float(interval.high)],
                median_step=float(np.median(escaped)) if k else None,
                min_step=int(escaped.min()) if k else None, max_step=int(escaped.max()) if k else None)


def write_rate_report(paths: list[str], run: str, baseline: str, out_dir: str, margin: float = DEFAULT_MARGIN) -> str:
    """Writes rate.md, rate.json and gap_vs_step.png for the curves files `paths`; returns the Markdown."""
    if not margin > 0:  # at 0 or below, a seed level with or worse than its baseline would count as leaving it
        raise ValueError(f"--margin={margin:g}: a seed leaves its baseline's plateau only by going below it; give a "
                         f"positive number of nats (default {DEFAULT_MARGIN:g})")
    seeds = [read_curves(path, run, baseline) for path in paths]
    table = seed_table(seeds, margin)
    summary = summarize(table)
    lo, hi = summary["rate_ci"]
    steps = ("never" if not summary["escaped"] else
             f"median step {summary['median_step']:,.0f}, range {summary['min_step']:,}-{summary['max_step']:,}")
    shown = table.assign(
        escape_step=[f"{int(s):,}" if pd.notna(s) else "not within the run" for s in table["escape_step"]],
        **{c: table[c].map(lambda v: f"{v:.3f}") for c in ("run_loss", "baseline_loss", "gap")})
    shown.columns = ["seed", f"{run} leaves {baseline}'s plateau at step", "last step", f"{run} eval loss",
                     f"{baseline} eval loss", "difference"]
    markdown = "\n".join([
        f"# How often {run} leaves {baseline}'s plateau", "",
        f"A seed's {run} leaves the plateau at its first evaluation {margin:g} nats below {baseline}'s eval loss "
        "at the same step (same seed, same batches).", "",
        f"**{summary['escaped']} of {summary['seeds']} seeds** ({100 * summary['rate']:.0f}%, "
        f"{100 * CONFIDENCE:.0f}% Clopper-Pearson interval {100 * lo:.0f}-{100 * hi:.0f}%); {steps}.", "",
        report.markdown_table(shown), "",
        "Sources: " + ", ".join(f"`{p}`" for p in paths), ""])
    storage.write_text(os.path.join(out_dir, "rate.md"), markdown)
    storage.write_text(os.path.join(out_dir, "rate.json"), json.dumps(dict(
        run=run, baseline=baseline, margin=margin, sources=paths, **summary,
        seeds_table=json.loads(table.to_json(orient="records"))), indent=1) + "\n")
    gaps = {f"seed {e['seed']}": {s: e["run"][s] - e["baseline"][s] for s in set(e["run"]) & set(e["baseline"])}
            for e in sorted(seeds, key=lambda e: e["seed"])}
    plot_by_step(gaps, [(0.0, "--", None), (-margin, ":", f"-{margin:g} (leaves the plateau)")],
                 f"eval loss, {run} minus {baseline} (nats)", f"Does {run} use its positions? One line per seed",
                 os.path.join(out_dir, "gap_vs_step.png"))
    return markdown


FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_multi_string("curves", [], "A curves.json (python -m deberta_jax.study.curves) per seed; repeat.")
    flags.DEFINE_string("run", "bert", "Label of the model with positions in every curves file.")
    flags.DEFINE_string("baseline", "nope", "Label of the same model without positions.")
    flags.DEFINE_string("out", None, "Output directory: a local folder or gs://bucket/...")
    flags.DEFINE_float("margin", DEFAULT_MARGIN, "Nats (> 0) below the baseline that count as leaving its plateau.")


def main(argv):
    del argv
    if not FLAGS.curves or not FLAGS.out:
        raise app.UsageError("give at least one --curves FILE and --out DIR")
    for path in FLAGS.curves:
        if not storage.path(path).is_file():
            raise app.UsageError(f"--curves {path}: no such file")
    print(write_rate_report(FLAGS.curves, FLAGS.run, FLAGS.baseline, FLAGS.out, FLAGS.margin))


if __name__ == "__main__":
    define_flags()
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.study.seed_rate"))
