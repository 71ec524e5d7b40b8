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

Writes `compare.md` and `fixed_targets.png` into `--out`, and prints the markdown.
"""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")  # files only: no display on a training host
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from absl import app, flags  # noqa: E402

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
    flags.DEFINE_string("out", None, "Folder for compare.md and fixed_targets.png (local or gs://...).")


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
    text = markdown(rises, fixed, FLAGS.flat_within, paired(records))
    print(text)
    if FLAGS.out:
        storage.write_text(os.path.join(FLAGS.out, "compare.md"), text)
        if not fixed.empty:
            plot(fixed, os.path.join(FLAGS.out, "fixed_targets.png"))


if __name__ == "__main__":
    from deberta_jax.data import errors

    define_flags()
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.study.compare"))
