"""The fused TPU kernel inside a run's sharded train step: on 8 fake CPU devices (data=2 x fsdp=4 mesh, the
kernel split over the batch by `shard_map`) DeBERTa trains exactly like the dense kernel on one device. A
subprocess, because the device count is fixed when jax starts."""

import pytest

from tests.helpers import run_on_fake_devices

SCRIPT = r"""
import jax, numpy as np
from configs import deberta
from deberta_jax.train import config_checks, programs, sharding

assert jax.device_count() == 8
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

fused_losses, fused = run("pallas_tpu", sharding.make_mesh(fsdp=4))
dense_losses, dense = run("dense", sharding.make_mesh(1, jax.devices()[:1]))
np.testing.assert_allclose(fused_losses, dense_losses, rtol=1e-5)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5), fused, dense)
print("losses", fused_losses)
"""


@pytest.mark.slow
def test_sharded_train_step_with_the_tpu_kernel_matches_one_device():
    assert "losses" in run_on_fake_devices(["-c", SCRIPT]).stdout
