"""Data parallelism: one mesh axis over all devices, replicated parameters, batches split on "data".

The same code runs on one CPU, on fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8),
on a GPU and on a multi-host TPU pod: each process feeds only its own rows and
`jax.make_array_from_process_local_data` assembles the global batch.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

DATA_AXIS = "data"


def data_mesh() -> Mesh:
    """A 1-D mesh over every device of every process.

    Auto axes let XLA propagate shardings from the jit boundary, so the step's reshapes of the
    batch (micro-batches) need no annotations.
    """
    return jax.make_mesh((jax.device_count(),), (DATA_AXIS,), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Leading (batch) axis split over the data axis."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def global_batch(local_rows: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Assembles the global batch from every process's contiguous share of its rows."""
    def place(x: np.ndarray) -> jax.Array:
        global_shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.make_array_from_process_local_data(sharding, x, global_shape)
    return {name: place(x) for name, x in local_rows.items()}
