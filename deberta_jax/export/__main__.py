"""Export a trained workdir as a transformers checkpoint.

  python -m deberta_jax.export --workdir runs/deberta-tiny --out exported/deberta-tiny [--checkpoint best]

Writes config.json, model.safetensors, tokenizer.json and tokenizer_config.json, which
`transformers.AutoModelForMaskedLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)` read.
Models transformers cannot express (RoPE, ALiBi, T5 bias, EMD, sinusoidal or randomized positions, pre-LN,
an attention window or temperature) are refused with the config field named; a model whose logits agree with
transformers only up to some length is exported with a warning giving that length.
"""

from __future__ import annotations

import os
import warnings

from absl import app, flags, logging

from deberta_jax import storage
from deberta_jax.data import errors, library_logs
from deberta_jax.export import writer
from deberta_jax.model import hf
from deberta_jax.train import checkpoint

flags.DEFINE_string("workdir", None, "Training workdir to export (its config.json, tokenizer.json and checkpoints), "
                    "local or gs://bucket/...")
flags.DEFINE_string("out", None, "Directory to write, local or gs://bucket/...: new, empty, or an earlier export of "
                    "the same files.")
flags.DEFINE_string("checkpoint", "latest", "Which checkpoint: 'latest', 'best' (lowest eval loss) or a step.")
flags.mark_flags_as_required(["workdir", "out"])
FLAGS = flags.FLAGS


def main(argv):
    del argv
    library_logs.quiet()
    errors.check_location("--workdir", FLAGS.workdir)
    errors.check_location("--out", FLAGS.out)
    step = checkpoint.parse_step(FLAGS.checkpoint)
    with warnings.catch_warnings():  # the returned notes are logged below, without a source line
        warnings.simplefilter("ignore", hf.ExportWarning)
        notes = writer.export_workdir(FLAGS.workdir, FLAGS.out, step)
    for note in notes:
        logging.warning("%s", note)
    where = FLAGS.out if storage.is_remote(FLAGS.out) else os.path.abspath(FLAGS.out)
    print(f"wrote {', '.join(writer.EXPORTED_FILES)} to {where}; load them with "
          f"transformers.AutoModelForMaskedLM.from_pretrained(path) and AutoTokenizer.from_pretrained(path)")


if __name__ == "__main__":
    app.run(errors.reporting_user_errors(main, "python -m deberta_jax.export",
                                         also=(checkpoint.DamagedCheckpointError,)))
