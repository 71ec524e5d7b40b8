"""Models from several studies side by side, per seed: how much each one's loss rises past the training length, and
whether the same targets get easier as the context around them grows.

    python -m deberta_jax.study.compare --results results/natural-far/results.json.gz \
        --results results/natural-past/results.json.gz --baseline deberta-emd-L64 \
        --models deberta-emd-L64,deberta-emd-L64+window_global,deberta-emd-learned-long256-L64 \
        --out results/natural-past/compare

Studies that share a recipe, seeds and evaluation texts (their settings and caches are keyed alike) are comparable
run by run, though each report only holds its own runs. Two views:

- **chunked rise**: each seed's loss at every multiple of L minus its own loss at 1x (negative: the longer inputs
  are easier), with the 1x loss against `--baseline`'s at the same seed (what a training recipe costs where
  nothing is extrapolated);
- **fixed targets**: the loss of the same target spans at the centre of windows of every length, inside their
  document (`centred_target`), by window length, with the paired change from the window of L and its interval.
  Falling means the model uses the extra keys (context), flat means it behaves like a window of L, rising means the
  extra keys hurt. The verdict compares the longest window with the window of L, at `--flat_within` nats. Results
  scored before that protocol hold the retired `fixed_target` one (spans L/2 into each window, across documents),
  shown as such.

- **local skill against context use** (with `--baseline`): per model, what its 1x costs against the baseline and
  how much its loss with full attention differs from its loss with its own window of L keys (`window_global`) on
  the same chunks, at every multiple: the trade a training recipe makes between the length it is scored at most
  and the keys past it.

Writes `compare.md`, `fixed_targets.png` and `trade.png` into `--out`, and prints the markdown.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training host
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from absl import app, flags  # noqa: E402
from matplotlib import ticker  # noqa: E402

from deberta_jax import storage  # noqa: E402
from deberta_jax.study import report  # noqa: E402

FLAGS = flags.FLAGS
# The policy the natural-text studies' tables show BERT under.
DEFAULT_POLICY = "clip"


def define_flags() -> None:
    """The command line's flags, defined only when run as a program (eval.py's --out must not clash)."""
    flags.DEFINE_multi_string("results", [], "A study's results file (results.json.gz); repeat for more.")
    from deberta_jax.data import errors

    errors.list_flag("models", [], "Model labels to compare, as the results files name them (e.g. deberta-emd-L64, "
                      "deberta-emd-L64+window).")
    flags.DEFINE_string("baseline", None,
                        "The label whose 1x loss each model's 1x loss is compared with, seed by seed.")
    flags.DEFINE_string("policy", DEFAULT_POLICY, "A model with a learned absolute table (BERT) is compared under this "
                        "policy past the training length (clip, untrained or interpolate, as scored).")
    flags.DEFINE_float("flat_within", 0.02, "Fixed targets: a change within this many nats from the window of L to the "
                       "longest window counts as flat.", lower_bound=0.0)
    errors.list_flag("trade_at", [], "Multiples of L (integers) that trade.png shows context use at, e.g. 8,32 "
                     "(default: 8x and the longest multiple scored).")
    flags.DEFINE_string("out", None, "Folder for compare.md and the plots (local or gs://...).")


def load(paths: list[str], models: list[str], policy: str = DEFAULT_POLICY) -> pd.DataFrame:
    """The loss records of `models` from every results file, refusing a model that two files both hold (which run
    would it be?) and naming any that none holds. A model with a learned absolute table is read under `policy`
    (its rows past the training length), the others under none."""
    frames, labels = [], set()
    for path in paths:
        frame = report.load_results(path)
        labels.update(frame["model"].unique())
        # Each seed's own records: the file's means over seeds are recomputed here, over the seeds compared.
        paired = report.is_paired(frame["metric"])
        frame = frame[frame["model"].isin(models) & ((frame["metric"] == "loss") | paired) & (frame["bucket"] == "all")
                      & frame["policy"].isin(["none", policy]) & frame["seed"].map(lambda s: isinstance(s, int))]
        frames.append(frame.assign(results=path))
    records = pd.concat(frames, ignore_index=True)
    sources = records.groupby("model")["results"].unique()
    doubled = {m: list(files) for m, files in sources.items() if len(files) > 1}
    if doubled:
        raise ValueError(f"--models: {doubled} appear in more than one results file; compare each once (give one "
                         "of the files, or rename the runs)")
    missing = [m for m in models if m not in sources.index]
    if missing:
        raise ValueError(f"--models: {', '.join(missing)} not in {', '.join(paths)} under --policy={policy}; their "
                         "labels: " + ", ".join(sorted(labels)))
    return records


def chunked_rises(records: pd.DataFrame, baseline: str | None) -> pd.DataFrame:
    """One row per (dataset, model, seed): loss at 1x, its difference from the baseline's at that seed, and the
    rise at every longer multiple; then each model's mean over its seeds."""
    chunked = records[(records["protocol"] == "chunked") & (records["metric"] == "loss")]
    loss = chunked.pivot_table(index=["dataset", "model", "seed"], columns="multiple", values="value")
    if 1.0 not in loss.columns:
        raise ValueError("the results hold no chunked loss at 1x (the training length), which every rise is measured "
                         "from; score the models with multiple 1 (eval.py's default --multiples)")
    unscored = loss.index[loss[1.0].isna()]
    if len(unscored):
        raise ValueError(f"{unscored[0][1]} (seed {unscored[0][2]}, {unscored[0][0]}) has no chunked loss at 1x, "
                         "which its rises are measured from; score it with multiple 1")
    table = pd.DataFrame({"1x": loss[1.0]})
    if baseline is not None:
        base = loss.xs(baseline, level="model")[1.0]
        table["1x vs baseline"] = [row - base.get((d, s), float("nan")) for (d, _, s), row in loss[1.0].items()]
    for multiple in [m for m in loss.columns if m > 1]:
        table[f"rise {multiple:g}x"] = loss[multiple] - loss[1.0]
    means = table.groupby(level=["dataset", "model"]).mean().assign(seed="mean").set_index("seed", append=True)
    return pd.concat([table, means]).sort_index(level=["dataset", "model"], sort_remaining=False)


# The fixed-target protocols by window length: the centred one, and the retired one's spans L/2 into each window.
FIXED_PROTOCOLS = ("centred_target", "fixed_target")


def fixed_targets(records: pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds of the loss of the same targets by window length, per protocol (`FIXED_PROTOCOLS`)."""
    centred = records["protocol"] == FIXED_PROTOCOLS[0]
    retired = (records["protocol"] == FIXED_PROTOCOLS[1]) & (records["offset"] == records["train_len"] // 2)
    fixed = records[(centred | retired) & (records["metric"] == "loss")]
    return fixed.pivot_table(index=["dataset", "protocol", "model"], columns="eval_len", values="value",
                             aggfunc="mean")


def verdicts(fixed: pd.DataFrame, flat_within: float) -> pd.Series:
    """falls / flat / rises, from each model's window of L to the longest window it was scored at (models of other
    training lengths fill other columns; a model scored short of the table's longest window says up to which)."""
    if not flat_within >= 0:
        raise ValueError(f"flat_within={flat_within}: give a non-negative number of nats")
    longest = fixed.columns[-1]

    def verdict(row):
        scored = row.dropna()
        change = scored.iloc[-1] - scored.iloc[0]
        word = "flat" if abs(change) <= flat_within else "falls" if change < 0 else "rises"
        upto = "" if scored.index[-1] == longest else f" (to {scored.index[-1]})"
        return f"{change:+.3f}{upto}: {word}"
    return fixed.apply(verdict, axis=1)


def plot(fixed: pd.DataFrame, path: str) -> None:
    datasets = fixed.index.get_level_values("dataset").unique()
    fig, axes = plt.subplots(1, len(datasets), figsize=(6 * len(datasets), 4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for (protocol, model), row in fixed.xs(dataset, level="dataset").iterrows():
            retired = protocol != FIXED_PROTOCOLS[0]
            ax.plot(row.index, row.values, marker="o", linestyle="--" if retired else "-",
                    label=f"{model} ({protocol})" if retired else model)
        ax.set(xlabel="window length (tokens)", ylabel="loss of the same targets (nats)", title=dataset)
        # Base 2 with only the window lengths marked: base 10's minor labels (2 x 10^2, ...) would overprint them.
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
        ax.set_xticks(list(fixed.columns), [str(c) for c in fixed.columns])
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    report.save_png(fig, path, dpi=120)
    plt.close(fig)


def paired(records: pd.DataFrame) -> list[str]:
    """The paired measures of the compared models (each seed's record and the mean over the seeds compared, its
    documents resampled jointly), or a line saying why there are none."""
    runs = records[report.is_paired(records["metric"])]
    if runs.empty:
        return ["## Context use past L", "", "No paired records: score each model with full attention and with "
                "`--methods window_global` (or `window`) in one study; the measure is formed from per-document "
                "sums of the same targets, never from two runs' overall losses.", ""]
    runs = runs.drop(columns="results")
    return report.paired_markdown(pd.concat([runs, report.aggregate_seeds(runs)], ignore_index=True))


# A model's own window: the L keys around each query plus its row's [CLS] and [SEP], what it trained with.
OWN_WINDOW = "window_global"
DEFAULT_TRADE_MULTIPLE = 8


def trade(records: pd.DataFrame, baseline: str) -> pd.DataFrame:
    """Local skill against context use past L: one row per (dataset, model, multiple) past 1x, with `cost`, the
    model's chunked 1x loss minus `baseline`'s at the same seed (mean over the seeds both have), and `use`, its chunked
    loss with full attention minus with its own window (`OWN_WINDOW`) at that multiple (mean over seeds; negative:
    the keys past L help). `use` comes from the study's paired records where it wrote them, with their interval over
    documents (seeds pooled); else from each seed's two overall losses, `model` and `model+window_global` of the same
    run, which are scored on the same chunks and so give the same mean, but no interval (`paired` False)."""
    chunked = records[records["protocol"] == "chunked"]
    # Sorted indexes: lookups in an unsorted MultiIndex can miss keys it holds.
    loss = chunked[chunked["metric"] == "loss"].set_index(["dataset", "model", "multiple", "seed"]).sort_index()
    one_x = loss["value"].xs(1.0, level="multiple")
    paired_rows = chunked[chunked["metric"] == report.CONTEXT_USE + OWN_WINDOW].drop(columns="results")
    pooled = report.aggregate_seeds(paired_rows).set_index(["dataset", "model", "multiple"]).sort_index() if len(
        paired_rows) else None
    rows = []
    for (dataset, model), seeds in one_x.groupby(level=["dataset", "model"]):
        if "+" in model or (dataset, baseline) not in one_x.droplevel("seed").index:
            continue  # a length method's row (read beside its model), or no baseline on this text
        base = one_x.xs((dataset, baseline))
        common = [seed for seed in seeds.index.get_level_values("seed") if seed in base.index]
        cost = float(np.mean([seeds[(dataset, model, seed)] - base[seed] for seed in common])) if common else np.nan
        multiples = sorted(m for m in loss.xs((dataset, model)).index.get_level_values("multiple").unique() if m > 1)
        for multiple in multiples:
            if pooled is not None and (dataset, model, multiple) in pooled.index:
                row = pooled.loc[(dataset, model, multiple)]
                use, low, high, paired = row["value"], row["ci_low"], row["ci_high"], True
            else:
                use, low, high, paired = _same_run_difference(loss, dataset, model, multiple), np.nan, np.nan, False
            if not np.isnan(use):
                rows.append(dict(dataset=dataset, model=model, multiple=multiple, cost=cost, use=use, low=low,
                                 high=high, paired=paired, seeds=len(seeds)))
    return pd.DataFrame(rows, columns=["dataset", "model", "multiple", "cost", "use", "low", "high", "paired",
                                       "seeds"])


def _same_run_difference(loss: pd.DataFrame, dataset: str, model: str, multiple: float) -> float:
    """Mean over seeds of `model`'s chunked loss minus `model+OWN_WINDOW`'s, each seed from one run (NaN where the
    window was not scored). Records of one seed from two different runs are refused: their chunks would be the same
    but the models not."""
    window = f"{model}+{OWN_WINDOW}"
    if (dataset, window, multiple) not in loss.droplevel("seed").index:
        return np.nan
    full, own = loss.loc[(dataset, model, multiple)], loss.loc[(dataset, window, multiple)]
    seeds = [seed for seed in full.index if seed in own.index]
    for seed in seeds:
        if full.loc[seed, "source"] != own.loc[seed, "source"]:
            raise ValueError(f"{model} and {window} at seed {seed} come from different runs ({full.loc[seed, 'source']}"
                             f", {own.loc[seed, 'source']}): context use is one run's loss with and without its window")
    return float(np.mean([full.loc[seed, "value"] - own.loc[seed, "value"] for seed in seeds])) if seeds else np.nan


def trade_markdown(table: pd.DataFrame, baseline: str) -> list[str]:
    """The trade as a table: one row per (dataset, model), its 1x cost, and its context use at every multiple."""
    if table.empty:
        return []
    cells = table.assign(cell=[f"{u:+.3f}" + ("" if np.isnan(lo) else f" [{lo:+.3f}, {hi:+.3f}]")
                               + ("" if paired else " *") for u, lo, hi, paired
                               in zip(table["use"], table["low"], table["high"], table["paired"])])
    wide = cells.pivot_table(index=["dataset", "model", "seeds", "cost"], columns="multiple", values="cell",
                             aggfunc="first").fillna("–")
    wide.columns = [f"{m:g}x" for m in wide.columns]
    wide = wide.reset_index().sort_values(["dataset", "cost"])
    wide["cost"] = wide["cost"].map(lambda v: f"{v:+.3f}")
    wide = wide.rename(columns={"cost": f"1x vs {baseline}"})
    return ["## Local skill against context use past L", "",
            f"Per model (mean of its seeds), its 1x loss minus {baseline}'s at the same seed, and its chunked loss "
            f"with full attention minus with its own window of L (`{OWN_WINDOW}`) on the same chunks at each multiple "
            "(negative: the keys past L help), with the 95% interval over documents, seeds pooled. `*`: the study "
            "kept no per-document sums for this model; the same run's two overall losses give the mean, without an "
            "interval. trade.png plots the two against each other.", "", report.markdown_table(wide), ""]


def trade_multiples(table: pd.DataFrame, asked: list[int]) -> list[float]:
    """The multiples trade.png shows: those asked for, or 8x and the longest scored; a multiple no model was scored
    at is refused, naming the ones there are."""
    scored = sorted(table["multiple"].unique())
    if not asked:
        return sorted({m for m in (DEFAULT_TRADE_MULTIPLE, scored[-1]) if m in scored})
    missing = [m for m in asked if float(m) not in scored]
    if missing:
        raise ValueError(f"--trade_at: no context use at {missing}x; the models were scored at "
                         f"{', '.join(f'{m:g}x' for m in scored)}")
    return [float(m) for m in asked]


# trade.png's context-use ticks: hundredths near zero, where recipes differ, and coarser beyond.
TRADE_TICKS = (-0.5, -0.2, -0.1, -0.05, -0.02, 0.0, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


def short_names(models: list[str]) -> list[str]:
    """The models' labels without the words all of them share at either end (`deberta-emd-`, `-L64`); a label
    those words make up whole keeps its name."""
    parts = [m.split("-") for m in models]
    if len(parts) < 2:
        return list(models)
    head = len(os.path.commonprefix(parts))
    tail = len(os.path.commonprefix([p[::-1] for p in parts]))
    return ["-".join(p[head:len(p) - tail]) or m for p, m in zip(parts, models)]


def plot_trade(table: pd.DataFrame, multiples: list[float], baseline: str, path: str) -> None:
    """One panel per (dataset, multiple): each model's 1x cost (x) against its context use there (y), with the
    interval over documents where there is one; hollow markers have none."""
    datasets = sorted(table["dataset"].unique())
    fig, axes = plt.subplots(len(datasets), len(multiples), figsize=(6 * len(multiples), 4.5 * len(datasets)),
                             squeeze=False)
    models = sorted(table["model"].unique())
    colours = {model: f"C{i % 10}" for i, model in enumerate(models)}
    names = dict(zip(models, short_names(models)))
    for ax_row, dataset in zip(axes, datasets):
        for ax, multiple in zip(ax_row, multiples):
            rows = table[(table["dataset"] == dataset) & (table["multiple"] == multiple)]
            for _, r in rows.iterrows():
                error = None if np.isnan(r["low"]) else [[r["use"] - r["low"]], [r["high"] - r["use"]]]
                ax.errorbar(r["cost"], r["use"], yerr=error, marker="o", color=colours[r["model"]], capsize=3,
                            markerfacecolor=colours[r["model"]] if r["paired"] else "none", label=r["model"])
                ax.annotate(names[r["model"]], (r["cost"], r["use"]), fontsize=7, xytext=(4, 3),
                            textcoords="offset points")
            # Linear near zero, where the recipes differ by hundredths, logarithmic beyond (a plain model's +0.9).
            ax.set_yscale("symlog", linthresh=0.05)
            low, high = ax.get_ylim()
            shown = [t for t in TRADE_TICKS if low <= t <= high]
            ax.set_yticks(shown, [f"{t:+g}" if t else "0" for t in shown])
            ax.minorticks_off()
            ax.xaxis.set_major_locator(ticker.MaxNLocator(6))
            ax.axhline(0, color="grey", lw=0.8)
            ax.axvline(0, color="grey", lw=0.8)
            ax.set(xlabel=f"1x loss minus {baseline}'s (nats)", title=f"{dataset}, {multiple:g}x",
                   ylabel=f"full attention minus {OWN_WINDOW} (nats)")
            ax.grid(alpha=0.3)
    fig.tight_layout()
    report.save_png(fig, path, dpi=120)
    plt.close(fig)


def markdown(rises: pd.DataFrame, fixed: pd.DataFrame, flat_within: float, paired: list[str] = ()) -> str:
    lines = [*paired, "## Chunked loss: 1x and the rise past it, per seed and mean", ""]
    cells = rises.copy()
    for column in cells.columns:
        signed = column != "1x"  # differences carry their sign
        cells[column] = cells[column].map(lambda v, signed=signed: f"{v:+.3f}" if signed else f"{v:.3f}")
    lines.append(report.markdown_table(cells.reset_index()))
    if fixed.empty:
        none = "No fixed-target records (eval.py --protocols centred_target) to compare."
        return "\n".join([*lines, "", none]) + "\n"
    table = fixed.copy()
    table.columns = [str(c) for c in table.columns]
    table = table.map(lambda v: "" if pd.isna(v) else f"{v:.3f}")
    table["longest - L"] = verdicts(fixed, flat_within)
    lines += ["", f"## The same targets in windows of every length (mean of seeds; flat within {flat_within} nats)",
              "", "`centred_target`: spans at the centre of each window, inside their document (the paired change "
              "from L, with its interval, is under context gain above); `fixed_target`: the retired protocol, spans "
              "L/2 into each window, across documents.", "", report.markdown_table(table.reset_index())]
    return "\n".join(lines) + "\n"


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.results or not FLAGS.models:
        raise app.UsageError("give --results (one or more) and --models")
    if FLAGS.out is not None:
        errors.check_location("--out", FLAGS.out)
    models = FLAGS.models + ([FLAGS.baseline] if FLAGS.baseline and FLAGS.baseline not in FLAGS.models else [])
    records = load(FLAGS.results, models, FLAGS.policy)
    rises, fixed = chunked_rises(records, FLAGS.baseline), fixed_targets(records)
    traded = trade(records, FLAGS.baseline) if FLAGS.baseline else pd.DataFrame()
    try:
        asked = [int(m) for m in FLAGS.trade_at]
    except ValueError:
        raise app.UsageError(f"--trade_at takes integers, got {FLAGS.trade_at}") from None
    shown = trade_multiples(traded, asked) if not traded.empty else []
    text = markdown(rises, fixed, FLAGS.flat_within, [*trade_markdown(traded, FLAGS.baseline), *paired(records)])
    print(text)
    if FLAGS.out:
        storage.write_text(os.path.join(FLAGS.out, "compare.md"), text)
        if not fixed.empty:
            plot(fixed, os.path.join(FLAGS.out, "fixed_targets.png"))
        if shown:
            plot_trade(traded, shown, FLAGS.baseline, os.path.join(FLAGS.out, "trade.png"))


if __name__ == "__main__":
    from deberta_jax.data import errors

    define_flags()
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.study.compare"))
