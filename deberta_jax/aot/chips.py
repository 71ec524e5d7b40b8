"""Accelerators to compile for, from this machine's CPU: the published figures of each TPU chip and NVIDIA GPU,
and the devices of a named target (`jax.experimental.topologies`): a TPU slice (libtpu installed, no TPU) or the
GPUs of one node (the CUDA plugin, `jax[cuda12]`, installed; no GPU and no driver).

Targets are named `GENERATION:GRID` for a TPU slice (`v5e:4x4`, `v5p:2x2x2`) and `GPU[:COUNT]` for COUNT GPUs of
one NVLink node (`h100` is one H100, `h100:8` an 8-GPU HGX node; up to 8).

Per-chip TPU figures are Google Cloud's published specifications (the "System architecture" table of each
generation's page under cloud.google.com/tpu/docs: v4, v5e, v5p, v6e). GPU figures are NVIDIA's datasheets for
the SXM parts (H100, H200, A100): peak dense (no sparsity) bfloat16 tensor-core FLOP/s, HBM bandwidth and NVLink
bandwidth (both directions over all links, as ICI's is counted); the capacity is the device's total memory as its
driver reports it. Each GPU's XLA target (SMs, shared memory, L2, clock: what XLA's GPU compiler tunes its fusions
and Triton tiles for) is a `GpuTargetConfigProto` text file in `gpu_targets/`, with the source of its numbers.
Peak FLOP/s are for bfloat16 matrix work; float32 matmuls run at a fraction of it, so rooflines of float32
programs are optimistic.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import importlib.util
import math
import os
import re

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator: a TPU generation or a GPU model. Capacities and rates are per chip (per GPU);
    `ici_bandwidth` is the chip-to-chip bandwidth, ICI on TPU and NVLink on GPU, bidirectional over all links."""

    name: str
    peak_flops: float  # bfloat16 FLOP/s
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s
    ici_bandwidth: float | None  # bytes/s; None where the chip's page does not publish it
    accelerator_type: str = ""  # TPU: TPU_ACCELERATOR_TYPE prefix, counted in `cores_per_chip` units
    cores_per_chip: int = 1  # TPU: TensorCores the accelerator type counts per chip (one JAX device per chip)
    chip_config: str = ""  # TPU: libtpu's chip configuration for one device per chip
    source: str = ""
    platform: str = "tpu"  # "tpu" or "gpu"
    target_config: str = ""  # GPU: the GpuTargetConfigProto file in gpu_targets/

    @property
    def unit(self) -> str:
        """What one device is called in messages: "chip" or "GPU"."""
        return "GPU" if self.platform == "gpu" else "chip"

    @property
    def link(self) -> str:
        """The chip-to-chip network the roofline's third bound uses."""
        return "NVLink" if self.platform == "gpu" else "ICI"


CHIPS = {
    "v4": Chip("v4", 275e12, 32 * GIB, 1200e9, None, "v4", 2, "megacore", "cloud.google.com/tpu/docs/v4"),
    "v5e": Chip("v5e", 197e12, 16 * GIB, 819e9, 400e9, "v5litepod", 1, "default", "cloud.google.com/tpu/docs/v5e"),
    "v5p": Chip("v5p", 459e12, 95 * GIB, 2765e9, 1200e9, "v5p", 2, "default", "cloud.google.com/tpu/docs/v5p"),
    "v6e": Chip("v6e", 918e12, 32 * GIB, 1638e9, 800e9, "v6e", 1, "default", "cloud.google.com/tpu/docs/v6e"),
}

# NVIDIA's datasheets (nvidia.com/en-us/data-center/h100, /h200, /a100), SXM form factor: dense bfloat16 is half
# the "with sparsity" figure (H100/H200 1,979 -> 989 TFLOP/s, A100 624 -> 312). Memory: what the driver reports
# (the device_memory_size of each gpu_targets/ file, which a test checks against these).
GPUS = {
    "h100": Chip("h100", 989e12, 84942979072, 3350e9, 900e9, source="nvidia.com/en-us/data-center/h100",
                 platform="gpu", target_config="h100.txtpb"),
    "h200": Chip("h200", 989e12, 143771 * 1024**2, 4800e9, 900e9, source="nvidia.com/en-us/data-center/h200",
                 platform="gpu", target_config="h200.txtpb"),
    "a100": Chip("a100", 312e12, 81920 * 1024**2, 2039e9, 600e9, source="nvidia.com/en-us/data-center/a100",
                 platform="gpu", target_config="a100.txtpb"),
}


def gpu_of_device(device) -> Chip | None:
    """The datasheet entry of a running GPU (`jax.Device`, by its device kind: "NVIDIA H100 80GB HBM3" is the
    H100), None for another device or an unlisted GPU."""
    if device.platform != "gpu":
        return None
    kind = device.device_kind.lower()
    return next((chip for name, chip in GPUS.items() if name in kind), None)


# GPUs of one node joined by NVLink (an HGX/DGX board holds 8); nodes joined over the network are not modelled.
MAX_GPUS_PER_NODE = 8
# The fraction of a GPU's memory JAX's GPU client takes by default (XLA_PYTHON_CLIENT_MEM_FRACTION): a program
# needing more runs out of memory unless the variable is raised.
JAX_GPU_MEMORY_FRACTION = 0.75

# libtpu refuses to load in a second process unless this is set (it guards a TPU's devices, unused here).
MULTIPLE_LOAD_VARIABLE = "ALLOW_MULTIPLE_LIBTPU_LOAD"
# The CUDA plugin checks the CUDA libraries against a driver when it loads, unless this is set (or JAX_PLATFORMS
# leaves CUDA out); with no driver the check fails and the plugin does not register, so no GPU target can be made.
SKIP_CUDA_CHECK_VARIABLE = "JAX_SKIP_CUDA_CONSTRAINTS_CHECK"
# The jax_plugins modules of the CUDA plugin (jax[cuda12], jax[cuda13]); either compiles for any GPU here.
CUDA_PLUGINS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")

TOPOLOGY_HELP = ("a TPU slice GENERATION:GRID (v5e:4x4, v6e:2x4, v5p:2x2x2, v4:2x2x4) or GPU[:COUNT] GPUs of one "
                 f"node ({', '.join(GPUS)}; h100:8 is an 8-GPU node)")


def prepare_environment() -> None:
    """What the command sets before jax is first imported: compile on the CPU backend (no TPU or GPU is opened,
    even where one is attached) and let the CUDA plugin load with no driver. Values a user set are kept."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault(SKIP_CUDA_CHECK_VARIABLE, "1")


class TopologyError(ValueError):
    """A topology name this module cannot build; the message says which names it can."""


@dataclasses.dataclass(frozen=True)
class Target:
    """The devices of `num_slices` slices of `chip` in the grid `shape` (one JAX device per chip), or of
    `shape[0]` GPUs of one node."""

    chip: Chip
    shape: tuple[int, ...]
    num_slices: int
    devices: tuple

    @property
    def platform(self) -> str:
        return self.chip.platform

    @property
    def name(self) -> str:
        if self.platform == "gpu":
            return self.chip.name + (f":{self.shape[0]}" if self.shape[0] > 1 else "")
        grid = "x".join(map(str, self.shape))
        return f"{self.chip.name}:{grid}" + (f" x {self.num_slices} slices" if self.num_slices > 1 else "")

    @property
    def num_chips(self) -> int:
        return len(self.devices)

    @property
    def devices_per_slice(self) -> int:
        """The devices FSDP may span on the fast links: a TPU slice's chips, a node's GPUs."""
        return self.num_chips // self.num_slices


TpuSlice = Target  # the name of a TPU target before GPUs were added


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


def parse_gpu_topology(name: str) -> tuple[Chip, int]:
    """`"h100:8"` -> (the H100, 8): a GPU of `GPUS` and how many of one node (1 when no count is given)."""
    match = re.fullmatch(r"([a-z]\w*)(?::(\d+))?", name.strip().lower())
    if not match or match.group(1) not in GPUS:
        raise TopologyError(f"topology {name!r}: use GPU[:COUNT] with GPU one of {list(GPUS)}, e.g. h100 (one "
                            "GPU) or h100:8 (an 8-GPU node)")
    count = int(match.group(2) or 1)
    if not 1 <= count <= MAX_GPUS_PER_NODE:
        raise TopologyError(f"topology {name!r}: COUNT is the GPUs of one NVLink node, 1 to {MAX_GPUS_PER_NODE}, "
                            f"e.g. {match.group(1)}:8")
    return GPUS[match.group(1)], count


def is_gpu_topology(name: str) -> bool:
    """Whether `name` names GPUs (`GPU[:COUNT]`) rather than a TPU slice; it may still be a bad name."""
    return re.match(r"\s*v\d", name) is None and name.strip().split(":")[0].lower() in GPUS


def target(topology: str, num_slices: int = 1) -> Target:
    """The devices named `topology`: a TPU slice (`tpu_slice`) or GPUs of one node (`gpu_node`).

    Raises TopologyError for a bad name, RuntimeError when the compiler it needs (libtpu, the CUDA plugin) is
    missing, with the install command.
    """
    if not isinstance(topology, str) or not topology.strip():
        raise TopologyError(f"--topology is required: {TOPOLOGY_HELP}")
    if is_gpu_topology(topology):
        return gpu_node(topology, num_slices)
    if not re.match(r"\s*v\d", topology):
        raise TopologyError(f"topology {topology!r}: use {TOPOLOGY_HELP}")
    return tpu_slice(topology, num_slices)


def _offline_libtpu_environment(chip: Chip, num_chips: int) -> None:
    """What libtpu would otherwise ask a TPU VM's metadata server for (there is none here, and nothing may be
    contacted): the accelerator type and the worker hostnames. Values a user set are kept."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", f"{chip.accelerator_type}-{num_chips * chip.cores_per_chip}")
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def tpu_slice(topology: str, num_slices: int = 1) -> Target:
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
    return Target(chip=chip, shape=shape, num_slices=num_slices, devices=tuple(desc.devices))


def target_config(chip: Chip) -> str:
    """The GpuTargetConfigProto text XLA compiles for `chip` (a GPU of `GPUS`)."""
    return (importlib.resources.files(__package__) / "gpu_targets" / chip.target_config).read_text()


def gpu_node(topology: str, num_slices: int = 1) -> Target:
    """The devices of `topology`'s GPUs (e.g. "h100:8", 8 H100s of one node: one process, as `train.py` runs on a
    node), to build a mesh and compile on. XLA's GPU compiler runs here as on the node, Triton included, from the
    GPU's target description; no GPU or driver is needed.

    Raises TopologyError for a bad name and RuntimeError when the CUDA plugin is missing (with the install
    command) or did not load in this process.
    """
    chip, count = parse_gpu_topology(topology)
    if num_slices != 1:
        raise TopologyError(f"num_slices={num_slices}: a GPU target is one node of up to {MAX_GPUS_PER_NODE} GPUs "
                            f"({topology.strip()}); nodes joined over the network are not modelled")
    os.environ.setdefault(SKIP_CUDA_CHECK_VARIABLE, "1")  # in time only where no backend has started yet
    import jax
    if not any(importlib.util.find_spec(plugin.split(".")[0]) and importlib.util.find_spec(plugin)
               for plugin in CUDA_PLUGINS):
        raise RuntimeError(f'compiling for GPUs needs the CUDA plugin on this machine: pip install '
                           f'"jax[cuda12]=={jax.__version__}" (about 3 GB with its NVIDIA libraries; no GPU or '
                           'driver is needed)')
    from jax.experimental import topologies

    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=target_config(chip),
                                            topology=f"1x1x{count}")  # partitions x hosts x GPUs per host
    except NotImplementedError:  # jax found no "cuda" plugin: it was skipped or failed when backends started
        raise RuntimeError(
            "the CUDA plugin is installed but did not load in this process (its check of the CUDA libraries "
            f"needs a driver): set JAX_PLATFORMS=cpu and {SKIP_CUDA_CHECK_VARIABLE}=1 before jax is imported, as "
            "python -m deberta_jax.aot does") from None
    except Exception as err:  # noqa: BLE001 - the plugin's errors have no narrower type
        raise TopologyError(f"topology {topology!r}: the CUDA plugin refused it: {err}") from None
    return Target(chip=chip, shape=(count,), num_slices=1, devices=tuple(desc.devices))
