"""Does a config fit a TPU slice, how long is its step, what MFU should it reach? Compiled here, on the CPU.

    pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"   # libtpu, once
    python -m deberta_jax.aot --config configs/deberta.py:base --topology v5e:4x4 \\
        --config.model.dtype=bfloat16 --config.mesh.fsdp=16 [--config.* overrides]

Compiles, for the named slice, the train step and eval step `train.py` builds from the config and the length
study's forward at `--length_multiple` times the training length with each of `--length_kernels` (as trained, and
under each of `--length_methods`), then prints per program: HBM per chip against the chip's capacity, FLOPs, bytes
and collective traffic per chip, the count of gathers left in the optimized HLO, a roofline step time with
tokens/s and MFU, and the compile time. A program that does not fit gets the knobs that would shrink it.
`--format markdown` prints the same figures as a table; `--out FILE.json` writes them. Nothing runs on a TPU and no
network address is contacted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

from deberta_jax import storage
from deberta_jax.aot import analysis, build
from deberta_jax.aot.chips import GIB, TopologyError, tpu_slice
from deberta_jax.train import config_checks

config_flags.DEFINE_config_file("config", None, "Experiment config, e.g. configs/deberta.py:base.", lock_config=True)
flags.DEFINE_string("topology", None, "TPU slice: GENERATION:GRID, e.g. v5e:4x4, v6e:2x4, v5p:2x2x2, v4:2x2x4.")
flags.DEFINE_integer("num_slices", 1, "Slices joined over the data-center network (multi-slice); data parallel "
                     "across them.")
flags.DEFINE_list("programs", list(build.PROGRAMS), f"Which programs to compile, of {list(build.PROGRAMS)}.")
flags.DEFINE_integer("length_multiple", 8, "The length study's forward is compiled at this multiple of "
                     "config.data.seq_len.")
flags.DEFINE_list("length_kernels", list(build.LENGTH_KERNELS), "Attention kernels for the length forward.")
flags.DEFINE_list("length_methods", [], "Also compile the length forward under each of these length methods "
                  "(eval.py --methods; e.g. log_length,window,interpolate_distances), with each length kernel.")
flags.DEFINE_enum("format", "text", ["text", "markdown"], "Per-program blocks, or one markdown table row each.")
flags.DEFINE_string("out", None, "Also write the figures to this JSON file.")
FLAGS = flags.FLAGS

MARKDOWN_HEADER = ("| config | slice | program | HBM / chip (GiB) | fits | TFLOP / chip | GB / chip "
                   "| gathers (largest, MB) | roofline (ms) | bound | tokens/s | MFU ceiling | compile (s) |\n"
                   "|---|---|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|")


def describe(report: analysis.ProgramReport) -> str:
    """The text block of one program."""
    if report.oom is not None:
        return (f"{report.name}: DOES NOT FIT: needs at least {report.oom.required_bytes / GIB:.2f} GiB of "
                f"{report.oom.what} per chip, libtpu can use {report.oom.available_bytes / GIB:.2f} GiB "
                f"(refused after {report.compile_s:.1f} s)")
    if report.cost is None:
        return f"{report.name}: not compiled: {report.error}"
    cost, line = report.cost, report.roofline
    return "\n".join([
        f"{report.name}: compiled in {report.compile_s:.1f} s" + ("" if report.num_chips > 1 else " (one chip)"),
        f"  HBM per chip  {cost.hbm_bytes / GIB:.2f} of {report.chip.hbm_bytes / GIB:.0f} GiB "
        f"({'fits' if report.fits else 'DOES NOT FIT'}; arguments {cost.argument_bytes / GIB:.2f}, "
        f"temporaries {cost.temp_bytes / GIB:.2f}, outputs aliased to donated arguments {cost.alias_bytes / GIB:.2f})",
        f"  per chip      {cost.flops / 1e12:.3f} TFLOP by XLA's count, "
        f"{report.model_flops / report.num_chips / 1e12:.3f} "
        f"by the model's; {cost.bytes_accessed / 1e9:.1f} GB accessed, {cost.collective_bytes / 1e9:.2f} GB of "
        f"collectives, {cost.gathers} gathers in the optimized HLO (largest {cost.largest_gather_bytes / 1e6:.1f} MB)"
        + (f"; {cost.loops} while loops, whose bodies XLA counts once" if cost.loops else ""),
        f"  roofline      {line.seconds * 1e3:.2f} ms ({line.bound}-bound: compute {line.compute_s * 1e3:.2f}, "
        f"HBM {line.memory_s * 1e3:.2f}, ICI {line.ici_s * 1e3:.2f} ms) -> {report.tokens_per_s:,.0f} tokens/s, "
        f"MFU ceiling {report.mfu:.1%}",
    ])


def markdown_row(label: str, slice_name: str, report: analysis.ProgramReport) -> str:
    if report.cost is None:
        needed = "–" if report.oom is None else f"> {report.oom.required_bytes / GIB:.2f}"
        fits = "–" if report.oom is None else "no"
        return (f"| {label} | {slice_name} | {report.name} | {needed} | {fits} | – | – | – | – | – | – | – "
                f"| {report.compile_s:.0f} |")
    cost, line = report.cost, report.roofline
    return (f"| {label} | {slice_name} | {report.name} | {cost.hbm_bytes / GIB:.2f} | {'yes' if report.fits else 'no'} "
            f"| {max(cost.flops, report.model_flops / report.num_chips) / 1e12:.2f} | {cost.bytes_accessed / 1e9:.1f} "
            f"| {cost.gathers} ({cost.largest_gather_bytes / 1e6:.1f}) | {line.seconds * 1e3:.1f} "
            f"| {line.bound} | {report.tokens_per_s:,.0f} | {report.mfu:.0%} | {report.compile_s:.0f} |")


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
        tpu = tpu_slice(FLAGS.topology, FLAGS.num_slices)
        reports = build.compile_run(config, tpu, programs=FLAGS.programs, length_multiple=FLAGS.length_multiple,
                                    length_kernels=FLAGS.length_kernels, length_methods=FLAGS.length_methods)
    except (TopologyError, config_checks.ConfigError, RuntimeError, ValueError) as err:
        sys.exit(f"error: {err}")
    label = _config_label()
    model = config.model
    if FLAGS.format == "markdown":
        print("\n".join(markdown_row(label, tpu.name, report) for report in reports))
    else:
        print(f"{label} on {tpu.name} ({tpu.num_chips} chips; mesh data x fsdp = "
              f"{tpu.num_chips // config.mesh.fsdp} x {config.mesh.fsdp}); seq_len {config.data.seq_len}, global batch "
              f"{config.train.batch_size}, grad_accum_steps {config.train.grad_accum_steps}, dtype {model.dtype}, "
              f"remat {model.remat}, scan_layers {model.scan_layers}, kernel {model.attention_kernel}"
              + (f", relative terms {build.model_config_for(config, tpu).relative_terms}"
                 if model.attention == "disentangled" else ""))
        for report in reports:
            print(describe(report))
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
