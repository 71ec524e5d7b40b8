"""Checks and fixtures shared by several test modules."""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from configs import deberta
from deberta_jax.data.text import load_documents
from deberta_jax.data.tokenizer import save_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
BROWN = REPO.parent / "shared" / "data" / "brown"
# The short runs of the reliability and user-error tests: `micro` DeBERTa on small synthetic data, no files.
MICRO_STEPS = 8
MICRO_TRAIN = "synthetic:markov:train:docs=40,doc_len=256"
MICRO_VALID = "synthetic:markov:validation:docs=4,doc_len=256"


def overrides(cache_dir, **train_fields) -> dict:
    """The micro preset's changes for these runs, as flattened config keys."""
    values = {"data.train_files": MICRO_TRAIN, "data.eval_files": MICRO_VALID, "data.cache_dir": str(cache_dir),
              "train.num_steps": MICRO_STEPS, "train.warmup_steps": 2, "train.log_every": 1, "train.eval_every": 4,
              "train.checkpoint_every": 2, "train.keep_checkpoints": 3}
    values.update({f"train.{k}": v for k, v in train_fields.items()})
    return values


def micro_config(cache_dir, **train_fields):
    config = deberta.get_config("micro")
    config.update_from_flattened_dict(overrides(cache_dir, **train_fields))
    return config


def variant_config(variant, size: str, *overrides):
    """A sweep variant's training config as the runner's command line builds it: its model-family config
    (`variant.config`, BERT's or DeBERTa's) at `size`, then each of `overrides` (ConfigDicts, e.g. a sweep's common
    overrides), then the variant's own."""
    from configs import bert
    from configs.sweeps import variants
    from deberta_jax.study import sweep

    config = {variants.BERT: bert, variants.DEBERTA: deberta}[variant.config].get_config(size)
    for tree in (*overrides, variant.overrides):
        config.update_from_flattened_dict(sweep.flatten(tree.to_dict()))
    return config


def sweep_variant_configs(seq_len: int, **changes) -> dict[str, dict]:
    """`ModelConfig` fields of every run family the sweeps train (`configs/sweeps/variants.py`: the core set and the
    absolute baselines) at the micro size, as trained at `seq_len`, with `changes`: the one variant list, which
    tests read rather than repeat."""
    from configs.sweeps import variants

    out = {}
    for variant in variants.core() + variants.absolute_baselines():
        config = variant_config(variant, "micro")
        config.data.seq_len = seq_len
        out[variant.name] = dict(config.model.to_dict(), trained_length=seq_len, **changes)
    return out


def write_brown_slices(root, train_chars: int, valid_chars: int, vocab_size: int):
    """The first whole documents of Brown train/valid as `root/{train,valid}.txt` plus a small tokenizer."""
    for name, size in (("train.txt", train_chars), ("valid.txt", valid_chars)):
        with open(os.path.join(BROWN, name), encoding="utf-8") as f:
            text = f.read(size)
        (root / name).write_text(text[: text.rfind("\n\n")] + "\n")
    save_tokenizer(train_tokenizer(load_documents(str(root / "train.txt")), vocab_size), root / "tokenizer.json")
    return root


def assert_padding_invariant(model, ids: np.ndarray, pad: int = 7, atol: float = 2e-5):
    """Appending `pad` padding tokens must not change the logits at the real tokens."""
    b, n = ids.shape
    base = model.mlm_logits(ids, np.ones_like(ids))
    padded = np.concatenate([ids, np.zeros((b, pad), np.int32)], axis=1)
    mask = np.concatenate([np.ones_like(ids), np.zeros((b, pad), np.int32)], axis=1)
    np.testing.assert_allclose(model.mlm_logits(padded, mask)[:, :n], base, atol=atol)


def model_params(model) -> dict:
    """Every `nnx.Param` of `model` as a numpy array, keyed by its dotted path
    (e.g. "encoder.layers.0.attention.query_proj.bias")."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): np.array(var[...]) for path, var in flat}


def set_model_params(model, values) -> None:
    """Overwrite the `nnx.Param`s named in `values` (dotted paths as in `model_params`) through nnx state.

    Unknown paths and shape changes raise, so a test cannot silently perturb nothing.
    """
    state = nnx.state(model, nnx.Param)
    pure = nnx.to_pure_dict(state)
    for key, value in values.items():
        *parents, leaf = (int(p) if p.isdigit() else p for p in key.split("."))
        node = pure
        for part in parents:
            node = node[part]
        old = node[leaf]
        if np.shape(old) != np.shape(value):
            raise ValueError(f"{key}: shape {np.shape(value)} does not match the parameter's {np.shape(old)}")
        node[leaf] = jnp.asarray(value, dtype=old.dtype)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)


def files_after_kills(command: list[str], delays, watched, cwd=None) -> list[dict[str, bytes]]:
    """Starts `command` once per delay and SIGKILLs it after that many seconds (unless it ended first); returns
    what the directory `watched` holds after each (name -> bytes; a folder, such as a killed writer's temporary
    one, -> None), for fault tests of writers."""
    seen = []
    for delay in delays:
        process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            process.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        seen.append({path.name: path.read_bytes() if path.is_file() else None for path in watched.iterdir()})
    return seen


def run_on_fake_devices(args: list[str], count: int = 8, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `python *args` from the repository with `count` fake CPU devices (fixed when jax starts, hence a
    process of its own); fails the test with the process's stderr when it fails."""
    flags = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={count}"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def bias_params(cfg, seed: int = 0) -> dict:
    """A bias scheme's parameters (`biases.parameters_of(cfg)`) at their initial values moved by a random amount, so
    that a test does not pass only because the initial values are symmetric or equal across heads."""
    import jax

    from deberta_jax.model import biases
    keys = jax.random.split(jax.random.key(seed), 2 * max(len(biases.parameters_of(cfg)), 1))
    return {name: parameter.init(cfg, keys[2 * i]) + 0.3 * jax.random.normal(keys[2 * i + 1],
                                                                               parameter.init(cfg, keys[2 * i]).shape)
            for i, (name, parameter) in enumerate(biases.parameters_of(cfg).items())}


def run_with_store_paused(process: subprocess.Popen, store, ready: str) -> tuple[str, str, float]:
    """Waits for `process` (text pipes on stdin, stdout, stderr) to print `ready`, pauses `store` (a server fixture
    with `pause`/`resume`) and lets the process go on (a line on stdin): the store stops answering mid-call. Returns
    its stdout, its stderr and the seconds it took to end after the pause; the store is resumed and the process
    killed whatever happens."""
    try:
        line = process.stdout.readline().strip()
        assert line == ready, (line, process.stderr.read()[-3000:] if process.poll() is not None else "")
        store.pause()
        paused = time.monotonic()
        process.stdin.write("go\n")
        process.stdin.flush()
        out, err = process.communicate(timeout=60)
        return out, err, time.monotonic() - paused
    finally:
        store.resume()
        process.kill()
