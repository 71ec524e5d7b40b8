"""Attention dropout in the fused TPU kernel does not depend on how the batch is sharded: on 4 fake CPU devices
(the kernel split over the batch by `shard_map`, each device running it on its own sequence) outputs and gradients
equal the dense kernel's on one device with the same key. A subprocess, because the device count is fixed when jax
starts."""

from tests.helpers import run_on_fake_devices

SCRIPT = r"""
import dataclasses, functools
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from deberta_jax.kernels.dense import dense_attention
from deberta_jax.kernels.pallas_tpu import pallas_tpu_attention
from tests.kernels.test_kernels import outputs_and_grads
from tests.kernels.test_pallas_tpu import max_error, table_inputs

assert jax.device_count() == 4
dropout = dict(dropout_rate=0.3, dropout_key=jax.random.key(1))
terms, v, key_mask = table_inputs(("c2p", "p2c"), 6, n=21, b=4)
mesh = Mesh(np.array(jax.devices()), ("data",))
rows = NamedSharding(mesh, PartitionSpec("data"))
sharded = jax.device_put((terms.q, terms.k, v, key_mask), rows)
terms = dataclasses.replace(terms, q=sharded[0], k=sharded[1])

def kernel(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return pallas_tpu_attention(*args, tile=8, **dropout)

got = outputs_and_grads(jax.jit(kernel), terms, sharded[2], sharded[3])
want = outputs_and_grads(jax.jit(functools.partial(dense_attention, **dropout)), *jax.device_get((terms, v, key_mask)))
error = max_error(got, want)
assert error < 3e-6, error
print("error", error)
"""


def test_dropout_mask_does_not_depend_on_the_sharding():
    assert "error" in run_on_fake_devices(["-c", SCRIPT], count=4).stdout
