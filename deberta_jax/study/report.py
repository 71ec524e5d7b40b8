"""Evaluation results as pandas DataFrames: the results files, seed means, Markdown tables and plots.

Results are in long format, one row per model, seed, policy, protocol, dataset, train length, eval
length, offset, position bucket and metric, so every table or plot is a filter and a pivot. Every row also says
what scored it (`IDENTITY_FIELDS`: the run's folder, checkpoint step, config fingerprint and the length method).
Runs that differ only in seed share a `model` label; `aggregate_seeds` gives rows with `seed="mean"` holding the
mean over seeds and a 95% Student-t interval (or, for a single seed, that run's bootstrap interval over
documents), and refuses rows under one label that are not seeds of one model (`check_seed_groups`). Results are
stored once, in `results.json.gz` (gzip'd JSON: every record, the combinations not evaluated and the report's
warnings); `load_results` reads it back for one's own analysis, and
`python -m deberta_jax.study.report DIR` rebuilds DIR's summary.md and plots from it.

In a frame a missing interval (`ci_low`, `ci_high`) is NaN and a missing `offset` (chunked rows) or
`n_seeds` (rows of single runs) is <NA>; in the results file both are null.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import zlib
from collections.abc import Iterable, Sequence

import numpy as np
import pandas as pd
from absl import app, logging
from PIL import Image
from scipy import stats

from deberta_jax import storage
from deberta_jax.study import protocols

KEY_FIELDS = ("model", "policy", "protocol", "dataset", "train_len", "eval_len", "offset", "bucket", "metric")
FIELDS = ("model", "seed", "source", "step", "checkpoint", "config", "method", "policy", "protocol", "dataset",
          "train_len", "eval_len", "multiple", "offset", "bucket", "metric", "value", "ci_low", "ci_high", "n_tokens",
          "n_seeds")
# `seed` holds run seeds and labels ("mean", "-" for references); `step` the checkpoint step a workdir's model was
# loaded from (missing for references, transformers checkpoints and mean rows), `checkpoint` how it was chosen
# ("latest", "best" or the step asked for), `config` a fingerprint of what the run trained
# (`length_study.config_fingerprint`), `method` the length method scored ("none": as trained); results written
# before these three were recorded lack them. `bucket` is a position or "all".
_DTYPES = {"seed": object, "step": "Int64", "checkpoint": object, "config": object, "method": object,
           "train_len": "int64", "eval_len": "int64", "multiple": "float64", "offset": "Int64", "bucket": object,
           "value": "float64", "ci_low": "float64", "ci_high": "float64", "n_tokens": "int64", "n_seeds": "Int64"}
# What a record is (`length_study.EvalModel.identity`), besides its `model` label.
IDENTITY_FIELDS = ("seed", "source", "step", "checkpoint", "config", "method")
CONFIDENCE = 0.95
REFERENCES = ("unigram", "oracle")
RESULTS_FILE = "results.json.gz"
# Metrics the report derives from the runs' own records (`add_gap_closed`), rebuilt rather than read back.
DERIVED_METRICS = ("gap_closed",)
# The paired context-use measure (`length_study.context_use_records`): metric `context_use:<window method>`, the
# model's loss with full attention minus its loss with that window, on the same targets; its records carry the
# per-document sums (`PAIRED_COLUMNS`) that the interval over seeds resamples.
CONTEXT_USE = "context_use:"
# The other paired measure (`length_study.context_gain_records`): a model's loss of the same targets in a window of N
# minus in the window of its training length, for protocols that score the same targets at every length.
CONTEXT_GAIN = "context_gain"
PAIRED_COLUMNS = ("doc_diff", "doc_count")
# Resamples of the documents for an interval pooled over seeds (`length_study.StudySettings.bootstrap`'s default).
BOOTSTRAP_RESAMPLES = 1000


def records_frame(records: Iterable[dict] | pd.DataFrame) -> pd.DataFrame:
    """The records `run_study` returns (a list of dicts) as a frame with every column of `FIELDS` and
    one dtype per column; a frame is given its dtypes. Record lists are checked by `check_finite` first,
    since a NaN interval would otherwise read as "no interval"."""
    if isinstance(records, pd.DataFrame):
        frame = records
    else:
        records = list(records)
        check_finite(records)
        frame = pd.DataFrame.from_records(records)
    # Missing columns go last, so the key order of every row in the results file stays that of the records.
    frame = frame.reindex(columns=[*frame.columns, *(f for f in FIELDS if f not in frame.columns)])
    for column, dtype in _DTYPES.items():
        try:
            frame[column] = frame[column].astype(dtype)
        except (TypeError, ValueError) as err:
            raise ValueError(f"results column {column!r} cannot be read as {dtype} ({err}); every record needs "
                             f"a {column} as run_study writes it") from None
    for column in ("checkpoint", "config", "method"):  # missing in older results: None, as the results file has it
        frame[column] = frame[column].where(frame[column].notna(), None)
    return frame


def read_results_file(path: str | os.PathLike) -> dict:
    """The results file written by `eval.py` or the sweep (or the directory holding it), local or in a bucket:
    `{"records", "skipped", "notes"}`. Reads the uncompressed `results.json` of older reports too."""
    file = storage.path(path)
    if file.is_dir():
        file = next((file / name for name in (RESULTS_FILE, "results.json") if (file / name).is_file()),
                    file / RESULTS_FILE)
    if not file.is_file():
        raise FileNotFoundError(f"{file} not found: pass a {RESULTS_FILE} written by eval.py or the sweep, "
                                "or the directory holding it (eval.py's --out)")
    content = storage.read_bytes(file)
    try:
        data = json.loads(gzip.decompress(content) if file.name.endswith(".gz") else content)
    except (OSError, EOFError, zlib.error, ValueError) as err:  # gzip's BadGzipFile is an OSError
        raise ValueError(f"{file} cannot be read ({err}): it is damaged or was cut short; write it again with "
                         "eval.py or the sweep") from None
    if not isinstance(data, dict) or not isinstance(data.get("records"), list):
        raise ValueError(f"{file} is not a results file: it needs a 'records' list, as eval.py and the sweep write")
    return dict(records=data["records"], skipped=data.get("skipped", []), notes=data.get("notes", []))


def load_results(path: str | os.PathLike) -> pd.DataFrame:
    """The records of a results file written by `eval.py` or the sweep (the file, or the directory
    holding it) as a DataFrame: rows of single runs and the `seed == "mean"` rows, one column per field
    of `FIELDS`. For one's own analysis, e.g. loss against length, mean over seeds:

        from deberta_jax.study.report import load_results

        results = load_results("results/synthetic/markov")
        loss = results.query("seed == 'mean' and protocol == 'chunked' and bucket == 'all' and metric == 'loss'")
        print(loss.pivot_table(index=["model", "policy"], columns="multiple", values="value").round(3))

    The combinations that were not evaluated, with the reason, are the file's "skipped" list (`read_results_file`).
    """
    return records_frame(read_results_file(path)["records"])


def rebuild_report(out_dir: str) -> tuple[pd.DataFrame, str, list[str]]:
    """`write_report` again from `out_dir`'s results file: the runs' own records (not the means or the derived
    metrics, which are recomputed), the skipped combinations and the warnings; rewrites the results file,
    summary.md and the plots."""
    data = read_results_file(out_dir)
    frame = records_frame(data["records"])
    runs = frame[(frame["seed"].astype(str) != "mean") & ~frame["metric"].isin(DERIVED_METRICS)]
    return write_report(runs.reset_index(drop=True), data["skipped"], out_dir, notes=data["notes"])


def t_half_width(std: np.ndarray, n: np.ndarray, confidence: float = CONFIDENCE) -> np.ndarray:
    """Half-width of the two-sided Student-t interval for a mean of `n` values with sample std `std`."""
    n = np.asarray(n, dtype=np.float64)
    return stats.t.ppf(0.5 + confidence / 2, n - 1) * np.asarray(std) / np.sqrt(n)


def _run_name(run) -> str:
    """A run as messages name it: its folder, and the length method it was scored under."""
    method = run["method"]
    return f"{run['source']}" + (f" under the length method {method!r}" if _known(method) and method != "none" else "")


def _known(value) -> bool:
    return value is not None and not pd.isna(value)


def _not_seeds(a, b) -> str | None:
    """Why runs `a` and `b` (identity rows) are not two seeds of one model, with the fix; None when they are. A field
    a run lacks (results written before it was recorded) is taken to agree."""
    def differ(field):
        return _known(a[field]) and _known(b[field]) and a[field] != b[field]
    if differ("method"):
        return ("they are scored under different length methods (a model under one is labelled with its name and the "
                "method's); give the folder another name")
    if differ("config"):
        return (f"they were trained differently (config fingerprints {a['config']} vs {b['config']}): only runs that "
                "differ in seed share a label, so give one folder another name")
    if differ("checkpoint"):
        return (f"their checkpoints were chosen differently ({a['checkpoint']} vs {b['checkpoint']}); score them the "
                "same way")
    if differ("step") and a["checkpoint"] != "best":
        return (f"they are at different checkpoint steps ({a['step']} vs {b['step']}); score both at one step "
                "(eval.py --checkpoint N), or train the shorter run to its end")
    if a["seed"] == b["seed"]:
        return (f"both have seed {a['seed']}: one run given twice, or a repeated run, is not another seed; give only "
                "one of them")
    return None


def check_seed_groups(rows: Iterable[dict] | pd.DataFrame) -> None:
    """Refuses rows that `aggregate_seeds` would average as seeds of one model without their being so: under one
    label, on one dataset, every run must be the same model (config fingerprint, length method, checkpoint step,
    except where each run's best was chosen) with a seed of its own. `rows` need `model`, `dataset` and
    `IDENTITY_FIELDS` (records, or `EvalModel.identity` rows before scoring). Raises ValueError naming both runs
    and the fix."""
    frame = rows if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows), dtype=object)
    columns = ["model", "dataset", *IDENTITY_FIELDS]
    runs = frame.reindex(columns=columns).astype(object).drop_duplicates()
    for (label, dataset), group in runs.groupby(["model", "dataset"], sort=False, dropna=False):
        members = group.to_dict("records")
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                reason = _not_seeds(a, b)
                if reason:
                    where = f" on {dataset}" if _known(dataset) else ""
                    raise ValueError(f"{_run_name(a)} and {_run_name(b)} would both be reported as {label!r}{where}, "
                                     f"averaged as two seeds of one model, but {reason}")


def aggregate_seeds(records: Iterable[dict] | pd.DataFrame) -> pd.DataFrame:
    """Mean over seeds (and a Student-t interval at `CONFIDENCE`) for every key of `KEY_FIELDS`; one row per
    key, in the order the keys first appear. Other fields are the first run's; `source` lists every run's.
    Rows that are not seeds of one model (`check_seed_groups`), or one run's record twice, are refused."""
    frame = records_frame(records)
    check_seed_groups(frame)
    twice = frame[frame.duplicated([*KEY_FIELDS, "seed", "source"], keep=False)]
    if len(twice):
        r = twice.iloc[0]
        raise ValueError(f"{r['model']} (seed {r['seed']}, {r['source']}) has {len(twice)} records for one "
                         f"{r['metric']} ({r['protocol']}, policy {r['policy']}, length {r['eval_len']}, "
                         f"{r['dataset']}): one run scored twice would be averaged with itself as two seeds; score "
                         "each once")
    groups = frame.groupby(list(KEY_FIELDS), sort=False, dropna=False)
    n = groups["value"].transform("size").to_numpy()
    mean = groups["value"].transform("mean").to_numpy()
    several = n > 1  # a single run keeps its own bootstrap interval
    half = t_half_width(groups["value"].transform("std"), n)  # NaN for a single run
    sources = [";".join(sorted(map(str, s))) for s in groups["source"].unique()]
    merged = frame.assign(
        seed="mean", step=pd.NA, value=mean, n_tokens=groups["n_tokens"].transform("sum"), n_seeds=n,
        source=[sources[i] for i in groups.ngroup()],
        ci_low=np.where(several, mean - half, frame["ci_low"]),
        ci_high=np.where(several, mean + half, frame["ci_high"]))
    merged = merged.drop_duplicates(list(KEY_FIELDS)).reset_index(drop=True)
    if all(column in frame.columns for column in PAIRED_COLUMNS):
        # Context use over seeds: the documents resampled jointly (the same documents for every seed), not a
        # t-interval over two or three seeds' values.
        for key, rows in frame.groupby(list(KEY_FIELDS), sort=False, dropna=False):
            if len(rows) > 1 and rows["doc_diff"].map(lambda d: isinstance(d, list)).all():
                merged.loc[_same_key(merged, key), ["ci_low", "ci_high"]] = pooled_interval(rows)
        merged = merged.assign(doc_diff=None, doc_count=None)
    return records_frame(merged)


def _same_key(frame: pd.DataFrame, key: tuple) -> pd.Series:
    """Rows whose `KEY_FIELDS` equal `key`, missing values (a chunked record's offset) matching missing ones."""
    match = pd.Series(True, index=frame.index)
    for column, value in zip(KEY_FIELDS, key):
        match &= frame[column].isna() if pd.isna(value) else frame[column].astype(object).eq(value)
    return match


def pooled_interval(rows: pd.DataFrame) -> tuple[float | None, float | None]:
    """`CONFIDENCE` interval of the mean over seeds of a paired measure's value, resampling the documents jointly:
    each resample draws documents once and every seed's sums over them (`doc_diff` over `doc_count`) are averaged.
    Seeds scored on different documents are refused."""
    diffs = [np.asarray(d, np.float64) for d in rows["doc_diff"]]
    counts = [np.asarray(c, np.float64) for c in rows["doc_count"]]
    if len({len(d) for d in diffs}) != 1:
        raise ValueError(f"{rows['model'].iloc[0]}: its seeds' context use was measured on different documents "
                         f"({sorted({len(d) for d in diffs})}); score every seed on the same text")
    diff, count = np.stack(diffs), np.stack(counts)
    if np.count_nonzero(count.sum(axis=0)) < 2:
        return None, None
    draws = np.random.default_rng([0, diff.shape[1]]).integers(0, diff.shape[1],
                                                               size=(BOOTSTRAP_RESAMPLES, diff.shape[1]))
    stat = (diff[:, draws].sum(axis=2) / np.maximum(count[:, draws].sum(axis=2), 1)).mean(axis=0)
    tail = 50 * (1 - CONFIDENCE)
    lo, hi = np.percentile(stat, [tail, 100 - tail])
    return float(lo), float(hi)


def add_gap_closed(records: Iterable[dict] | pd.DataFrame) -> pd.DataFrame:
    """`records` and `gap_closed` rows: `(unigram loss - loss) / (unigram loss - oracle loss)` on the same targets.

    Where both references were scored (synthetic data), a loss reads as the share of the learnable gap a model
    closed: 0 at the context-free floor, 1 at the Bayes-optimal prediction from the same window.
    """
    frame = records_frame(records)
    key = ["protocol", "dataset", "train_len", "eval_len", "offset"]  # the same windows and targets
    overall = frame[(frame["metric"] == "loss") & (frame["bucket"] == "all")]
    refs = {name: overall.loc[overall["model"] == name, [*key, "value"]].drop_duplicates(key, keep="last")
            .rename(columns={"value": name}) for name in REFERENCES}
    models = overall[~overall["model"].isin(REFERENCES)]
    scored = models.merge(refs["unigram"], on=key).merge(refs["oracle"], on=key)
    scored = scored[scored["unigram"] > scored["oracle"]]
    gaps = scored.assign(metric="gap_closed", value=(scored["unigram"] - scored["value"])
                         / (scored["unigram"] - scored["oracle"]), ci_low=np.nan, ci_high=np.nan)
    return pd.concat([frame, gaps[frame.columns]], ignore_index=True)


def check_finite(records: Iterable[dict] | pd.DataFrame) -> None:
    """Refuse to write a result containing NaN or inf: a silent NaN is a wrong result.

    In records a missing interval is None, so any NaN is refused; in a frame NaN is how a missing
    interval is stored, so there only the value must be a number.
    """
    if isinstance(records, pd.DataFrame):
        bad = ~np.isfinite(records["value"]) | np.isinf(records["ci_low"]) | np.isinf(records["ci_high"])
        if bad.any():
            raise FloatingPointError(f"non-finite value or interval in record {records[bad].iloc[0].to_dict()}")
        return
    for r in records:
        for field in ("value", "ci_low", "ci_high"):
            v = r.get(field)
            if v is not None and not math.isfinite(v):
                raise FloatingPointError(f"non-finite {field} in record {r}")


def _json_rows(frame: pd.DataFrame) -> list[dict]:
    """Rows as plain Python records, None where a value is missing; rows of single runs carry no `n_seeds`, rows
    other than a run's context use no per-document sums."""
    rows = frame.astype(object).where(frame.notna(), None).to_dict("records")
    optional = ("n_seeds", *PAIRED_COLUMNS)
    return [{k: v for k, v in r.items() if k not in optional or v is not None} for r in rows]


def write_results(records: Iterable[dict] | pd.DataFrame, skipped: Sequence[dict], out_dir: str,
                  notes: Sequence[str] = ()) -> None:
    """`results.json.gz`: the records, the combinations not evaluated (with reasons) and the report's warnings,
    replacing the previous file only once written whole. Compressed with no name and a fixed timestamp, so the same
    results give the same bytes."""
    frame = records_frame(records)
    check_finite(frame)
    content = {"records": _json_rows(frame), "skipped": list(skipped), "notes": list(notes)}
    with storage.replacing(os.path.join(out_dir, RESULTS_FILE)) as tmp, open(tmp, "wb") as raw:
        with gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as f:
            f.write(json.dumps(content, separators=(",", ":")).encode())


def write_report(records: Iterable[dict] | pd.DataFrame, skipped: Sequence[dict], out_dir: str,
                 notes: Sequence[str] = ()) -> tuple[pd.DataFrame, str, list[str]]:
    """Per-seed records -> results files, `summary.md` (with `notes` and `floor_warnings` as warnings at its top,
    the latter also logged, and the checkpoint steps scored) and plots in `out_dir` (a folder or `gs://bucket/...`),
    each written whole (`storage.replacing`). Plots of an earlier report in `out_dir` that this one does not
    redraw are removed, so every plot there shows these results.

    Returns the mean-over-seeds rows, the summary's Markdown and the plot paths.
    """
    frame = add_gap_closed(records)
    means = aggregate_seeds(frame)
    floor = floor_warnings(means)
    for warning in floor:
        logging.warning("%s", warning)
    # A rebuilt report reads its floor warnings back with the notes: they are drawn anew (in this version's words).
    notes = list(dict.fromkeys([*(note for note in notes if FLOOR_WARNING not in note), *floor]))
    summary = markdown_summary(means, skipped, notes, checkpoint_steps(frame), runs=frame)
    # Every output, or none: a disk that fills on the last plot leaves the previous report whole.
    with storage.staged(out_dir, "the report (results file, summary.md, plots)",
                        "give another output folder") as staging:
        write_results(pd.concat([frame, means], ignore_index=True), skipped, staging, notes)
        with open(os.path.join(staging, "summary.md"), "w") as f:
            f.write(summary)
        plots = [os.path.join(out_dir, os.path.basename(p)) for p in plot_all(means, staging)]
    remove_stale_plots(out_dir, plots)
    return means, summary, plots


# Below the unigram floor by less than this (nats, at the upper end of its interval), a model has learned next to
# nothing from its context: 0.05 nats is a perplexity 5% under the floor's. A model that uses its context beats the
# floor by far more (0.2 nats for a BERT on Brown that never learned its positions, 1.5 on synthetic:markov),
# while an untrained or collapsed model sits within a few hundredths of it; and taking the interval's upper end
# keeps a few hundred noisy targets from counting as "clearly below".
FLOOR_MARGIN = 0.05
FLOOR_WARNING = "not clearly below the unigram floor"  # what every floor warning says, in every version


def floor_warnings(means: pd.DataFrame) -> list[str]:
    """A warning per dataset naming the models whose chunked loss at their shortest length scored (their training
    length, unless it was not scored) is not clearly below the unigram floor (`FLOOR_MARGIN`; under the best of a
    model's policies): such a model predicts little better than token frequencies, so its length curve is flat for
    want of anything to lose and says nothing about positions. The floor is context-free, so its loss at any one
    length stands for every length."""
    rows = means[(means["protocol"] == "chunked") & (means["bucket"] == "all") & (means["metric"] == "loss")]
    rows = rows.assign(upper=rows["ci_high"].fillna(rows["value"]), length=_length_labels(rows),
                       ratio=rows["eval_len"] / rows["train_len"])
    floors = rows[rows["model"] == "unigram"].sort_values("ratio", kind="stable").groupby("dataset")["value"].first()
    warnings = []
    for dataset, floor in floors.items():
        models = rows[(rows["dataset"] == dataset) & ~rows["model"].isin(REFERENCES)]
        shortest = models[models["ratio"] == models.groupby("model")["ratio"].transform("min")]
        best = shortest.sort_values("upper", kind="stable").drop_duplicates("model").sort_index()
        flat = best[best["upper"] > floor - FLOOR_MARGIN]
        if not len(flat):
            continue
        past = flat[flat["ratio"] != 1]
        named = [f"{m} ({v:.3f} at {n})" for m, v, n in zip(flat["model"], flat["value"], flat["length"])]
        warnings.append(
            f"{dataset}: {', '.join(named)} "
            f"{'is' if len(flat) == 1 else 'are'} {FLOOR_WARNING} ({floor:.3f}) (by {FLOOR_MARGIN} "
            "nats at the interval's upper end): such a model predicts little better than token frequencies, so its "
            "length curve says nothing about positions; train it longer"
            + (f". {', '.join(past['model'])} {'was' if len(past) == 1 else 'were'} not scored at the training length, "
               "where a rise past it cannot be told from a model that never learned: add 1 to the multiples"
               if len(past) else ""))
    return warnings


def checkpoint_steps(frame: pd.DataFrame) -> list[str]:
    """`label (seed s): step n` for every run loaded from a workdir's checkpoint, for the summary's header."""
    runs = frame[frame["step"].notna() & (frame["seed"].astype(str) != "mean")]
    runs = runs[["model", "seed", "step"]].drop_duplicates().sort_values(["model", "step"], kind="stable")
    return [f"{m} (seed {s}): step {n}" for m, s, n in runs.itertuples(index=False)]


PLOT_PATTERNS = ("loss_vs_length_*.png", "loss_by_position_*.png")  # the names `plot_all` writes


def remove_stale_plots(out_dir: str, written: Sequence[str]) -> list[str]:
    """Removes the plots in `out_dir` named as `plot_all` names them but not in `written` (those of an earlier
    report there, e.g. of another dataset); nothing else is touched. Returns the removed paths."""
    keep = {os.path.basename(p) for p in written}
    folder = storage.path(out_dir)
    stale = [p for pattern in PLOT_PATTERNS for p in folder.glob(pattern) if p.name not in keep]
    for p in stale:
        p.unlink()
    return [str(p) for p in stale]


def markdown_table(frame: pd.DataFrame) -> str:
    """`frame` as a GitHub Markdown table: its columns as the header, its rows as they are (cells formatted
    by the caller, written with `str`), the index left out."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    return "\n".join([line(frame.columns), "|" + "---|" * len(frame.columns),
                      *(line(row) for row in frame.itertuples(index=False))])


def _cells(frame: pd.DataFrame, digits: int | Sequence[int] = 3) -> list[str]:
    """Each row's value with its interval, `value [low, high]`, or the value alone where there is none."""
    digits = [digits] * len(frame) if isinstance(digits, int) else digits
    return [f"{v:.{d}f}" if math.isnan(lo) else f"{v:.{d}f} [{lo:.{d}f}, {hi:.{d}f}]"
            for v, lo, hi, d in zip(frame["value"], frame["ci_low"], frame["ci_high"], digits)]


def _grid(cells: pd.DataFrame, index: list[str], column: str | list[str], columns: Sequence,
          rows: pd.DataFrame | None = None) -> pd.DataFrame:
    """The `cell` column of `cells` laid out with one row per `index` value (sorted, or those of `rows`) and
    one column per entry of `columns` (values of `column`), "–" where there is none; `index` leads as columns."""
    keys = [column] if isinstance(column, str) else column
    wide = cells.drop_duplicates([*index, *keys], keep="last").pivot(index=index, columns=column, values="cell")
    if rows is not None:
        wide = wide.reindex(pd.MultiIndex.from_frame(rows[index]) if len(index) > 1 else pd.Index(rows[index[0]]))
    return wide.reindex(columns=list(columns)).astype(object).fillna("–").reset_index()


def is_paired(metric: pd.Series) -> pd.Series:
    """Which records are of a paired measure (they carry per-document sums)."""
    return metric.str.startswith(CONTEXT_USE) | (metric == CONTEXT_GAIN)


def paired_markdown(records: Iterable[dict] | pd.DataFrame, digits: int = 3) -> list[str]:
    """Markdown of the paired measures (`CONTEXT_USE`, `CONTEXT_GAIN`): per dataset, protocol and measure, one row
    per model, policy and seed (each run's bootstrap interval over documents; "mean": the documents resampled
    jointly over the seeds), one column per eval length, and the row's largest interval half-width: the smallest
    difference it resolves at the number of targets scored. Empty without such records."""
    frame = records_frame(records)
    paired = frame[is_paired(frame["metric"]) & (frame["bucket"] == "all")
                   & (frame["protocol"].map(protocols.layout_of) != "by_offset")]
    lines = []
    for (dataset, protocol, metric), rows in paired.groupby(["dataset", "protocol", "metric"], sort=True):
        per_seed = rows["n_tokens"] / (rows["n_seeds"].astype("float64").fillna(1) if "n_seeds" in rows else 1)
        rows = rows.assign(seed=rows["seed"].astype(str), label=_length_labels(rows), cell=_cells(rows, digits),
                           ratio=rows["eval_len"] / rows["train_len"], half=(rows["ci_high"] - rows["ci_low"]) / 2,
                           per_seed=per_seed)
        labels = rows.sort_values(["ratio", "label"])["label"].unique()
        index = ["model", "policy", "train_len", "seed"]
        order = rows[index].drop_duplicates().assign(last=lambda r: r["seed"] == "mean").sort_values(
            ["model", "policy", "train_len", "last", "seed"])
        table = _grid(rows, index, "label", labels, order).rename(columns={"train_len": "L"})
        widths = rows.groupby(index).agg(half=("half", "max"), targets=("per_seed", "max"))
        keys = [tuple(key) for key in order[index].itertuples(index=False)]
        table["resolves (nats)"] = [f"{widths['half'].get(key, float('nan')):.3f}" for key in keys]
        table["targets"] = [f"{widths['targets'].get(key, float('nan')):.0f}" for key in keys]
        if metric == CONTEXT_GAIN:
            title = f"## {dataset}: {protocol}, context gain: loss of the same targets at N minus at L"
            what = ("the targets' loss in the window of N minus in the window of L; negative: the wider context "
                    "makes the same targets easier.")
        else:
            method = metric[len(CONTEXT_USE):]
            title = f"## {dataset}: {protocol}, context use past L: loss with full attention minus with {method}"
            what = f"its loss with full attention minus with {method}; negative: the keys that {method} hides lower it."
        lines += [title, "", f"The same model on the same windows and targets, summed per document: {what} 95% "
                  "bootstrap interval over documents, paired (per seed; over seeds the documents resampled jointly). "
                  "`resolves`: the row's largest interval half-width, the smallest difference its target count "
                  "resolves; `targets`: targets scored per seed.", "", markdown_table(table), ""]
    return lines


def _length_labels(frame: pd.DataFrame) -> list[str]:
    """`2x` for a multiple of the training length, `L+16` otherwise."""
    return [f"{e // t}x" if e % t == 0 else f"L{e - t:+d}" for e, t in zip(frame["eval_len"], frame["train_len"])]


def markdown_summary(means: Iterable[dict] | pd.DataFrame, skipped: Sequence[dict], notes: Sequence[str] = (),
                     checkpoints: Sequence[str] = (), runs: Iterable[dict] | pd.DataFrame | None = None) -> str:
    """Per dataset, a table for every protocol in `means`, laid out as its registry entry says
    (`protocols.layout_of`): loss and accuracy by eval length, or loss by offset of the target span. `notes` are
    warnings at the top, `checkpoints` (`checkpoint_steps`) the steps scored; with the per-seed records `runs`, the
    paired measures per seed and over seeds (`paired_markdown`)."""
    means = records_frame(means)
    lines = ["# Length extrapolation", ""] + [f"> **Warning.** {note}\n" for note in notes] + [
             "Mean over seeds with 95% interval (t-interval over seeds; bootstrap over documents for one seed; "
             "none with fewer than two documents).",
             "Lengths are multiples of each model's training length L, or L plus a few tokens.", ""]
    if checkpoints:
        lines += [f"Checkpoints scored: {'; '.join(checkpoints)}.", ""]
    overall = means[means["bucket"] == "all"]
    for dataset in sorted(overall["dataset"].unique()):
        of_dataset = overall[overall["dataset"] == dataset]
        for protocol in _protocol_order(of_dataset["protocol"].unique()):
            rows = of_dataset[of_dataset["protocol"] == protocol]
            if protocols.layout_of(protocol) == "by_offset":
                lines += _by_offset(rows[rows["metric"] == "loss"], f"{dataset}: {protocol}")
            else:
                lines += _by_length(rows, f"{dataset}: {protocol}")
    if runs is not None:
        lines += paired_markdown(pd.concat([records_frame(runs), means], ignore_index=True))
    if skipped:
        lines += ["## Not evaluated", ""]
        reasons = (pd.DataFrame(list(skipped)).reindex(columns=["model", "policy", "eval_len", "reason"])
                   .drop_duplicates())
        # A length method that does not apply to a model is not scored at any length.
        lines += [f"- {s.model}: {s.reason}" if pd.isna(s.eval_len) else
                  f"- {s.model} / {s.policy} at length {s.eval_len}: {s.reason}" for s in reasons.itertuples()]
        lines.append("")
    return "\n".join(lines)


def _protocol_order(names) -> list[str]:
    """Registered protocols in registry order, then any others (results of a protocol since removed) by name."""
    return [p for p in protocols.PROTOCOLS if p in names] + sorted(set(names) - set(protocols.PROTOCOLS))


def _by_length(rows: pd.DataFrame, title: str) -> list[str]:
    """Loss and accuracy, one column per eval length (`2x`, `L+16`), one row per model, policy and L."""
    cells = rows.assign(label=_length_labels(rows), ratio=rows["eval_len"] / rows["train_len"], cell=_cells(rows))
    labels = cells[["ratio", "label"]].drop_duplicates().sort_values(["ratio", "label"])["label"].unique()
    index = ["model", "policy", "train_len"]
    order = rows[index].drop_duplicates().sort_values(index)
    lines = []
    for metric in ("loss", "accuracy"):
        table = _grid(cells[cells["metric"] == metric], index, "label", labels, order)
        table = table.rename(columns={"train_len": "L"})
        lines += [f"## {title}, masked-token {metric}", "", markdown_table(table), ""]
    return lines


def _by_offset(rows: pd.DataFrame, title: str) -> list[str]:
    """Loss, one column per offset of the target span, one row per model, policy and eval length."""
    offsets = sorted(rows["offset"].unique())
    table = _grid(rows.assign(cell=_cells(rows)), ["model", "policy", "eval_len"], "offset", offsets)
    table.columns = ["model", "policy", "eval length", *(f"offset {o}" for o in offsets)]
    return [f"## {title}, loss by offset of the target span", "", markdown_table(table), ""]


def ablation_table(means: Iterable[dict] | pd.DataFrame, policy: str, multiples: Sequence[int]) -> str:
    """One row per variant: chunked loss and accuracy at each multiple of L the study scored, per dataset,
    and the loss change from 1x to the largest multiple (mean over seeds of each run's own change, so the
    interval is the paired one).

    Models with a learned absolute table are shown under `policy` (the other policies are in
    summary.md); relative models have the single policy "none".
    """
    means, longest = records_frame(means), max(multiples)
    rows = means[(means["protocol"] == "chunked") & (means["bucket"] == "all") & means["policy"].isin([policy, "none"])
                 & means["metric"].isin(["loss", "accuracy", "loss_change_vs_1x", "gap_closed"])]
    rows = rows.assign(ratio=rows["eval_len"] / rows["train_len"],
                       cell=_cells(rows, np.where(rows["metric"] == "gap_closed", 2, 3)))
    lines = []
    for dataset in sorted(rows["dataset"].unique()):
        sel = rows[rows["dataset"] == dataset]
        gap_lens = sel.loc[sel["metric"] == "gap_closed", "eval_len"]
        gaps = [m for m in (1, longest) if (gap_lens == sel["train_len"].iloc[0] * m).any()]
        wanted = ([("loss", float(m)) for m in multiples] + [("accuracy", float(m)) for m in multiples]
                  + [("loss_change_vs_1x", float(longest))] + [("gap_closed", float(m)) for m in gaps])
        order = sorted(sel["model"].unique(), key=lambda m: (m in REFERENCES, m))
        table = _grid(sel, ["model"], ["metric", "ratio"], wanted, pd.DataFrame({"model": order}))
        table.columns = ["variant", *(f"loss {m}x" for m in multiples), *(f"acc {m}x" for m in multiples),
                         f"loss {longest}x - 1x", *(f"gap closed {m}x" for m in gaps)]
        seeds = sel.groupby("model")["n_seeds"].max().fillna(1).astype(int)
        table.insert(1, "seeds", [seeds[m] for m in order])
        lines += [f"### {dataset}: masked-token loss / accuracy (chunked; absolute tables: {policy})", "",
                  markdown_table(table), ""]
    return "\n".join(lines)


_POLICY_STYLES = {"none": "-", "clip": "-", "untrained": "--", "interpolate": ":", "strict": "-."}


def _model_policies(frame: pd.DataFrame) -> list[tuple[str, str]]:
    return sorted(set(zip(frame["model"], frame["policy"])))


def plot_all(means: Iterable[dict] | pd.DataFrame, out_dir: str) -> list[str]:
    """Loss vs eval/train length (log2 x, interval bands) and loss by position per eval length."""
    means = records_frame(means)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for dataset in sorted(means["dataset"].unique()):
        rows = means[(means["dataset"] == dataset) & (means["protocol"] == "chunked") & (means["metric"] == "loss")]
        overall = rows[rows["bucket"] == "all"]
        if overall.empty:
            continue
        fig, ax = plt.subplots(figsize=(9, 4.5))
        # One colour per model (tab20 has enough for a sweep), one line style per absolute-table policy.
        models = sorted(overall["model"].unique())
        colours = {m: plt.get_cmap("tab20" if len(models) > 10 else "tab10")(i) for i, m in enumerate(models)}
        for model, policy in _model_policies(overall):
            sel = overall[(overall["model"] == model) & (overall["policy"] == policy)]
            sel = sel.sort_values("eval_len", kind="stable")
            x = (sel["eval_len"] / sel["train_len"]).to_numpy()
            label = model if policy == "none" else f"{model} ({policy})"
            (line,) = ax.plot(x, sel["value"].to_numpy(), marker="o", label=label, color=colours[model],
                              linestyle=_POLICY_STYLES.get(policy, "-"))
            if sel["ci_low"].notna().all():
                ax.fill_between(x, sel["ci_low"].to_numpy(), sel["ci_high"].to_numpy(), color=line.get_color(),
                                alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.axvline(1.0, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("eval length / training length")
        ax.set_ylabel("masked-token loss (nats)")
        ax.set_title(f"Length extrapolation on {dataset} (chunked)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        fig.tight_layout()
        path = os.path.join(out_dir, f"loss_vs_length_{_slug(dataset)}.png")
        save_png(fig, path, dpi=120)
        plt.close(fig)
        written.append(path)

        by_position = rows[rows["bucket"] != "all"].astype({"bucket": "int64"})
        curves = _model_policies(by_position)
        if not curves:
            continue
        cols = min(len(curves), 4)
        nrows = -(-len(curves) // cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.6 * nrows), squeeze=False, sharey=True)
        for ax, (model, policy) in zip(axes.flat, curves):
            sel = by_position[(by_position["model"] == model) & (by_position["policy"] == policy)]
            for eval_len in sorted(sel["eval_len"].unique()):
                pts = sel[sel["eval_len"] == eval_len].sort_values("bucket", kind="stable")
                ax.plot((pts["bucket"] / pts["train_len"]).to_numpy(), pts["value"].to_numpy(), label=f"N={eval_len}")
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
        save_png(fig, path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def save_png(fig, path: str, dpi: int) -> None:
    """`fig` as a PNG at `path` (written whole, `storage.replacing`) in a palette of at most 256 colours: a plot's
    few line colours and their anti-aliased edges look the same, at about half the bytes of 8-bit RGBA (results/
    keeps every study's plots)."""
    rendered = io.BytesIO()
    fig.savefig(rendered, dpi=dpi, format="png")
    image = palette(Image.open(rendered))
    with storage.replacing(path) as tmp:
        image.save(tmp, format="png", optimize=True)


def palette(image: Image.Image) -> Image.Image:
    """`image` (a rendered plot, opaque) in at most 256 colours."""
    return image.convert("RGB").quantize(colors=256)


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in text).strip("_")


def main(argv: list[str]) -> None:
    """`python -m deberta_jax.study.report DIR [DIR ...]`: rebuild each report from its results file."""
    if len(argv) < 2:
        raise app.UsageError("give one or more folders holding a results file, e.g. results/natural")
    for out_dir in argv[1:]:
        _, _, plots = rebuild_report(out_dir)
        print(f"{out_dir}: rebuilt summary.md and {len(plots)} plots from {RESULTS_FILE}")


if __name__ == "__main__":
    from deberta_jax.data import errors

    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.study.report"))
