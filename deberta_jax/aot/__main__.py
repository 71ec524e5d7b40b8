"""Does a config fit a TPU slice or a GPU node, how long is its step, what MFU should it reach? Compiled here, on
the CPU.

    pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"      # libtpu, once (TPU targets)
    pip install "jax[cuda12]==$(python -c 'import jax; print(jax.__version__)')"   # the CUDA plugin (GPU targets)
    python -m deberta_jax.aot --config configs/deberta.py:base --topology v5e:4x4 \\
        --config.model.dtype=bfloat16 --config.mesh.fsdp=16 [--config.* overrides]
    python -m deberta_jax.aot --config configs/deberta.py:base --topology h100:8 \\
        --config.model.dtype=bfloat16 --config.mesh.fsdp=8

`--topology` is a TPU slice (GENERATION:GRID: v5e:4x4, v5p:2x2x2) or GPU[:COUNT] GPUs of one node (h100, h200, a100;
h100:8 is an 8-GPU node, one process as train.py runs there). Compiles, for it, the train step and eval step
`train.py` builds from the config and the length study's forward at `--length_multiple` times the training length
with each of `--length_kernels` (as trained, and under each of `--length_methods`), then prints per program: memory
per chip (per GPU) against its capacity, FLOPs, bytes and collective traffic per chip, the count of gathers left in
the optimized HLO, a roofline step time with tokens/s and MFU, and the compile time (on GPU XLA gives no cost
analysis: FLOPs are the model's own, bytes are unknown and the roofline is compute and NVLink alone). A program that
does not fit gets the knobs that would shrink it. `--format markdown` prints the same figures as a table; `--out
FILE.json` writes them. Nothing runs on a TPU or GPU (jax runs on its CPU backend here, even on a machine that has
one) and no network address is contacted.
"""

from __future__ import annotations

# Before jax is first imported (below, through the package's modules; chips imports no jax): jax on its CPU
# backend, and the CUDA plugin loaded without a driver, so that GPU targets can be made. A user's values are kept.
from deberta_jax.aot import chips  # noqa: I001 - must run before the imports that load jax

chips.prepare_environment()

import json  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from deberta_jax import storage  # noqa: E402
from deberta_jax.aot import build, text  # noqa: E402
from deberta_jax.aot.chips import TopologyError  # noqa: E402
from deberta_jax.data import errors  # noqa: E402
from deberta_jax.train import config_checks  # noqa: E402

config_flags.DEFINE_config_file("config", None, "Experiment config, e.g. configs/deberta.py:base.", lock_config=True)
flags.DEFINE_string("topology", None, "TPU slice GENERATION:GRID, e.g. v5e:4x4, v6e:2x4, v5p:2x2x2, v4:2x2x4; or "
                    "GPU[:COUNT], COUNT GPUs of one node (1 to 8) of h100, h200, a100, e.g. h100 or h100:8.")
flags.DEFINE_integer("num_slices", 1, "TPU slices joined over the data-center network (multi-slice); data parallel "
                     "across them. GPU targets are one node.")
errors.list_flag("programs", list(build.PROGRAMS), f"Which programs to compile, of {list(build.PROGRAMS)}.")
flags.DEFINE_integer("length_multiple", 8, "The length study's forward is compiled at this multiple of "
                     "config.data.seq_len.")
errors.list_flag("length_kernels", None, "Attention kernels for the length forward (default: "
                  f"{','.join(build.LENGTH_KERNELS['tpu'])} on TPU, {','.join(build.LENGTH_KERNELS['gpu'])} on GPU).")
errors.list_flag("length_methods", [], "Also compile the length forward under each of these length methods "
                  "(eval.py --methods; e.g. log_length,window,interpolate_distances), with each length kernel.")
flags.DEFINE_enum("format", "text", ["text", "markdown"], "Per-program blocks, or one markdown table row each.")
flags.DEFINE_string("out", None, "Also write the figures to this JSON file.")
FLAGS = flags.FLAGS

def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = FLAGS.config
    unknown = sorted(set(FLAGS.programs) - set(build.PROGRAMS))
    if unknown:
        sys.exit(f"--programs: unknown {unknown}; choose from {list(build.PROGRAMS)}")
    if FLAGS.length_multiple < 1:
        sys.exit(f"--length_multiple={FLAGS.length_multiple}: the length forward is compiled at this multiple of "
                 "config.data.seq_len, so it must be 1 or more")
    if FLAGS.out:  # found now, not after minutes of compiling
        if Path(FLAGS.out).is_dir():
            sys.exit(f"--out={FLAGS.out} is a folder; name the JSON file to write, e.g. {Path(FLAGS.out) / 'aot.json'}")
        try:
            storage.check_writable(Path(FLAGS.out).parent, f"--out={FLAGS.out}: its folder")
        except OSError as err:
            sys.exit(f"error: {err}")
    try:
        tpu = chips.target(FLAGS.topology, FLAGS.num_slices)
        reports = build.compile_run(config, tpu, programs=FLAGS.programs, length_multiple=FLAGS.length_multiple,
                                    length_kernels=FLAGS.length_kernels, length_methods=FLAGS.length_methods)
    except (TopologyError, config_checks.ConfigError, RuntimeError, ValueError) as err:
        sys.exit(f"error: {err}")
    label = _config_label()
    model = config.model
    if FLAGS.format == "markdown":
        print("\n".join(text.markdown_row(label, tpu.name, report) for report in reports))
    else:
        print(f"{label} on {tpu.name} ({tpu.num_chips} {tpu.chip.unit}{'s' if tpu.num_chips > 1 else ''}; "
              "mesh data x fsdp = "
              f"{tpu.num_chips // config.mesh.fsdp} x {config.mesh.fsdp}); seq_len {config.data.seq_len}, global batch "
              f"{config.train.batch_size}, grad_accum_steps {config.train.grad_accum_steps}, dtype {model.dtype}, "
              f"remat {model.remat}, scan_layers {model.scan_layers}, kernel {model.attention_kernel}"
              + (f", relative terms {build.model_config_for(config, tpu).relative_terms}"
                 if model.attention == "disentangled" else ""))
        for report in reports:
            print(text.describe(report))
            for hint in build.fit_hints(report, config, tpu):
                print(f"  to fit: {hint}")
    if FLAGS.out:
        rows = [dict(config=label, slice=tpu.name, **report.row(), hints=build.fit_hints(report, config, tpu))
                for report in reports]
        Path(FLAGS.out).write_text(json.dumps(rows, indent=1) + "\n")


def _config_label() -> str:
    """The config spec and its command-line overrides (what the figures are of)."""
    spec = config_flags.get_config_filename(FLAGS["config"]).removeprefix("configs/")
    overrides = config_flags.get_override_values(FLAGS["config"])
    return " ".join([spec, *(f"{key}={value}" for key, value in overrides.items())])


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "topology"])
    app.run(main, flags_parser=lambda argv: config_checks.parse_config_flags(FLAGS, argv, "config"))
