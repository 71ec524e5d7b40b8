"""The learned attention temperature of trained runs, read out: each layer's and head's parameter, and the factor it
puts on every score of a query that sees n keys, at the lengths asked for (`model.positions.learned_temperature`).

    python -m deberta_jax.study.temperatures --lengths 64,512,2048 \
        --workdir runs/natural/deberta-emd-learned-long512-mixed-L64-s0

What Scalable-Softmax's slope (`attention_temperature="learned"`, `s_h * log(n)`) can and cannot say: the factor's
growth with the number of keys is fixed by its form, `log(n) / log(L)` from L to n keys whatever `s_h` is (1.83 from
64 to 2,048 keys); the slope only scales every score of its head alike, which the query and key projections can do
as well. So a trained slope says how far a run scaled its scores overall (a fresh slope is `1 / log(L)`, a factor of
1 at the training length), not how steeply it learned to sharpen them with length. The rate form
(`"learned_rate"`, `1 + r_h * log(n / L)`) learns that growth itself: its factor at L keys is 1 whatever `r_h` is.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from absl import app, flags

from deberta_jax import storage
from deberta_jax.data import errors, library_logs
from deberta_jax.model import positions
from deberta_jax.model.config import LEARNED_TEMPERATURES
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.study import report
from deberta_jax.train import checkpoint

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a program (train.py's --workdir must not clash)."""
    flags.DEFINE_multi_string("workdir", [], "A training workdir whose model learned its temperature; repeat for more.")
    errors.list_flag("lengths", ["64", "2048"], "Key counts n at which to give each head's factor.")


def slopes(model: MaskedLM) -> np.ndarray:
    """`[layers, heads]`: each attention layer's learned parameter per head. Raises ValueError for a model without."""
    if model.cfg.attention_temperature not in LEARNED_TEMPERATURES:
        raise ValueError(f"model.attention_temperature={model.cfg.attention_temperature!r}: no learned temperature to "
                         f"read (only runs trained with attention_temperature in {LEARNED_TEMPERATURES} have one)")
    return np.stack([np.asarray(layer.attention.temperature_slope[...]) for layer in model.encoder.layers])


def table(models: dict[str, MaskedLM], lengths: list[int]) -> str:
    """A markdown row per run and layer: its form, its heads' parameters, and the factor at each length (mean of the
    heads, with their range)."""
    rows = []
    for name, model in models.items():
        cfg = model.cfg
        for layer, heads in enumerate(slopes(model)):
            factors = [positions.learned_temperature(cfg.attention_temperature, heads, np.log(n),
                                                     cfg.effective_trained_length) for n in lengths]
            rows.append([name, cfg.attention_temperature, layer, ", ".join(f"{s:.4f}" for s in heads),
                         *(f"{f.mean():.2f} ({f.min():.2f}-{f.max():.2f})" for f in factors)])
    columns = ["run", "form", "layer", "parameter per head", *(f"factor at {n} keys" for n in lengths)]
    return report.markdown_table(pd.DataFrame(rows, columns=columns))


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.workdir:
        raise app.UsageError("give at least one --workdir")
    try:
        lengths = [int(n) for n in FLAGS.lengths]
    except ValueError:
        raise ValueError(f"--lengths={','.join(FLAGS.lengths)}: give whole numbers of keys, e.g. 64,2048") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths={','.join(FLAGS.lengths)}: give key counts of 1 or more")
    library_logs.quiet()
    models = {}
    for workdir in FLAGS.workdir:
        _, model, _ = checkpoint.load_workdir(workdir)
        try:
            slopes(model)
        except ValueError as err:  # named here, before any row is printed
            raise ValueError(f"--workdir {workdir}: {err}") from None
        models[storage.path(workdir).name] = model
    print(table(models, lengths))


if __name__ == "__main__":
    define_flags()
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.study.temperatures"))
