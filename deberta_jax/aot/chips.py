"""TPU chips and slices to compile for, from this machine's CPU: the published figures of each chip and the
devices of a named slice (`jax.experimental.topologies`, which needs libtpu installed but no TPU).

Per-chip figures are Google Cloud's published specifications (the "System architecture" table of each
generation's page under cloud.google.com/tpu/docs: v4, v5e, v5p, v6e). Peak FLOP/s are for bfloat16 matrix
work; float32 matmuls run at a fraction of it, so rooflines of float32 programs are optimistic.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """One TPU generation. Capacities and rates are per chip; `ici_bandwidth` is bidirectional over all links."""

    name: str
    peak_flops: float  # bfloat16 FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float | None  # bytes/s; None where the chip's page does not publish it
    accelerator_type: str  # TPU_ACCELERATOR_TYPE prefix, counted in `cores_per_chip` units
    cores_per_chip: int  # TensorCores the accelerator type counts per chip (one JAX device per chip: megacore)
    chip_config: str  # libtpu's chip configuration for one device per chip
    source: str


CHIPS = {
    "v4": Chip("v4", 275e12, 32 * GIB, 1200e9, None, "v4", 2, "megacore", "cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", 197e12, 16 * GIB, 819e9, 400e9, "v5litepod", 1, "default", "cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765e9, 1200e9, "v5p", 2, "default", "cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", 918e12, 32 * GIB, 1638e9, 800e9, "v6e", 1, "default", "cloud.google.com/tpu/docs/v6e"),
}


# libtpu refuses to load in a second process unless this is set (it guards a TPU's devices, unused here).
MULTIPLE_LOAD_VARIABLE = "ALLOW_MULTIPLE_LIBTPU_LOAD"


class TopologyError(ValueError):
    """A topology name this module cannot build; the message says which names it can."""


@dataclasses.dataclass(frozen=True)
class TpuSlice:
    """The devices of `num_slices` slices of `chip` in the grid `shape` (one JAX device per chip)."""

    chip: Chip
    shape: tuple[int, ...]
    num_slices: int
    devices: tuple

    @property
    def name(self) -> str:
        grid = "x".join(map(str, self.shape))
        return f"{self.chip.name}:{grid}" + (f" x {self.num_slices} slices" if self.num_slices > 1 else "")

    @property
    def num_chips(self) -> int:
        return len(self.devices)


def parse_topology(name: str) -> tuple[Chip, tuple[int, ...]]:
    """`"v5e:4x4"` -> (the v5e chip, (4, 4)): a generation of `CHIPS` and its chip grid (2-D for v5e/v6e,
    3-D for v4/v5p, as Cloud TPU names slices)."""
    match = re.fullmatch(r"(v\w+):(\d+(?:x\d+){1,2})", name.strip())
    if not match or match.group(1) not in CHIPS:
        raise TopologyError(f"topology {name!r}: use GENERATION:GRID with GENERATION one of {sorted(CHIPS)}, "
                            "e.g. v5e:4x4, v6e:2x2, v5p:2x2x2, v4:2x2x4")
    chip, shape = CHIPS[match.group(1)], tuple(int(d) for d in match.group(2).split("x"))
    dims = 3 if chip.name in ("v4", "v5p") else 2
    if len(shape) != dims or min(shape) < 1:
        raise TopologyError(f"topology {name!r}: {chip.name} slices are named by a {dims}-D chip grid, "
                            f"e.g. {chip.name}:{'2x2x2' if dims == 3 else '4x4'}")
    return chip, shape


def _offline_libtpu_environment(chip: Chip, num_chips: int) -> None:
    """What libtpu would otherwise ask a TPU VM's metadata server for (there is none here, and nothing may be
    contacted): the accelerator type and the worker hostnames. Values a user set are kept."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip.accelerator_type}-{num_chips * chip.cores_per_chip}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def tpu_slice(topology: str, num_slices: int = 1) -> TpuSlice:
    """The devices of `num_slices` slices named `topology` (e.g. "v5e:4x4"), to build a mesh and compile on.

    Raises TopologyError for a bad name and RuntimeError when libtpu is missing (with the install command) or
    loaded by another process.
    """
    chip, shape = parse_topology(topology)
    if num_slices < 1:
        raise TopologyError(f"num_slices={num_slices}: need at least one slice")
    import jax
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f'compiling for TPU needs libtpu on this machine: pip install "jax[tpu]=={jax.__version__}" '
                           "(about 700 MB; no TPU is needed or contacted)")
    from jax.experimental import topologies

    _offline_libtpu_environment(chip, math.prod(shape) * num_slices)
    host = tuple(min(2, d) for d in shape[:2]) + (1,)  # 2x2 chips per host, as on v4, v5p and v5e/v6e training VMs
    try:
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=topology.strip(), chip_config_name=chip.chip_config,
            chips_per_host_bounds=host, num_slices=num_slices)
    except Exception as err:  # noqa: BLE001 - libtpu's errors have no narrower type
        if "libtpu_lockfile" in str(err):  # its advice, to delete the lock, would break the process holding it
            raise RuntimeError("another process has libtpu loaded, and libtpu lets one process at a time load it: "
                               f"wait for that process to end, or set {MULTIPLE_LOAD_VARIABLE}=1 to load it "
                               "alongside (compiling here touches no TPU)") from None
        raise TopologyError(f"topology {topology!r} x {num_slices} slice(s): libtpu refused it: {err}") from None
    return TpuSlice(chip=chip, shape=shape, num_slices=num_slices, devices=tuple(desc.devices))
