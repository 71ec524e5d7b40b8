"""Data parallelism and FSDP: a (data, fsdp) mesh over all devices, batches split over both axes,
parameters and optimizer state split over "fsdp".

With `fsdp = 1` (the default) this is plain data parallelism: every device holds the whole model.
With `fsdp = F`, each array of the training state is split F ways along its largest dimension that F
divides (`state_sharding`), so parameters and AdamW moments take 1/F of the memory per device; inside
the jitted step XLA's SPMD partitioner all-gathers each weight where a layer uses it and
reduce-scatters its gradient (ZeRO-3 / FSDP). The batch is split over all devices either way.

The same code runs on one CPU, on fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8),
on a GPU and on a multi-host TPU pod: each process feeds only its own rows and
`jax.make_array_from_process_local_data` assembles the global batch.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"
FSDP_AXIS = "fsdp"


# What a manual launch sets on every process (`initialize_distributed`).
LAUNCH_VARIABLES = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")
# jax's heartbeat timeout (100 s by default): longer than `peers.PEER_TIMEOUT_S`, so that the peers' one line comes
# first; it bounds a silent loss of process 0, which ends the coordination service (`peers`).
JAX_HEARTBEAT_TIMEOUT_S = 45


def initialize_distributed(requested: bool) -> None:
    """Joins a multi-process run when asked to (`requested`, the entry points' --multiprocess) or when
    JAX_COORDINATOR_ADDRESS is set; a no-op otherwise.

    `jax.distributed.initialize()` detects TPU pods, SLURM, Open MPI and Kubernetes by itself; a manual
    launch sets JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process. Where
    neither gives the run's processes, raises ValueError naming what is missing.
    """
    if not (requested or os.environ.get("JAX_COORDINATOR_ADDRESS")):
        return
    launch = ("set JAX_COORDINATOR_ADDRESS=host:port (process 0's), JAX_NUM_PROCESSES and JAX_PROCESS_ID on every "
              "process")
    numbers = {}
    for name in LAUNCH_VARIABLES[1:]:
        try:
            numbers[name] = int(os.environ[name]) if name in os.environ else None
        except ValueError:
            raise ValueError(f"{name}={os.environ[name]!r} is not a whole number; {launch}") from None
    try:
        jax.distributed.initialize(num_processes=numbers["JAX_NUM_PROCESSES"], process_id=numbers["JAX_PROCESS_ID"],
                                   heartbeat_timeout_seconds=JAX_HEARTBEAT_TIMEOUT_S)
    except ValueError as err:  # jax's "coordinator_address should be defined." and its kin
        if "defined" not in str(err):
            raise
        why = "--multiprocess" if requested else "JAX_COORDINATOR_ADDRESS (set, so this is a multi-process run)"
        missing = [name for name in LAUNCH_VARIABLES if not os.environ.get(name)]
        raise ValueError(f"{why} found no cluster to join: {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         "not set and no Cloud TPU pod, SLURM (srun), Open MPI (mpirun) or Kubernetes indexed Job was "
                         f"detected; {launch}") from None


def make_mesh(fsdp: int = 1, devices=None) -> Mesh:
    """A `(devices / fsdp, fsdp)` mesh over `devices` (default: every device of every process).

    Auto axes let XLA propagate shardings from the jit boundary, so the step's reshapes of the
    batch (micro-batches) need no annotations. `fsdp` must divide the device count
    (`train.config_checks.validate` checks it first, naming the config field). On several TPU slices
    (multi-slice, devices with a `slice_index`) the fsdp axis stays inside a slice, on the fast
    inter-chip links, and the data axis spans the slices over the data-center network, which then
    carries only the gradient reduction.
    """
    devices = jax.devices() if devices is None else list(devices)
    count = len(devices)
    if fsdp < 1 or count % fsdp:
        raise ValueError(f"fsdp={fsdp} must be a positive divisor of the device count {count}")
    axis_types = (AxisType.Auto,) * 2
    num_slices = len({getattr(device, "slice_index", 0) for device in devices})
    if num_slices > 1:
        per_slice = count // num_slices
        if per_slice % fsdp:
            raise ValueError(f"fsdp={fsdp} must divide the {per_slice} devices of one slice")
        grid = mesh_utils.create_hybrid_device_mesh((per_slice // fsdp, fsdp), (num_slices, 1), devices)
        return Mesh(grid, (DATA_AXIS, FSDP_AXIS), axis_types=axis_types)
    return jax.make_mesh((count // fsdp, fsdp), (DATA_AXIS, FSDP_AXIS), axis_types=axis_types, devices=devices)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over every device (the data and fsdp axes together)."""
    return NamedSharding(mesh, PartitionSpec((DATA_AXIS, FSDP_AXIS)))


def fsdp_sharding(mesh: Mesh, shape: tuple[int, ...]) -> NamedSharding:
    """An array of `shape` split over the fsdp axis along its largest dimension that the axis size
    divides (the first such, on ties); replicated when none does (scalars, odd sizes)."""
    size = mesh.shape[FSDP_AXIS]
    candidates = [axis for axis, dim in enumerate(shape) if dim % size == 0 and dim >= size]
    if size == 1 or not candidates:
        return replicated(mesh)
    axis = max(candidates, key=lambda a: shape[a])
    spec = [None] * len(shape)
    spec[axis] = FSDP_AXIS
    return NamedSharding(mesh, PartitionSpec(*spec))


def state_sharding(mesh: Mesh, abstract_state):
    """`fsdp_sharding` for every array of a (shape-only) pytree: parameters and their AdamW moments
    have the same shapes, so each moment lives where its parameter does."""
    return jax.tree.map(lambda x: fsdp_sharding(mesh, x.shape), abstract_state)


def global_batch(local_rows: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Assembles the global batch from every process's contiguous share of its rows."""
    def place(x: np.ndarray) -> jax.Array:
        global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)
    return {name: place(x) for name, x in local_rows.items()}


def sum_across_processes(x: np.ndarray) -> np.ndarray:
    """The sum over processes of each process's `x` (same shape everywhere), added in process order so
    every process gets the same bits; `x` itself in a single-process run.

    float64 arrays travel as their raw bits, since collectives without jax_enable_x64 would round them
    to float32.
    """
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils
    x = np.ascontiguousarray(x)
    words = multihost_utils.process_allgather(x.view(np.uint32) if x.dtype.itemsize == 8 else x)
    gathered = np.asarray(words).view(x.dtype).reshape(jax.process_count(), *x.shape)
    return np.sum(gathered, axis=0, dtype=x.dtype)


def sync_processes(tag: str) -> None:
    """A barrier across processes (a no-op in a single-process run): what one process wrote to shared
    storage before it is visible to all after it."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(tag)
