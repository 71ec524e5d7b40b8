"""What a compiled program costs on a chip (a TPU chip or a GPU): memory per chip, FLOPs and bytes, a roofline step
time and MFU.

Everything here reads the compiled executable (`memory_analysis()`, `cost_analysis()`, the optimized HLO); MFU
divides by the FLOPs the model needs by its own arithmetic (`deberta_jax.model.flops`, as PaLM's appendix B defines
them: recomputation under remat is work the chip does but not work the model needs).

The roofline step time is the longest of three lower bounds, each a resource used at its published peak:
compute (the program's FLOPs at the chip's bfloat16 peak), memory (its HBM bytes at the chip's bandwidth) and
inter-chip traffic (the bytes of its collectives at the chip's ICI or NVLink bandwidth). XLA's GPU compiler gives no
cost analysis (`cost_analysis()` is None): there the compute bound is the model's own FLOPs and the memory bound is
unknown (None), so a GPU roofline is a floor set by compute and NVLink alone, with no MFU ceiling. XLA's cost
analysis counts the body
of a `while` loop once, and under wide FSDP the TPU compiler turns all-gathered matmuls into loops over the shards
(collective matmuls, "windowed einsums"): on v5e:4x4 with fsdp=16 it reports a third of BERT-base's forward FLOPs.
The compute bound therefore uses the larger of XLA's count and the model's own (`flops.model_flops` per chip), and the
loops are counted (`ProgramCost.loops`) so a report can say when bytes, too, are undercounted. A real step is
slower: gathers and
other element-wise work run on the vector unit, not the matrix unit the peak is quoted for; collectives overlap
compute only in part; the host must feed the input in time; and float32 matmuls run below the bfloat16 peak.
"""

from __future__ import annotations

import dataclasses
import re

from deberta_jax.aot.chips import GIB, JAX_GPU_MEMORY_FRACTION, Chip

# Collectives of the optimized HLO and whether their result is a (operand, output) tuple (async starts).
_COLLECTIVES = {"all-gather": False, "all-reduce": False, "reduce-scatter": False, "all-to-all": False,
                "collective-permute": False, "all-gather-start": True, "all-reduce-start": True,
                "collective-permute-start": True}
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
                "f64": 8, "s64": 8, "u64": 8}
_INSTRUCTION = re.compile(r"=\s*(\(.*?\)|\S+)\s+([\w-]+)\(")
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    """One compiled program on one chip (every figure per chip; the program is SPMD, the same on each)."""

    argument_bytes: int
    output_bytes: int
    alias_bytes: int  # outputs written into donated arguments: counted once
    temp_bytes: int
    code_bytes: int
    flops: float | None  # None where XLA gives no cost analysis (GPU)
    bytes_accessed: float | None  # likewise
    collective_bytes: int
    gathers: int  # gather instructions in the optimized HLO (fusions included)
    largest_gather_bytes: int  # the largest output among them: a [B, H, N, N] one is DeBERTa's gathers at work
    loops: int  # while loops in the optimized HLO, whose bodies the cost analysis counts once

    @property
    def hbm_bytes(self) -> int:
        """Peak HBM the program needs: arguments, outputs not aliased to them, temporaries and code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


def _array_bytes(text: str) -> list[int]:
    sizes = []
    for dtype, dims in _ARRAY.findall(text):
        count = 1
        for d in filter(None, dims.split(",")):
            count *= int(d)
        sizes.append(count * _DTYPE_BYTES[dtype])
    return sizes


def hlo_census(hlo_text: str) -> dict[str, int]:
    """Gather instructions and the bytes of the largest one's output, bytes produced by collectives, and while
    loops, in an optimized HLO module's text."""
    gathers = largest_gather = collective = loops = 0
    for match in _INSTRUCTION.finditer(hlo_text):
        result, opcode = match.groups()
        if opcode == "gather":
            gathers += 1
            largest_gather = max([largest_gather, *_array_bytes(result)])
        elif opcode == "while":
            loops += 1
        elif opcode in _COLLECTIVES:
            sizes = _array_bytes(result)
            collective += (max(sizes) if _COLLECTIVES[opcode] else sum(sizes)) if sizes else 0
    return dict(gathers=gathers, largest_gather_bytes=largest_gather, collective_bytes=collective, loops=loops)


def program_cost(compiled) -> ProgramCost:
    """The per-chip figures of a compiled executable (`jax.jit(f).lower(...).compile()`)."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) and cost else cost  # older jax: one dict per computation
    census = hlo_census(compiled.as_text())
    known = bool(cost)  # None (or empty) from XLA's GPU compiler
    return ProgramCost(
        argument_bytes=int(memory.argument_size_in_bytes), output_bytes=int(memory.output_size_in_bytes),
        alias_bytes=int(memory.alias_size_in_bytes), temp_bytes=int(memory.temp_size_in_bytes),
        code_bytes=int(memory.generated_code_size_in_bytes),
        flops=float(cost.get("flops", 0.0)) if known else None,
        bytes_accessed=float(cost.get("bytes accessed", 0.0)) if known else None, **census)


@dataclasses.dataclass(frozen=True)
class OutOfMemory:
    """libtpu's refusal of a program that does not fit: what it needed and what a chip offers it."""

    what: str  # e.g. "HLO temporaries"
    required_bytes: int
    available_bytes: int


_OOM = re.compile(r"memory required for ([\w\s]+?) \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)")
_UNITS = {"K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def out_of_memory(message: str) -> OutOfMemory | None:
    """The shortfall libtpu's compile error states ("the total memory required for HLO temporaries (27.10G)
    exceeds available HBM (15.75G)"), or None for any other error."""
    match = _OOM.search(message)
    if not match:
        return None
    what, need, need_unit, have, have_unit = match.groups()
    return OutOfMemory(what.strip(), int(float(need) * _UNITS[need_unit]), int(float(have) * _UNITS[have_unit]))


@dataclasses.dataclass(frozen=True)
class Roofline:
    compute_s: float
    memory_s: float | None  # None when the program's bytes are unknown (no cost analysis: GPU)
    ici_s: float  # over ICI or NVLink; 0 when the chip's bandwidth is not published
    link: str = "ici"  # the name of the chip-to-chip bound: "ici" (TPU) or "nvlink" (GPU)

    @property
    def seconds(self) -> float:
        """The longest known bound (a floor on the step time; lower still where the memory bound is unknown)."""
        return max(self.compute_s, self.memory_s or 0.0, self.ici_s)

    @property
    def bound(self) -> str:
        """Which resource sets the roofline: compute, memory, or the link (ici, nvlink)."""
        return max((self.compute_s, "compute"), (self.memory_s or 0.0, "memory"), (self.ici_s, self.link))[1]


def roofline(cost: ProgramCost, chip: Chip, model_flops_per_chip: float) -> Roofline:
    """The three bounds of one chip's step; compute from the larger of XLA's FLOPs and the model's own (the model's
    alone where XLA gives no count), memory None where XLA gives no bytes."""
    ici = cost.collective_bytes / chip.ici_bandwidth if chip.ici_bandwidth else 0.0
    flops = max(cost.flops or 0.0, model_flops_per_chip)
    memory = None if cost.bytes_accessed is None else cost.bytes_accessed / chip.hbm_bandwidth
    return Roofline(compute_s=flops / chip.peak_flops, memory_s=memory, ici_s=ici, link=chip.link.lower())


@dataclasses.dataclass(frozen=True)
class ProgramReport:
    """A program compiled for a slice or a GPU node, with what it means for a run."""

    name: str
    chip: Chip
    num_chips: int
    tokens: int  # tokens one call processes, over the whole slice
    model_flops: float  # over the whole slice
    compile_s: float
    cost: ProgramCost | None = None
    error: str | None = None  # why it did not compile
    oom: OutOfMemory | None = None  # the error was libtpu finding it too large for a chip (XLA's GPU compiler
    # compiles any size; `fits` compares its memory with the GPU's)

    @property
    def roofline(self) -> Roofline:
        return roofline(self.cost, self.chip, self.model_flops / self.num_chips)

    @property
    def fits(self) -> bool:
        return self.cost is not None and self.cost.hbm_bytes <= self.chip.hbm_bytes

    @property
    def needed_bytes(self) -> int | None:
        """HBM per chip the program needs (at least, when libtpu refused it: then only what its error names)."""
        if self.cost is not None:
            return self.cost.hbm_bytes
        return None if self.oom is None else self.oom.required_bytes

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.roofline.seconds

    @property
    def mfu(self) -> float | None:
        """Model FLOPs per second at the roofline step time, over the slice's peak; None where the memory bound is
        unknown (GPU), as the ceiling would then be the compute bound's own 100%."""
        if self.roofline.memory_s is None:
            return None
        return self.model_flops / (self.roofline.seconds * self.num_chips * self.chip.peak_flops)

    @property
    def above_default_gpu_memory(self) -> bool:
        """A GPU program that fits the GPU but needs more than JAX's GPU client takes by default
        (`chips.JAX_GPU_MEMORY_FRACTION`): it runs only with XLA_PYTHON_CLIENT_MEM_FRACTION raised."""
        return (self.chip.platform == "gpu" and self.fits
                and self.cost.hbm_bytes > JAX_GPU_MEMORY_FRACTION * self.chip.hbm_bytes)

    def row(self) -> dict:
        """The figures as one flat record (JSON, tables)."""
        out = dict(program=self.name, chip=self.chip.name, chips=self.num_chips, compile_s=round(self.compile_s, 1))
        if self.cost is None:
            oom = {} if self.oom is None else dict(fits=False, needs_at_least_gib=self.oom.required_bytes / GIB,
                                                   available_gib=self.oom.available_bytes / GIB)
            return {**out, **oom, "error": self.error}
        line, cost = self.roofline, self.cost
        scaled = lambda value, unit: None if value is None else value / unit  # noqa: E731 - None: unknown (GPU)
        return {**out, "hbm_gib": cost.hbm_bytes / GIB,
                "capacity_gib": self.chip.hbm_bytes / GIB, "fits": self.fits, "temp_gib": cost.temp_bytes / GIB,
                "argument_gib": cost.argument_bytes / GIB, "tflop": scaled(cost.flops, 1e12),
                "gb_accessed": scaled(cost.bytes_accessed, 1e9), "collective_gb": cost.collective_bytes / 1e9,
                "model_tflop": self.model_flops / self.num_chips / 1e12, "gathers": cost.gathers,
                "largest_gather_mb": cost.largest_gather_bytes / 1e6,
                "loops": cost.loops, "step_ms": line.seconds * 1e3, "bound": line.bound,
                "compute_ms": line.compute_s * 1e3, "memory_ms": scaled(line.memory_s, 1e-3),
                "ici_ms": line.ici_s * 1e3, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu}
