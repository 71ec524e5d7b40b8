"""Turning evaluation records into results files, a Markdown summary and plots.

Records are flat dicts in long format (one value per model, seed, policy, protocol, dataset, train
length, eval length, offset, position bucket and metric), so any table or plot is a filter and a
group-by. Runs that differ only in seed share a `model` label; `aggregate_seeds` adds records with
`seed="mean"` holding the mean over seeds and a 95% t-interval (or, for a single seed, that run's
bootstrap interval over documents).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

KEY_FIELDS = ("model", "policy", "protocol", "dataset", "train_len", "eval_len", "offset", "bucket", "metric")
FIELDS = ("model", "seed", "source", "policy", "protocol", "dataset", "train_len", "eval_len", "multiple",
          "offset", "bucket", "metric", "value", "ci_low", "ci_high", "n_tokens", "n_seeds")
# Two-sided 97.5% Student-t quantiles for 1..10 degrees of freedom; normal beyond.
_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228}


def aggregate_seeds(records: Sequence[dict]) -> list[dict]:
    """Mean over seeds (and a 95% interval) for every key; one record per key."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[tuple(r.get(k) for k in KEY_FIELDS)].append(r)
    out = []
    for rows in groups.values():
        values = np.array([r["value"] for r in rows], dtype=np.float64)
        mean = float(values.mean())
        if len(rows) > 1:
            half = _T975.get(len(rows) - 1, 1.96) * float(values.std(ddof=1)) / math.sqrt(len(rows))
            lo, hi = mean - half, mean + half
        else:
            lo, hi = rows[0].get("ci_low"), rows[0].get("ci_high")
        out.append(dict(rows[0], seed="mean", value=mean, ci_low=lo, ci_high=hi,
                        n_tokens=int(sum(r["n_tokens"] for r in rows)), n_seeds=len(rows),
                        source=";".join(sorted({str(r["source"]) for r in rows}))))
    return out


REFERENCES = ("unigram", "oracle")


def add_gap_closed(records: Sequence[dict]) -> list[dict]:
    """`gap_closed` records: `(unigram loss - loss) / (unigram loss - oracle loss)` on the same targets.

    Where both references were scored (synthetic data), a loss reads as the share of the learnable gap a model
    closed: 0 at the context-free floor, 1 at the Bayes-optimal prediction from the same window.
    """
    def key(r):  # the same windows and targets (fixed-target spans follow the training length)
        return r["protocol"], r["dataset"], r["train_len"], r["eval_len"], r["offset"]
    overall = [r for r in records if r["metric"] == "loss" and r["bucket"] == "all"]
    refs = {(r["model"], *key(r)): r["value"] for r in overall if r["model"] in REFERENCES}
    extra = []
    for r in overall:
        unigram, oracle = refs.get(("unigram", *key(r))), refs.get(("oracle", *key(r)))
        if r["model"] not in REFERENCES and unigram is not None and oracle is not None and unigram > oracle:
            extra.append(dict(r, metric="gap_closed", value=(unigram - r["value"]) / (unigram - oracle),
                              ci_low=None, ci_high=None))
    return list(records) + extra


def check_finite(records: Iterable[dict]) -> None:
    """Refuse to write a result containing NaN or inf: a silent NaN is a wrong result."""
    for r in records:
        for field in ("value", "ci_low", "ci_high"):
            v = r.get(field)
            if v is not None and not math.isfinite(v):
                raise FloatingPointError(f"non-finite {field} in record {r}")


def write_results(records: Sequence[dict], skipped: Sequence[dict], out_dir: str) -> None:
    """`results.json` (records + skipped combinations with reasons) and `results.csv`."""
    check_finite(records)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"records": list(records), "skipped": list(skipped)}, f, indent=1)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(records)


def write_report(records: Sequence[dict], skipped: Sequence[dict], out_dir: str, notes: Sequence[str] = ()
                 ) -> tuple[list[dict], str, list[str]]:
    """Per-seed records -> results files, `summary.md` (with `notes` as warnings at its top) and plots in `out_dir`.

    Returns the mean-over-seeds records, the summary's Markdown and the plot paths.
    """
    records = add_gap_closed(records)
    means = aggregate_seeds(records)
    write_results(list(records) + means, skipped, out_dir)
    summary = markdown_summary(means, skipped, notes)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(summary)
    return means, summary, plot_all(means, out_dir)


def _select(records, **where):
    return [r for r in records if all(r.get(k) == v for k, v in where.items())]


def _fmt(r: dict | None, digits: int = 3) -> str:
    if r is None:
        return "–"
    if r.get("ci_low") is None:
        return f"{r['value']:.{digits}f}"
    return f"{r['value']:.{digits}f} [{r['ci_low']:.{digits}f}, {r['ci_high']:.{digits}f}]"


def _length_label(r: dict) -> str:
    extra = r["eval_len"] - r["train_len"]
    if r["eval_len"] % r["train_len"] == 0:
        return f"{r['eval_len'] // r['train_len']}x"
    return f"L{extra:+d}"


def markdown_summary(mean_records: Sequence[dict], skipped: Sequence[dict], notes: Sequence[str] = ()) -> str:
    """Chunked-protocol tables (loss, accuracy by eval length) and fixed-target tables (loss by offset)."""
    lines = ["# Length extrapolation", ""] + [f"> **Warning.** {note}\n" for note in notes] + [
             "Mean over seeds with 95% interval (t-interval over seeds; bootstrap over documents for one seed; "
             "none with fewer than two documents).",
             "Lengths are multiples of each model's training length L, or L plus a few tokens.", ""]
    overall = [r for r in mean_records if r["bucket"] == "all"]
    for dataset in sorted({r["dataset"] for r in overall}):
        rows = _select(overall, dataset=dataset, protocol="chunked")
        if rows:
            by_ratio = sorted({(r["eval_len"] / r["train_len"], _length_label(r)) for r in rows})
            labels = list(dict.fromkeys(label for _, label in by_ratio))
            for metric in ("loss", "accuracy"):
                lines += [f"## {dataset}: chunked, masked-token {metric}", "",
                          "| model | policy | L | " + " | ".join(labels) + " |",
                          "|---|---|---|" + "---|" * len(labels)]
                for model, policy in sorted({(r["model"], r["policy"]) for r in rows}):
                    sel = _select(rows, model=model, policy=policy, metric=metric)
                    by_label = {_length_label(r): r for r in sel}
                    train_len = sel[0]["train_len"] if sel else "?"
                    lines.append(f"| {model} | {policy} | {train_len} | "
                                 + " | ".join(_fmt(by_label.get(lab)) for lab in labels) + " |")
                lines.append("")
        rows = _select(overall, dataset=dataset, protocol="fixed_target", metric="loss")
        if rows:
            offsets = sorted({r["offset"] for r in rows})
            lines += [f"## {dataset}: fixed-target loss by offset of the target span", "",
                      "| model | policy | eval length | " + " | ".join(f"offset {o}" for o in offsets) + " |",
                      "|---|---|---|" + "---|" * len(offsets)]
            for model, policy, eval_len in sorted({(r["model"], r["policy"], r["eval_len"]) for r in rows}):
                sel = {r["offset"]: r for r in _select(rows, model=model, policy=policy, eval_len=eval_len)}
                lines.append(f"| {model} | {policy} | {eval_len} | "
                             + " | ".join(_fmt(sel.get(o)) for o in offsets) + " |")
            lines.append("")
    if skipped:
        lines += ["## Not evaluated", ""]
        seen = set()
        for s in skipped:
            key = (s["model"], s["policy"], s["eval_len"], s["reason"])
            if key not in seen:
                seen.add(key)
                lines.append(f"- {s['model']} / {s['policy']} at length {s['eval_len']}: {s['reason']}")
        lines.append("")
    return "\n".join(lines)


def ablation_table(mean_records: Sequence[dict], policy: str, multiples=(1, 2, 4, 8)) -> str:
    """One row per variant: chunked loss and accuracy at each multiple of L, per dataset, and the
    loss change from 1x to the largest multiple (mean over seeds of each run's own change, so the
    interval is the paired one).

    Models with a learned absolute table are shown under `policy` (the other policies are in
    summary.md); relative models have the single policy "none".
    """
    rows = [r for r in mean_records if r["protocol"] == "chunked" and r["bucket"] == "all"
            and r["policy"] in (policy, "none")
            and r["metric"] in ("loss", "accuracy", "loss_change_vs_1x", "gap_closed")]
    longest = float(max(multiples))
    lines = []
    for dataset in sorted({r["dataset"] for r in rows}):
        sel = _select(rows, dataset=dataset)
        gaps = [m for m in (1, max(multiples)) if _select(sel, metric="gap_closed", eval_len=sel[0]["train_len"] * m)]
        lines += [f"### {dataset}: masked-token loss / accuracy (chunked; absolute tables: {policy})", "",
                  "| variant | seeds | " + " | ".join(f"loss {m}x" for m in multiples) + " | "
                  + " | ".join(f"acc {m}x" for m in multiples) + f" | loss {max(multiples)}x - 1x |"
                  + "".join(f" gap closed {m}x |" for m in gaps),
                  "|---|---|" + "---|" * (2 * len(multiples) + 1 + len(gaps))]
        for model in sorted({r["model"] for r in sel}, key=lambda m: (m in REFERENCES, m)):
            cells = {(r["metric"], r["eval_len"] / r["train_len"]): r for r in _select(sel, model=model)}
            seeds = max(r.get("n_seeds") or 1 for r in _select(sel, model=model))
            lines.append(f"| {model} | {seeds} | "
                         + " | ".join(_fmt(cells.get(("loss", float(m)))) for m in multiples) + " | "
                         + " | ".join(_fmt(cells.get(("accuracy", float(m)))) for m in multiples) + " | "
                         + _fmt(cells.get(("loss_change_vs_1x", longest))) + " |"
                         + "".join(f" {_fmt(cells.get(('gap_closed', float(m))), 2)} |" for m in gaps))
        lines.append("")
    return "\n".join(lines)


_POLICY_STYLES = {"none": "-", "clip": "-", "untrained": "--", "interpolate": ":", "strict": "-."}


def plot_all(mean_records: Sequence[dict], out_dir: str) -> list[str]:
    """Loss vs eval/train length (log2 x, interval bands) and loss by position per eval length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for dataset in sorted({r["dataset"] for r in mean_records}):
        rows = _select(mean_records, dataset=dataset, protocol="chunked", metric="loss")
        overall = [r for r in rows if r["bucket"] == "all"]
        if not overall:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        # One colour per model (tab20 has enough for a sweep), one line style per absolute-table policy.
        models = sorted({r["model"] for r in overall})
        colours = {m: plt.get_cmap("tab20" if len(models) > 10 else "tab10")(i) for i, m in enumerate(models)}
        for model, policy in sorted({(r["model"], r["policy"]) for r in overall}):
            sel = sorted(_select(overall, model=model, policy=policy), key=lambda r: r["eval_len"])
            x = np.array([r["eval_len"] / r["train_len"] for r in sel])
            y = np.array([r["value"] for r in sel])
            label = model if policy == "none" else f"{model} ({policy})"
            (line,) = ax.plot(x, y, marker="o", label=label, color=colours[model],
                              linestyle=_POLICY_STYLES.get(policy, "-"))
            if all(r.get("ci_low") is not None for r in sel):
                ax.fill_between(x, [r["ci_low"] for r in sel], [r["ci_high"] for r in sel],
                                color=line.get_color(), alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("eval length / training length")
        ax.set_ylabel("masked-token loss (nats)")
        ax.set_title(f"Length extrapolation on {dataset} (chunked)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = os.path.join(out_dir, f"loss_vs_length_{_slug(dataset)}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)

        curves = sorted({(r["model"], r["policy"]) for r in rows if r["bucket"] != "all"})
        if not curves:
            continue
        cols = min(len(curves), 4)
        nrows = -(-len(curves) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.6 * nrows), squeeze=False, sharey=True)
        for ax, (model, policy) in zip(axes.flat, curves):
            sel = [r for r in _select(rows, model=model, policy=policy) if r["bucket"] != "all"]
            for eval_len in sorted({r["eval_len"] for r in sel}):
                pts = sorted(_select(sel, eval_len=eval_len), key=lambda r: r["bucket"])
                ax.plot([r["bucket"] / r["train_len"] for r in pts], [r["value"] for r in pts],
                        label=f"N={eval_len}")
            ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
            ax.set_title(model if policy == "none" else f"{model} ({policy})", fontsize=9)
            ax.set_xlabel("position in window / training length")
        for ax in axes.flat[len(curves):]:
            ax.set_visible(False)
        for ax in axes[:, 0]:
            ax.set_ylabel("masked-token loss")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"Loss by position on {dataset}; dashed line = training length")
        fig.tight_layout()
        path = os.path.join(out_dir, f"loss_by_position_{_slug(dataset)}.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")
