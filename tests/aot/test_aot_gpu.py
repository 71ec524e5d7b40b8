"""Compiling for NVIDIA GPUs from the CPU (the CUDA plugin, jax[cuda12]; no GPU, no driver): targets named GPU[:COUNT],
the micro train steps compile through XLA's GPU pipeline (Triton fusions) with the executable's own memory figures,
FSDP over an 8-GPU node, the fit verdict and its hints per GPU, and the command line."""

import json
import os
import re
import subprocess
import sys

import jax
import pytest

from configs import bert, deberta
from deberta_jax.aot import analysis, build, chips, text
from deberta_jax.aot.chips import GIB, GPUS, TopologyError
from deberta_jax.model.config import ConfigError
from deberta_jax.train import programs as run_programs
from deberta_jax.train import sharding
from tests.aot.test_aot import assert_memory_is_the_executables
from tests.helpers import REPO


def micro(family=deberta, num_layers=2, **train):
    config = family.get_config("micro")
    config.model.num_layers = num_layers
    config.train.update(train)
    return config


# Compiled for devices this process lacks: kept out of the suite's persistent compilation cache.
pytestmark = pytest.mark.usefixtures("no_persistent_cache")


@pytest.fixture(scope="module")
def h100():
    return chips.target("h100")


@pytest.fixture(scope="module")
def h100_node():
    return chips.target("h100:8")


class KeepCompiled:
    """A lowered program whose executable is kept when `build` compiles it (as in test_aot.py)."""

    def __init__(self, lowered):
        self.lowered, self.compiled = lowered, None

    def compile(self):
        self.compiled = self.lowered.compile()
        return self.compiled


@pytest.fixture(scope="module")
def micro_train_steps(h100):
    """The micro BERT and DeBERTa train steps compiled for one H100 (once per module), with their executables; one
    layer each, a third less to compile."""
    compile_report, kept, reports = build._compile, {}, {}

    def keep(name, lower, *args, **kwargs):
        kept[name] = KeepCompiled(lower())
        return compile_report(name, lambda: kept[name], *args, **kwargs)
    build._compile = keep
    try:
        for family in (bert, deberta):
            train, = build.compile_run(micro(family, num_layers=1), h100, programs=["train"])
            reports[family.__name__.split(".")[-1]] = (train, kept.pop("train step"))
    finally:
        build._compile = compile_report
    return reports


def test_gpu_topology_names():
    assert chips.parse_gpu_topology("h100:8") == (GPUS["h100"], 8)
    assert chips.parse_gpu_topology(" H200 ") == (GPUS["h200"], 1)
    with pytest.raises(TopologyError, match="COUNT is the GPUs of one NVLink node, 1 to 8"):
        chips.parse_gpu_topology("a100:16")
    with pytest.raises(TopologyError, match=r"use GPU\[:COUNT\] with GPU one of \['h100', 'h200', 'a100'\]"):
        chips.target("h100:x")
    with pytest.raises(TopologyError, match=r"use a TPU slice GENERATION:GRID .* or GPU\[:COUNT\]"):
        chips.target("b200")
    with pytest.raises(TopologyError, match="v5e slices are named by a 2-D chip grid"):  # TPU names as before
        chips.target("v5e:4x4x4")
    with pytest.raises(TopologyError, match="a GPU target is one node"):
        chips.target("h100:8", num_slices=2)


def test_a_missing_or_unloaded_cuda_plugin_is_one_line_with_the_fix(monkeypatch):
    import importlib.util

    from jax.experimental import topologies

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("jax_plugins") else find_spec(name, *a))
    with pytest.raises(RuntimeError, match=re.escape(f'pip install "jax[cuda12]=={jax.__version__}"')):
        chips.target("h100")
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)

    def unloaded(**kwargs):
        raise NotImplementedError("topology not implemented for cuda")
    monkeypatch.setattr(topologies, "get_topology_desc", unloaded)
    with pytest.raises(RuntimeError, match="JAX_PLATFORMS=cpu and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 before jax is "
                                           "imported"):
        chips.target("h100")


@pytest.mark.parametrize("name", list(GPUS))
def test_gpu_figures_match_the_xla_target_files(name):
    """Each GPU's published figures and its XLA target (gpu_targets/*.txtpb, package data) agree on memory and
    bandwidth, the file names its source, and XLA's GPU compiler accepts it: one device per GPU, named as the
    driver names the part."""
    chip = GPUS[name]
    text = chips.target_config(chip)
    field = lambda key: re.search(rf"^\s*{key}: (.+)$", text, re.M).group(1)  # noqa: E731
    assert int(field("device_memory_size")) == chip.hbm_bytes
    assert float(field("memory_bandwidth")) == chip.hbm_bandwidth
    assert text.startswith("# NVIDIA ") and "datasheet" in text.split("gpu_device_info")[0]
    node = chips.target(f"{name}:8")
    assert node.num_chips == 8 and node.platform == "gpu" and node.name == f"{name}:8"
    assert {d.device_kind for d in node.devices} == {field("device_description_str").strip('"')}
    # One process drives the node's 8 GPUs, as train.py runs on it (the topology 1x1x8; 8x1x1 would be 8 hosts).
    assert {d.process_index for d in node.devices} == {0}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "deberta"])
def test_micro_train_step_compiles_for_h100_with_the_executables_memory(micro_train_steps, h100, family):
    train, kept = micro_train_steps[family]
    assert train.cost is not None and train.fits and train.num_chips == 1, train.error
    config = micro(bert if family == "bert" else deberta, num_layers=1)
    # The program compiled is the one train.py builds (the same StableHLO), "auto" resolved for a GPU.
    model_config = build.model_config_for(config, h100)
    if family == "deberta":
        assert model_config.relative_terms == "shift"
    run = run_programs.build(config, model_config, sharding.make_mesh(1, h100.devices))
    state = run_programs.abstract_with_sharding(run.abstract_state, run.state_sharding)
    by_hand = run.train_step.lower(state, run_programs.abstract_batch(8, 32, run.batch_sharding))
    assert by_hand.as_text() == kept.lowered.as_text()
    assert_memory_is_the_executables(train.cost, kept.compiled)
    assert '"__triton' in kept.compiled.as_text()  # XLA's GPU pipeline: matmuls and reductions as Triton fusions
    # No cost analysis on GPU: the compute bound is the model's FLOPs, the memory bound unknown, no MFU ceiling.
    assert kept.compiled.cost_analysis() is None
    assert train.cost.flops is None and train.cost.bytes_accessed is None
    line = train.roofline
    assert line.memory_s is None and line.compute_s == train.model_flops / GPUS["h100"].peak_flops
    assert line.bound == "compute" and train.mfu is None and train.tokens_per_s > 0
    row = train.row()
    assert row["tflop"] is None and row["memory_ms"] is None and row["mfu"] is None and row["hbm_gib"] > 0
    assert build.fit_hints(train, config, h100) == []


@pytest.mark.slow
def test_fsdp_over_an_8_gpu_node(h100_node):
    config = micro(bert, batch_size=16)
    config.mesh.fsdp = 8
    mesh = sharding.make_mesh(8, h100_node.devices)
    assert dict(mesh.shape) == {"data": 1, "fsdp": 8}
    train, = build.compile_run(config, h100_node, programs=["train"])
    assert train.cost is not None and train.fits and train.num_chips == 8, train.error
    # The parameters are all-gathered and the gradients reduce-scattered over NVLink inside the step.
    assert train.cost.collective_bytes > 0 and train.roofline.ici_s > 0
    assert train.roofline.bound in ("compute", "nvlink")


@pytest.mark.slow
def test_a_program_too_large_for_an_a100_gets_the_gpu_knobs():
    """A small model with a large batch: 5,120 rows of 512 tokens of micro BERT need about 93 GiB per GPU (a
    larger batch compiles slower: XLA's rematerialization works harder). XLA's GPU compiler compiles any size; the
    verdict compares its memory with the GPU's."""
    a100 = chips.target("a100")
    config = micro(bert, batch_size=5120)
    config.data.seq_len = 512
    train, = build.compile_run(config, a100, programs=["train"])
    assert train.cost is not None and not train.fits and train.oom is None
    assert train.cost.hbm_bytes > GPUS["a100"].hbm_bytes == 80 * GIB
    hints = build.fit_hints(train, config, a100)
    assert re.match(r"train step needs [\d.]+ GiB per GPU, [\d.]+ GiB more than the 80 GiB of an a100 GPU", hints[0])
    assert not any("pallas_tpu" in h for h in hints)
    # BERT's micro config trains with attention dropout, which the fused GPU kernel may not draw: the hint says
    # whatever train.py would accept with it.
    kernel = [h for h in hints if "--config.model.attention_kernel=pallas" in h]
    assert len(kernel) == 1 and "fused GPU kernel" in kernel[0]
    assert any("--config.model.remat=dots_no_batch" in h for h in hints)
    assert any("--config.train.grad_accum_steps=2" in h for h in hints)
    assert "DOES NOT FIT" in text.describe(train)


def _report(chip, needed_gib, argument_gib, name="train step", num_chips=1):
    cost = analysis.ProgramCost(
        argument_bytes=int(argument_gib * GIB), output_bytes=0, alias_bytes=0,
        temp_bytes=int((needed_gib - argument_gib) * GIB), code_bytes=0, flops=None, bytes_accessed=None,
        collective_bytes=0, gathers=0, largest_gather_bytes=0, loops=0)
    return analysis.ProgramReport(name, chip, num_chips, 1024, 1e12, 1.0, cost=cost)


def test_fit_hints_per_gpu(h100):
    """The hints read from a report directly: a single GPU whose training state is large is told to spread it
    over a node's 8 GPUs; a program between 75% and 100% of the GPU fits, with the variable that lets JAX take
    that much; the TPU kernel is refused on GPU."""
    config = micro(bert)
    big_state = _report(GPUS["h100"], 100, 40)
    hints = build.fit_hints(big_state, config, h100)
    assert "more than the 79.1 GiB of a h100 GPU (40.00 GiB arguments" in hints[0]
    assert hints[1].startswith("--topology h100:8 --config.mesh.fsdp=8 (now h100): a node's 8 GPUs")
    near_full = _report(GPUS["h100"], 70, 1)
    assert near_full.fits and near_full.above_default_gpu_memory
    assert build.fit_hints(near_full, config, h100) == [
        "train step needs 70.00 GiB per GPU, 88% of its memory, more than the 75% JAX's GPU client takes by default: "
        "run it with XLA_PYTHON_CLIENT_MEM_FRACTION=0.91."]
    assert build.fit_hints(_report(GPUS["h100"], 50, 1), config, h100) == []
    config.model.attention_kernel = "pallas_tpu"
    with pytest.raises(ConfigError, match="'pallas_tpu' cannot be compiled for h100: the fused TPU kernel is Mosaic"):
        build.compile_run(config, h100, programs=["train"])
    assert build.LENGTH_KERNELS["gpu"] == ("dense", "blockwise", "pallas")
    assert build.LENGTH_KERNELS["tpu"] == ("dense", "blockwise", "pallas_tpu")


@pytest.mark.slow
def test_length_forward_kernels_on_gpu(h100):
    """The GPU's fused kernel is compiled for the length forward (the refusal of 'pallas' is TPU's); the TPU's is a
    row saying why not."""
    model_config = build.model_config_for(micro(), h100)
    pallas = build._compile_length_forward(model_config, "pallas", None, 256, 512, h100)
    assert pallas.cost is not None and pallas.fits, pallas.error
    tpu_kernel = build._compile_length_forward(model_config, "pallas_tpu", None, 256, 512, h100)
    assert tpu_kernel.cost is None and "the fused TPU kernel is Mosaic (TPU) code" in tpu_kernel.error


def _command(*args, tmp_path=None):
    """python -m deberta_jax.aot with an environment that sets neither JAX_PLATFORMS nor the CUDA check's variable:
    the command sets both itself before jax is imported."""
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", chips.SKIP_CUDA_CHECK_VARIABLE)}
    env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
    return subprocess.run([sys.executable, "-m", "deberta_jax.aot", "--config", "configs/deberta.py:micro", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_command_prints_memory_per_gpu(tmp_path):
    out = tmp_path / "aot.json"
    result = _command("--topology", "h100", "--programs=train", "--config.model.num_layers=1", f"--out={out}")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "deberta.py:micro model.num_layers=1 on h100 (1 GPU; mesh data x fsdp = 1 x 1)" in result.stdout
    assert "relative terms shift" in result.stdout
    row, = json.loads(out.read_text())
    assert row["program"] == "train step" and row["chip"] == "h100" and row["fits"] and row["tflop"] is None
    assert f"memory per GPU  {row['hbm_gib']:.2f} of 79.1 GiB (fits" in result.stdout
    assert "HBM time unknown" in result.stdout


def test_command_refuses_a_bad_name_in_one_line():
    result = _command("--topology", "h100:16")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "error: topology 'h100:16': COUNT is the GPUs of one NVLink node, 1 to 8, e.g. h100:8"]
