"""Length-extrapolation evaluation of trained workdirs and transformers checkpoints.

  python eval.py --workdir runs/bert-tiny --workdir runs/deberta-tiny \
      --data_files corpus/valid.txt --data_files corpus/test.txt \
      --out results/len

Each model is scored at multiples of its own training length L (1x, 2x, 4x, 8x) plus L+16 and L+64
(or `--lengths`), under the chunked and centred-target protocols, with identical targets for every model.
Models with a learned absolute table get one set of rows per `--policies` entry (positions past L);
combinations a policy refuses are listed under "Not evaluated" rather than given a value.

Workdirs, checkpoints, data files and --out may be in a bucket (`gs://bucket/...`), as on a TPU pod's hosts.

Writes to --out: results.json.gz (every record, long format, with each workdir's checkpoint step;
`report.load_results` reads it), summary.md (also printed), and PNG plots (an earlier evaluation's plots there that
this one does not redraw are removed). Progress goes to stderr: one bar on a terminal, a line per model, policy,
dataset and length otherwise; the checkpoint libraries' INFO records are left out.
Runs whose configs differ only in seed share a label; their mean and 95% interval are reported. Every record says
what it is (the run's folder, checkpoint step, config fingerprint, seed and length method), and only runs of one
model, at one step, with seeds of their own are averaged: folders given twice, sharing a label without being seeds
of one model (`length_study.check_labels`), at different steps, or a folder named like another model under a length
method, are refused (`report.check_seed_groups`), as are policies, protocols or methods given twice.

Several processes (--multiprocess, or JAX_COORDINATOR_ADDRESS set as for train.py) split the windows
between them and add their sums, so the records are those of a single process; process 0 writes them.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn

import jax
from absl import app, flags

from deberta_jax import storage
from deberta_jax.data import errors, library_logs, packing
from deberta_jax.data.synthetic import is_synthetic_spec
from deberta_jax.data.text import is_hf_spec, load_documents
from deberta_jax.model.config import ABSOLUTE_POSITION_POLICIES, ATTENTION_KERNELS
from deberta_jax.storage import deadlines
from deberta_jax.study import length_study, protocols, report
from deberta_jax.train import checkpoint, sharding

FLAGS = flags.FLAGS
_DEFAULTS = length_study.StudySettings()  # every study default is defined there, once
_csv = lambda values: [str(v) for v in values]  # noqa: E731
flags.DEFINE_multi_string("workdir", [], "Training workdir(s) to evaluate, local or gs://bucket/... (config, "
                          "tokenizer and checkpoint are read there).")
flags.DEFINE_multi_string("hf_checkpoint", [], "transformers save_pretrained directories to evaluate, local or "
                          "gs://bucket/...: "
                          "model.safetensors and config.json, with tokenizer.json or, as published checkpoints ship "
                          "it, DeBERTa's spm.model or BERT's vocab.txt (converted by transformers).")
flags.DEFINE_integer("hf_trained_length", None, "The training length (tokens) of the --hf_checkpoint models that do "
                     "not record theirs (published checkpoints; this project's exports record it): what 1x is. "
                     "Default: each checkpoint's max_position_embeddings; summary.md states the length assumed.",
                     lower_bound=1)
deadlines.define_flag()
flags.DEFINE_string("checkpoint", "latest",
                    "Which checkpoint of each workdir: 'latest', 'best' (lowest eval loss) or a step.")
flags.DEFINE_multi_string("data_files", [], "Eval text: files, local or gs://bucket/... (comma-separated/globs), "
                          "hf:NAME[:CONFIG][:SPLIT] or synthetic:TASK[:SPLIT][:PARAMS]; repeat for several datasets.")
flags.DEFINE_string("out", None, "Output directory: a local folder or gs://bucket/...")
errors.list_flag("lengths", _csv(_DEFAULTS.lengths),
                  "Explicit eval lengths (tokens incl. [CLS]/[SEP]); default: multiples of each model's L.")
errors.list_flag("multiples", _csv(_DEFAULTS.multiples), "Multiples of the training length L.")
errors.list_flag("extra", _csv(_DEFAULTS.extra), "Also evaluate at L + each of these.")
errors.list_flag("policies", _csv(_DEFAULTS.policies),
                  f"Out-of-range policies for learned absolute tables (BERT input table, DeBERTa EMD table), "
                  f"of {ABSOLUTE_POSITION_POLICIES}.")
errors.list_flag("methods", _csv(_DEFAULTS.methods),
                  f"Also score every trained model past its training length under each of these, of "
                  f"{tuple(length_study.LENGTH_METHODS)} (labelled <model>+<method>): log_length scales each query's "
                  "scores by log(keys seen) / log(L), window attends to the L positions around each query, "
                  "window_global also to each row's [CLS] and closing [SEP], interpolate_distances multiplies "
                  "relative distances by L / N.")
errors.list_flag("protocols", _csv(_DEFAULTS.protocols), f"Protocols, of {tuple(protocols.PROTOCOLS)}.")
flags.DEFINE_integer("mask_seed", _DEFAULTS.mask_seed, "Seed of the fixed per-position targets (shared by all models).")
flags.DEFINE_integer("tokens_per_batch", _DEFAULTS.tokens_per_batch,
                     "Batch size in tokens; rows per batch = this // length.")
flags.DEFINE_integer("max_eval_tokens", _DEFAULTS.max_eval_tokens,
                     "Use only the first this many tokens of each eval text (0 = all).")
flags.DEFINE_integer("num_spans", _DEFAULTS.num_spans, "Centred-target protocol: at most this many target spans "
                     "(fewer where the text has less room).")
flags.DEFINE_integer("span", _DEFAULTS.span, "Centred-target protocol: span length in tokens (0 = L // 2).")
flags.DEFINE_integer("bootstrap", _DEFAULTS.bootstrap, "Bootstrap resamples over documents for the 95% intervals.")
flags.DEFINE_enum("attention_kernel", None, list(ATTENTION_KERNELS),
                  "Attention kernel of every model (default: each model's own): 'blockwise' keeps memory linear in "
                  "length (same results to float rounding), for lengths whose dense [B, H, N, N] scores do not fit; "
                  "'pallas' is blockwise fused into one GPU kernel, 'pallas_tpu' attention fused for TPUs (every "
                  "variant and length method); both run in interpret mode, slowly, on other "
                  "machines.")
flags.DEFINE_integer("attention_block_size", None,
                     "Keys per block of the blockwise kernel (default: each model's own).")
flags.DEFINE_bool("unigram", True,
                  "Also score a unigram-frequency floor (counts from the first workdir's training files).")
flags.DEFINE_bool("oracle", True, "Also score the Bayes-optimal oracle of every synthetic dataset (with the first "
                  "model's tokenizer and training length).")
flags.DEFINE_bool("multiprocess", False, "Call jax.distributed.initialize() and split the scoring over the processes.")
flags.mark_flag_as_required("out")


def dataset_name(spec: str) -> str:
    """`corpora/brown/valid.txt` -> `brown/valid`; hub and synthetic specs are kept as given."""
    if is_hf_spec(spec) or is_synthetic_spec(spec):
        return spec
    first = spec.split(",")[0]
    return f"{os.path.basename(os.path.dirname(first))}/{os.path.splitext(os.path.basename(first))[0]}"


def load_models(workdirs, checkpoints, step, hf_trained_length=None, notes=None,
                **overrides) -> list[length_study.EvalModel]:
    """Trained workdirs and transformers checkpoints (those that do not record their training length trained at
    `hf_trained_length`, said in `notes`); `overrides` replace ModelConfig fields (the kernel)."""
    return ([length_study.load_workdir_model(w, step, **overrides) for w in workdirs]
            + [length_study.load_hf_checkpoint(c, hf_trained_length, notes, **overrides) for c in checkpoints])


def usage_error(message: str) -> NoReturn:
    """Stops with `message` on one line: a problem with the command, not a bug, so no traceback and no help text
    (`--help` lists the flags)."""
    sys.exit(f"eval.py: {message}")


def dataset_specs(data_files: list[str]) -> dict[str, str]:
    """`{label: spec}` for every `--data_files`; two specs whose labels agree would share one row of every table,
    so they are refused, naming both."""
    specs = {}
    for spec in data_files:
        name = dataset_name(spec)
        if name in specs:
            usage_error(f"--data_files {specs[name]!r} and {spec!r} would both be reported as {name!r} (a file's name "
                        "and its folder's); give one of them another file or folder name")
        specs[name] = spec
    return specs


# Room the report needs at --out, probed before any scoring: a results file and plots take a few MiB.
REPORT_ROOM = 4 * 2**20


def check_writable(out: str) -> None:
    """Fails at start-up, not after the whole evaluation, when --out (a folder or `gs://bucket/...`) cannot be
    written."""
    try:
        storage.check_writable(out, "--out", room=REPORT_ROOM)
    except OSError as err:
        usage_error(str(err))


def _ints(flag: str) -> tuple[int, ...]:
    """A list flag's values as integers, or a usage error naming the flag."""
    try:
        return tuple(int(v) for v in FLAGS[flag].value)
    except ValueError:
        usage_error(f"--{flag} takes integers, got {FLAGS[flag].value}")


def main(argv):
    del argv
    library_logs.quiet()
    deadlines.set_limit(FLAGS.storage_deadline_s, "eval.py", f"--{deadlines.FLAG}")
    sharding.initialize_distributed(FLAGS.multiprocess)
    is_main = jax.process_index() == 0
    if not FLAGS.workdir and not FLAGS.hf_checkpoint:
        usage_error("give at least one --workdir or --hf_checkpoint")
    if not FLAGS.data_files:
        usage_error("give at least one --data_files, e.g. --data_files corpus/valid.txt or synthetic:markov:test")
    for flag in ("workdir", "hf_checkpoint", "out"):
        for value in FLAGS[flag].value if flag != "out" else [FLAGS.out]:
            errors.check_location(f"--{flag}", value)
    try:
        step = checkpoint.parse_step(FLAGS.checkpoint)
    except ValueError as err:
        usage_error(str(err))
    settings = length_study.StudySettings(
        multiples=_ints("multiples"), extra=_ints("extra"), lengths=_ints("lengths"), policies=tuple(FLAGS.policies),
        methods=tuple(FLAGS.methods), protocols=tuple(FLAGS.protocols), mask_seed=FLAGS.mask_seed,
        tokens_per_batch=FLAGS.tokens_per_batch, max_eval_tokens=FLAGS.max_eval_tokens, num_spans=FLAGS.num_spans,
        span=FLAGS.span, bootstrap=FLAGS.bootstrap)
    for length in settings.lengths:
        if not packing.MIN_SEQ_LEN <= length <= packing.MAX_SEQ_LEN:
            usage_error(f"--lengths={length} is out of range: each must be in [{packing.MIN_SEQ_LEN}, "
                        f"{packing.MAX_SEQ_LEN}] tokens, [CLS] and [SEP] included")
    if is_main:
        check_writable(FLAGS.out)
    specs = dataset_specs(FLAGS.data_files)
    datasets = {name: load_documents(spec) for name, spec in specs.items()}
    overrides = {name: FLAGS[name].value for name in ("attention_kernel", "attention_block_size")
                 if FLAGS[name].value is not None}
    length_study.check_labels(FLAGS.workdir, FLAGS.hf_checkpoint)
    warnings = []
    models = load_models(FLAGS.workdir, FLAGS.hf_checkpoint, step, FLAGS.hf_trained_length, warnings, **overrides)
    references = []
    if FLAGS.unigram and FLAGS.workdir:
        references.append(length_study.unigram_reference(models[0]))
    if FLAGS.oracle:
        references += length_study.oracle_references(models[0], specs)
    models += references
    records, skipped = length_study.run_study(models, datasets, settings, warnings=warnings)
    note = length_study.unpaired_note(
        (m.label, m.tokenizer.to_str()) for m in models if m.label not in report.REFERENCES)
    if not is_main:
        return
    _, summary, plots = report.write_report(records, skipped, FLAGS.out, notes=([note] if note else []) + warnings)
    print(summary)
    print("wrote", ", ".join([report.RESULTS_FILE, "summary.md"] + [os.path.basename(p) for p in plots]),
          "to", FLAGS.out)


if __name__ == "__main__":
    app.run(errors.reporting_user_errors(main, "eval.py", also=(checkpoint.DamagedCheckpointError,)))
