"""Each fused kernel (GPU and TPU, interpreted) under a sharded batch, on 8 fake CPU devices, in one subprocess per
kernel (the device count is fixed when jax starts, and one start serves both checks):
- attention dropout does not depend on how the batch is sharded: on 4 of the devices (the kernel split over the
  batch by `shard_map`, each device running it on its own sequence) outputs and gradients equal the dense kernel's
  on one device with the same key;
- inside a run's sharded train step (data=2 x fsdp=4 mesh) DeBERTa trains exactly like the dense kernel on one
  device."""

import pytest

from tests.helpers import run_on_fake_devices

SCRIPT = r"""
import dataclasses, functools
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from configs import deberta
from deberta_jax.kernels.dense import dense_attention
from deberta_jax.kernels import dispatch
from deberta_jax.train import config_checks, programs, sharding
from tests.kernels.test_kernels import outputs_and_grads
from tests.kernels.test_fused_kernels import max_error, table_inputs

assert jax.device_count() == 8

# Dropout's mask under a batch split over 4 devices.
dropout = dict(dropout_rate=0.3, dropout_key=jax.random.key(1))
terms, v, key_mask = table_inputs(("c2p", "p2c"), 6, n=21, b=4)
mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
rows = NamedSharding(mesh, PartitionSpec("data"))
sharded = jax.device_put((terms.q, terms.k, v, key_mask), rows)
terms = dataclasses.replace(terms, q=sharded[0], k=sharded[1])

def kernel(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return dispatch.attention_kernel(KERNEL, 0)(*args, tile=8, **dropout)

got = outputs_and_grads(jax.jit(kernel), terms, sharded[2], sharded[3])
want = outputs_and_grads(jax.jit(functools.partial(dense_attention, **dropout)), *jax.device_get((terms, v, key_mask)))
error = max_error(got, want)
assert error < 3e-6, error
print("dropout error", error, flush=True)

# A run's train step on a data=2 x fsdp=4 mesh against the dense kernel on one device.
config = deberta.get_config("micro")
config.data.train_files = "unused.txt"
config.model.update(hidden_dropout=0.0, attention_dropout=0.0)
config.train.update(batch_size=16, grad_accum_steps=2)
rng = np.random.default_rng(0)
batches = [dict(input_ids=rng.integers(5, 512, (16, 32)).astype(np.int32), attention_mask=np.ones((16, 32), np.int32),
                labels=rng.integers(5, 512, (16, 32)).astype(np.int32),
                weights=(rng.random((16, 32)) < 0.15).astype(np.float32)) for _ in range(3)]
for batch in batches:
    batch["attention_mask"][3, 20:] = 0

def run(kernel, mesh):
    config.model.attention_kernel = kernel
    run = programs.build(config, config_checks.validate(config, num_devices=mesh.size), mesh)
    state, losses = run.init(), []
    for batch in batches:
        state, metrics = run.train_step(state, sharding.global_batch(batch, run.batch_sharding))
        losses.append(float(metrics["loss"]))
    return losses, state.params

fused_losses, fused = run(KERNEL, sharding.make_mesh(fsdp=4))
dense_losses, dense = run("dense", sharding.make_mesh(1, jax.devices()[:1]))
np.testing.assert_allclose(fused_losses, dense_losses, rtol=1e-5)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5), fused, dense)
print("losses", fused_losses)
"""


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize("kernel", ["pallas", "pallas_tpu"])
def test_dropout_mask_and_sharded_train_step_with_a_fused_kernel_match_one_device(kernel):
    stdout = run_on_fake_devices(["-c", f"KERNEL = {kernel!r}\n" + SCRIPT]).stdout
    assert "dropout error" in stdout and "losses" in stdout
