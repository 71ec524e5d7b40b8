"""Registers and spills of the GPU kernels of a program compiled for an NVIDIA GPU, as NVIDIA's assembler reports
them, from a machine without a GPU.

A kernel that needs more registers than a thread may have (255, fewer with more threads per block) spills the rest
to local memory, which is slow; a compile-level check can say so before any GPU runs. XLA compiles each kernel to
PTX and, on a GPU machine, hands it to the driver's assembler. Here the program is compiled with XLA's dump on
(a per-compile option), and the PTX files holding the wanted entry functions are assembled by `ptxas -v` for the
architecture each was generated for, which prints each function's registers, stack frame and spill traffic.

`ptxas` ships in NVIDIA's `nvidia-cuda-nvcc` wheel, which the CUDA plugin's extra (`jax[cuda12]`) installs; a
CUDA toolkit on the PATH serves as well.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class KernelResources:
    """One entry function as ptxas assembled it."""

    name: str
    arch: str  # e.g. sm_90a
    registers: int
    spill_stores: int  # bytes per thread
    spill_loads: int
    stack_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0


def find_ptxas() -> str:
    """The ptxas of the `nvidia-cuda-nvcc` wheel, else one on the PATH; a clear error naming the fix otherwise."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root, "cuda_nvcc", "bin", "ptxas")
        if os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("ptxas")
    if found:
        return found
    raise FileNotFoundError("NVIDIA's assembler (ptxas) is not installed: install the CUDA plugin's extra "
                            "(pip install \"jax[cuda12]==<the installed jax>\"), which brings nvidia-cuda-nvcc-cu12, "
                            "or put a CUDA toolkit's bin/ on the PATH")


_ENTRY = re.compile(r"^\s*(?:\.visible\s+)?\.entry\s+([A-Za-z_][\w$]*)", re.M)
_TARGET = re.compile(r"^\s*\.target\s+(sm_\w+)", re.M)
_PROPERTIES = re.compile(r"Function properties for (\S+)\s*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores, "
                         r"(\d+) bytes spill loads")
_USED = re.compile(r"Compiling entry function '([^']+)'.*?Used (\d+) registers", re.S)


def assemble(ptx_text: str, names: set[str] | None = None) -> list[KernelResources]:
    """ptxas -v on one PTX module: the resources of its entry functions (those in `names`, or all)."""
    arch = _TARGET.search(ptx_text)
    if arch is None:
        raise ValueError("a PTX module without a .target line")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(ptx_text)
        ptx.flush()
        run = subprocess.run([find_ptxas(), "-v", "--gpu-name", arch.group(1), ptx.name, "-o", os.devnull],
                             capture_output=True, text=True, check=False)
    if run.returncode:
        raise RuntimeError(f"ptxas failed on a PTX module for {arch.group(1)}: {run.stderr.strip()[-500:]}")
    # ptxas prints, per function, "Compiling entry function 'F'", then its properties, then "Used N registers".
    report = run.stderr + run.stdout
    registers = {}
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", report):
        used = _USED.search(block)
        if used:
            registers[used.group(1)] = int(used.group(2))
    out = []
    for name, stack, stores, loads in _PROPERTIES.findall(report):
        if name in registers and (names is None or name in names):
            out.append(KernelResources(name, arch.group(1), registers[name], int(stores), int(loads), int(stack)))
    return out


def compile_with_resources(lowered, names: set[str], optional: frozenset[str] = frozenset()):
    """Compile a lowered program (for a GPU target) and assemble its PTX: (the compiled program, the resources of
    every entry function named in `names` or `optional`, in the dump's order; a name in `names` must be there).
    XLA writes a PTX file per module it compiles; only those that hold a wanted entry are assembled."""
    names = set(names)
    wanted = names | optional
    with tempfile.TemporaryDirectory(prefix="ptx-") as dump:
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        resources = []
        for path in sorted(Path(dump).glob("*.ptx")):
            text = path.read_text()
            if wanted & set(_ENTRY.findall(text)):
                resources.extend(assemble(text, wanted))
    missing = names - {r.name for r in resources}
    if missing:
        raise RuntimeError(f"no PTX entry function named {sorted(missing)} in the compiled program (XLA dumped "
                           "no PTX for it: was it lowered for a CUDA GPU?)")
    return compiled, resources
