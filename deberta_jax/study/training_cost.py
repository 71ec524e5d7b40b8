"""What a training recipe costs: FLOPs per trained token of each run, by the train step's own arithmetic.

    python -m deberta_jax.study.training_cost --workdir runs/natural/deberta-emd-learned-long256-L64-s0 \
        --workdir runs/natural/deberta-emd-learned-mixed16-L64-s0

The length recipes (`deberta_jax.data.row_lengths`) change what a step computes and what it trains on: the long
phase computes rows 4x as long (the attention and relative-position products grow with the length, the rest does
not), and mixed row lengths compute full rows of which only `row_lengths.mean_row_length` tokens are real on
average. So a recipe's cost is its FLOPs over the tokens it trained on, not its steps. Each step is counted as the
compiled train step computes it on one device (`model.flops.model_flops` with the MLM head's static prediction
budget, `train.steps.step_prediction_budget`, which is the same whatever the rows hold; split over devices, it grows
by a few positions per device), and compared with the same run trained on full rows of its training length
throughout.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
from ml_collections import config_dict

from deberta_jax import storage
from deberta_jax.data import errors, row_lengths
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.flops import model_flops
from deberta_jax.train import checkpoint, steps

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command line's flags, defined only when run as a program (train.py's --workdir must not clash)."""
    flags.DEFINE_multi_string("workdir", [], "A training workdir (its config.json); repeat for more.")


@dataclasses.dataclass(frozen=True)
class Cost:
    flops: float  # the whole run's train steps
    tokens: float  # the real tokens it trained on (padding and cut-off cells excluded)

    @property
    def per_token(self) -> float:
        return self.flops / self.tokens


def run_cost(run: config_dict.ConfigDict) -> Cost:
    """The FLOPs and trained tokens of a run's config (the complete config a workdir records)."""
    model = ModelConfig.from_dict(run.model.to_dict())
    seq_len, rows, num_steps = run.data.seq_len, run.train.batch_size, run.train.num_steps
    accum = run.train.grad_accum_steps
    # Configs from before the length recipes lack their fields.
    long_count = row_lengths.long_step_count(run.train.get("long_steps", 0), run.train.get("long_share", 1.0))
    phases = [(seq_len, rows, num_steps - long_count)]
    if long_count:
        long_len = run.data.long_seq_len
        phases.append((long_len, row_lengths.long_batch_size(rows, seq_len, long_len), long_count))
    min_row = run.data.get("min_row_length", 0)
    flops = tokens = 0.0
    for length, batch, count in phases:
        budget = steps.step_prediction_budget(batch, length, run.data.mask_prob, accum)
        flops += count * model_flops(model, batch, length, budget, train=True)
        tokens += count * batch * row_lengths.mean_row_length(min_row, length)
    return Cost(flops, tokens)


def without_length_recipes(run: config_dict.ConfigDict) -> config_dict.ConfigDict:
    """`run` trained on full rows of its training length throughout: what its recipe is compared with."""
    plain = config_dict.ConfigDict(run.to_dict())
    plain.train.long_steps, plain.data.min_row_length = 0, 0
    return plain


def table(workdirs: list[str]) -> str:
    """A markdown row per workdir: trained tokens, FLOPs per trained token, and that over full rows of L."""
    lines = ["| run | trained tokens | FLOPs per trained token | vs full rows of L |", "|---|---:|---:|---:|"]
    for workdir in workdirs:
        run = checkpoint.read_config(workdir)
        cost, plain = run_cost(run), run_cost(without_length_recipes(run))
        lines.append(f"| {storage.path(workdir).name} | {cost.tokens:,.0f} | {cost.per_token:,.0f} | "
                     f"{cost.per_token / plain.per_token:.2f}x |")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if not FLAGS.workdir:
        raise app.UsageError("give at least one --workdir")
    print(table(FLAGS.workdir))


if __name__ == "__main__":
    define_flags()
    app.run(errors.reporting_user_errors(main, "deberta_jax.study.training_cost"))
