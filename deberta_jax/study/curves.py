"""Eval loss against training step for runs trained on the same batches: where each leaves the unigram plateau.

    python -m deberta_jax.study.curves --workdir bert=runs/bert --workdir deberta=runs/deberta \
        --out results/natural/curves

A masked LM first learns the unigram distribution (the loss of predicting every masked token from word
frequencies alone) and only later learns to use its context; how long it sits on that plateau depends on
how easily its position scheme lets attention find the neighbours. The floor is scored here on the same
targets as the runs' logged eval loss (the training-time evaluation is the chunked protocol at the training
length over all of `config.data.eval_files`), with counts from the first run's training files and tokenizer.
A run "leaves the plateau" at the first evaluation whose loss is `margin` nats below that floor.

Writes `curves.md` (a table of eval loss by step, the floor and each run's exit step), `curves.json` and
`eval_loss_vs_step.png`.
"""

from __future__ import annotations

import json
import os

import pandas as pd
from absl import app, flags

from deberta_jax import storage
from deberta_jax.data import errors, library_logs, packing
from deberta_jax.data.text import load_documents
from deberta_jax.study import length_study, report
from deberta_jax.train import checkpoint, config_checks, metrics_io

DEFAULT_MARGIN = 0.1


def eval_curve(workdir: str) -> dict[int, float]:
    """`{step: eval_loss}` of every evaluation a run logged."""
    return {r["step"]: r["eval_loss"] for r in metrics_io.read_metrics(workdir) if "eval_loss" in r}


def unigram_floor(workdir: str) -> float:
    """The unigram model's loss on the run's own eval targets (chunked protocol, training length, all tokens)."""
    config = checkpoint.read_config(workdir)
    reference = length_study.unigram_reference(length_study.load_workdir_model(workdir))
    settings = length_study.StudySettings(lengths=(int(config.data.seq_len),), protocols=("chunked",),
                                          max_eval_tokens=0, bootstrap=10)
    records, _ = length_study.run_study([reference], {"eval": load_documents(config.data.eval_files)}, settings)
    return next(r["value"] for r in records if r["metric"] == "loss" and r["bucket"] == "all")


def plateau_exit(curve: dict[int, float], floor: float, margin: float) -> int | None:
    """The first logged step whose eval loss is at least `margin` below `floor`, or None."""
    return next((step for step in sorted(curve) if curve[step] <= floor - margin), None)


def check_same_batches(workdirs: dict[str, str]) -> None:
    """Refuses runs whose data, seed or schedule differ: their curves would not be comparable step for step."""
    keys = ("seed", "data.train_files", "data.eval_files", "data.seq_len", "data.mask_prob", "train.batch_size",
            "train.num_steps", "train.learning_rate", "train.warmup_steps", "train.schedule")
    data_keys = ("data.train_files", "data.eval_files")

    def values(workdir):
        config = checkpoint.read_config(workdir)
        return {key: config_checks.get_field(config, key) for key in keys}

    def same(key, a, b):
        return packing.same_source(a, b) if key in data_keys else a == b

    first_label, first = next(iter(workdirs.items()))
    reference = values(first)
    for label, workdir in workdirs.items():
        differ = {k: (reference[k], v) for k, v in values(workdir).items() if not same(k, reference[k], v)}
        if differ:
            raise ValueError(f"{label} ({workdir}) was not trained like {first_label}: "
                             + ", ".join(f"config.{k} {a!r} vs {b!r}" for k, (a, b) in differ.items()))


def write_curves_report(workdirs: dict[str, str], out_dir: str, margin: float = DEFAULT_MARGIN) -> str:
    """Writes the table, JSON and plot for `{label: workdir}` to `out_dir` (a folder or `gs://bucket/...`); returns
    the Markdown."""
    if not margin > 0:  # at 0 or below, a run level with or above the floor would count as leaving the plateau
        raise ValueError(f"--margin={margin:g}: a run leaves the plateau only by going below the unigram floor; give "
                         f"a positive number of nats (default {DEFAULT_MARGIN:g})")
    check_same_batches(workdirs)
    first = next(iter(workdirs.values()))
    floor = unigram_floor(first)
    curves = {label: eval_curve(w) for label, w in workdirs.items()}
    exits = {label: plateau_exit(c, floor, margin) for label, c in curves.items()}
    storage.write_text(os.path.join(out_dir, "curves.json"), json.dumps(dict(
        unigram_floor=floor, margin=margin, exits=exits, workdirs=workdirs,
        curves={k: {str(s): v for s, v in c.items()} for k, c in curves.items()}), indent=1))
    config = checkpoint.read_config(first)
    lines = ["# Eval loss by training step", "",
             f"Same batches for every run (seed {config.seed}, {config.train.batch_size} x {config.data.seq_len} "
             f"tokens per step, {config.train.num_steps} steps); eval on `{config.data.eval_files}`. Unigram floor on "
             f"the same targets: **{floor:.3f}** nats. A run leaves the plateau at its first evaluation {margin:g} "
             "nats below it.",
             "", curve_tables(curves, floor, exits)]
    markdown = "\n".join(lines) + "\n"
    storage.write_text(os.path.join(out_dir, "curves.md"), markdown)
    plot_by_step(curves, [(floor, "--", "unigram floor"), (floor - margin, ":", f"floor - {margin:g} (plateau exit)")],
                 "eval masked-token loss (nats)", "Where each position scheme leaves the unigram plateau",
                 os.path.join(out_dir, "eval_loss_vs_step.png"))
    return markdown


def curve_tables(curves: dict[str, dict[int, float]], floor: float, exits: dict[str, int | None]) -> str:
    """Markdown: each run's plateau exit and final loss, then eval loss by step (a row per step any run logged)."""
    losses = pd.DataFrame(curves).sort_index()  # steps x runs, NaN where a run did not evaluate
    final = losses.ffill().iloc[-1]  # each run's last logged loss
    runs = pd.DataFrame({
        "run": losses.columns,
        "leaves the plateau at step": [exits[k] if exits[k] is not None else "not within the run" for k in losses],
        "final eval loss": [f"{v:.3f}" for v in final], "below the floor by": [f"{floor - v:.3f}" for v in final]})
    by_step = losses.map(lambda v: "–" if pd.isna(v) else f"{v:.3f}").rename_axis("step").reset_index()
    return report.markdown_table(runs) + "\n\n" + report.markdown_table(by_step)


def plot_by_step(lines: dict[str, dict[int, float]], levels: list[tuple[float, str, str | None]], ylabel: str,
                 title: str, path: str) -> None:
    """One line per `{label: {step: value}}` against training step, and a horizontal line per `(y, style, label)`
    of `levels`; written whole to `path` (a PNG, local or in a bucket)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, curve in lines.items():
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], label=label)
    for y, style, label in levels:
        ax.axhline(y, color="black" if style == "--" else "grey", linestyle=style, linewidth=1, label=label)
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    report.save_png(fig, path, dpi=120)
    plt.close(fig)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a program (train.py's --workdir must not clash)."""
    flags.DEFINE_multi_string("workdir", [], "LABEL=WORKDIR of a run; repeat. The first run's data gives the floor.")
    flags.DEFINE_string("out", None, "Output directory: a local folder or gs://bucket/...")
    flags.DEFINE_float("margin", DEFAULT_MARGIN,
                       "Nats (> 0) below the unigram floor that count as leaving the plateau.")


def main(argv):
    del argv
    library_logs.quiet()
    workdirs = {}
    for item in FLAGS.workdir:
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--workdir={item!r}: use LABEL=WORKDIR, e.g. --workdir bert=runs/bert")
        if label in workdirs:  # one curve per label: the first would be dropped without a word
            raise ValueError(f"--workdir {label}={workdirs[label]} and --workdir {item} share the label "
                                 f"{label!r}; give each run a label of its own")
        errors.check_location("--workdir", path)
        workdirs[label] = path
    if not workdirs or not FLAGS.out:
        raise ValueError("give at least one --workdir LABEL=WORKDIR and --out")
    errors.check_location("--out", FLAGS.out)
    print(write_curves_report(workdirs, FLAGS.out, FLAGS.margin))


if __name__ == "__main__":
    define_flags()
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.study.curves"))
