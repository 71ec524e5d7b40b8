"""FSDP: parameters and optimizer state split over the mesh's fsdp axis train exactly like one device.

The comparison runs in a subprocess with 8 fake CPU devices: a (data=2, fsdp=4) mesh with the
shardings `train.py` uses, against the same steps on a single device, on the same batches (with
gradient accumulation, so micro-batches are cut from a batch split over both mesh axes).
"""

import pytest

from configs import deberta
from deberta_jax.train import config_checks
from tests.helpers import run_on_fake_devices

SCRIPT = r"""
import jax, jax.numpy as jnp, numpy as np
from configs import deberta
from deberta_jax.train import optim
from deberta_jax.train import sharding
from deberta_jax.train import steps
from deberta_jax.model.config import ModelConfig

assert jax.device_count() == 8
config = deberta.get_config("micro")
config.model.hidden_dropout = config.model.attention_dropout = 0.0
model_config = ModelConfig.from_dict(dict(config.model.to_dict(), trained_length=32))
schedule = optim.learning_rate_schedule(1e-3, 2, 10, "linear")
optimizer = optim.make_optimizer(config.train, schedule, model_config)
init = steps.make_init_fn(model_config, optimizer, seed=0)
step = steps.make_train_step(steps.model_graphdef(model_config), optimizer, schedule, seed=0,
                                 grad_accum_steps=2, mask_prob=0.15)
rng = np.random.default_rng(0)
batches = [dict(input_ids=rng.integers(5, 512, (16, 32)).astype(np.int32), attention_mask=np.ones((16, 32), np.int32),
                labels=rng.integers(5, 512, (16, 32)).astype(np.int32),
                weights=(rng.random((16, 32)) < 0.15).astype(np.float32)) for _ in range(4)]

def run(mesh):
    abstract = jax.eval_shape(init)
    if mesh is None:
        jitted, state = jax.jit(step), jax.jit(init)()
        place = lambda b: b
    else:
        state_sharding = sharding.state_sharding(mesh, abstract)
        batch_sharding = sharding.batch_sharding(mesh)
        jitted = jax.jit(step, in_shardings=(state_sharding, batch_sharding),
                         out_shardings=(state_sharding, sharding.replicated(mesh)), donate_argnums=0)
        state = jax.jit(init, out_shardings=state_sharding)()
        place = lambda b: sharding.global_batch(b, batch_sharding)
    losses = []
    for batch in batches:
        state, metrics = jitted(state, place(batch))
        losses.append(float(metrics["loss"]))
    return losses, state

mesh = sharding.make_mesh(fsdp=4)
assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
P = jax.sharding.PartitionSpec
for shape, spec in [((512, 32), P("fsdp", None)), ((32, 64), P(None, "fsdp")), ((32,), P("fsdp")),
                    ((6,), P()), ((), P())]:
    assert sharding.fsdp_sharding(mesh, shape).spec == spec, (shape, sharding.fsdp_sharding(mesh, shape).spec)
fsdp_losses, fsdp_state = run(mesh)
one_losses, one_state = run(None)
words = fsdp_state.params["embeddings"]["word_embeddings"]
assert words.addressable_shards[0].data.shape == (512 // 4, 32), words.sharding  # stored 4 ways
mu = fsdp_state.opt_state[1][0].mu["embeddings"]["word_embeddings"]
assert mu.addressable_shards[0].data.shape == (512 // 4, 32), mu.sharding  # AdamW moments too
np.testing.assert_allclose(fsdp_losses, one_losses, rtol=1e-5, atol=1e-5)
jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5),
             fsdp_state.params, one_state.params)
print("fsdp losses", fsdp_losses)
"""


@pytest.mark.slow
def test_fsdp_on_eight_devices_matches_one_device():
    assert "fsdp losses" in run_on_fake_devices(["-c", SCRIPT], timeout=300).stdout


def test_fsdp_must_divide_the_device_count():
    config = deberta.get_config("micro")
    config.data.train_files = "unused.txt"
    config.mesh.fsdp = 3
    with pytest.raises(config_checks.ConfigError, match="mesh.fsdp=3 must divide the number of devices"):
        config_checks.validate(config, num_devices=8)
