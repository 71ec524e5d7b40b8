"""How the aot command prints a compiled program's figures: a text block per program, or one markdown table row
(`MARKDOWN_HEADER` for TPU slices, `GPU_MARKDOWN_HEADER` for GPUs). Apart from the command, so that tests and the
benchmark scripts read the same words without defining its flags."""

from __future__ import annotations

from deberta_jax.aot import analysis, build
from deberta_jax.aot.chips import GIB

MARKDOWN_HEADER = ("| config | slice | program | HBM / chip (GiB) | fits | TFLOP / chip | GB / chip "
                   "| gathers (largest, MB) | roofline (ms) | bound | tokens/s | MFU ceiling | compile (s) |\n"
                   "|---|---|---|---:|---|---:|---:|---:|---:|---|---:|---:|---:|")
# The same columns for GPUs: memory per GPU, the model's FLOPs (XLA's GPU compiler counts none), no bytes, no MFU.
GPU_MARKDOWN_HEADER = ("| config | GPUs | program | memory / GPU (GiB) | fits | TFLOP / GPU (model) | GB / GPU "
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
    cost, line, chip = report.cost, report.roofline, report.chip
    if chip.platform == "gpu":
        return "\n".join([
            f"{report.name}: compiled in {report.compile_s:.1f} s" + ("" if report.num_chips > 1 else " (one GPU)"),
            f"  memory per GPU  {cost.hbm_bytes / GIB:.2f} of {build._capacity(chip)} GiB "
            f"({'fits' if report.fits else 'DOES NOT FIT'}; arguments {cost.argument_bytes / GIB:.2f}, "
            f"temporaries {cost.temp_bytes / GIB:.2f}, outputs aliased to donated arguments "
            f"{cost.alias_bytes / GIB:.2f})",
            f"  per GPU         {report.model_flops / report.num_chips / 1e12:.3f} TFLOP by the model's count (XLA's "
            f"GPU compiler gives no cost analysis: no FLOPs or bytes of its own); {cost.collective_bytes / 1e9:.2f} GB "
            f"of collectives, {cost.gathers} gathers in the optimized HLO (largest "
            f"{cost.largest_gather_bytes / 1e6:.1f} MB)" + (f"; {cost.loops} while loops" if cost.loops else ""),
            f"  roofline        {line.seconds * 1e3:.2f} ms at least ({line.bound}-bound: compute "
            f"{line.compute_s * 1e3:.2f}, NVLink {line.ici_s * 1e3:.2f} ms; HBM time unknown) -> at most "
            f"{report.tokens_per_s:,.0f} tokens/s",
        ])
    return "\n".join([
        f"{report.name}: compiled in {report.compile_s:.1f} s" + ("" if report.num_chips > 1 else " (one chip)"),
        f"  HBM per chip  {cost.hbm_bytes / GIB:.2f} of {build._capacity(chip)} GiB "
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
    gb = "–" if cost.bytes_accessed is None else f"{cost.bytes_accessed / 1e9:.1f}"  # unknown on GPU
    mfu = "–" if report.mfu is None else f"{report.mfu:.0%}"
    return (f"| {label} | {slice_name} | {report.name} | {cost.hbm_bytes / GIB:.2f} | {'yes' if report.fits else 'no'} "
            f"| {max(cost.flops or 0.0, report.model_flops / report.num_chips) / 1e12:.2f} | {gb} "
            f"| {cost.gathers} ({cost.largest_gather_bytes / 1e6:.1f}) | {line.seconds * 1e3:.1f} "
            f"| {line.bound} | {report.tokens_per_s:,.0f} | {mfu} | {report.compile_s:.0f} |")
