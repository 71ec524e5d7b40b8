"""Compiling for TPU slices from the CPU (libtpu, no TPU): the micro train step fits a small v5e slice, and the
command's figures are the compiled executable's own."""

import json
import os
import subprocess
import sys

import jax
import pytest

from configs import bert, deberta
from deberta_jax.aot import analysis, build
from deberta_jax.aot.chips import CHIPS, GIB, TopologyError, parse_topology, tpu_slice
from deberta_jax.study import length_study
from deberta_jax.train import config_checks, sharding
from deberta_jax.train import programs as run_programs
from tests.helpers import REPO


def micro(family=deberta, **train):
    config = family.get_config("micro")
    config.train.update(train)
    return config


# Compiled for devices this process lacks: kept out of the suite's persistent compilation cache.
pytestmark = pytest.mark.usefixtures("no_persistent_cache")


@pytest.fixture(scope="module")
def v5e_2x2():
    return tpu_slice("v5e:2x2")


def test_topology_names():
    assert parse_topology("v5p:2x2x4") == (CHIPS["v5p"], (2, 2, 4))
    with pytest.raises(TopologyError, match="3-D chip grid"):
        parse_topology("v4:4x4")
    with pytest.raises(TopologyError, match="GENERATION:GRID"):
        parse_topology("v7x:2x2")


@pytest.mark.parametrize("topology,kind", [("v4:2x2x1", "TPU v4"), ("v5p:2x2x1", "TPU v5"), ("v6e:2x2", "TPU v6 lite")])
def test_every_generation_gives_one_device_per_chip(topology, kind):
    tpu = tpu_slice(topology)
    assert tpu.num_chips == 4 and {d.device_kind for d in tpu.devices} == {kind}


class KeepCompiled:
    """A lowered program whose executable is kept when `build` compiles it, so a test can read the executable a
    report came from without compiling it a second time (the costly part)."""

    def __init__(self, lowered):
        self.lowered, self.compiled = lowered, None

    def compile(self):
        self.compiled = self.lowered.compile()
        return self.compiled


@pytest.mark.slow
def test_micro_train_step_fits_and_reports_the_executables_memory(v5e_2x2, monkeypatch):
    config = micro(batch_size=16)
    config.mesh.fsdp = 2
    kept = {}
    compile_report = build._compile

    def keep(name, lower, *args, **kwargs):
        kept[name] = KeepCompiled(lower())
        return compile_report(name, lambda: kept[name], *args, **kwargs)
    monkeypatch.setattr(build, "_compile", keep)
    train, = build.compile_run(config, v5e_2x2, programs=["train"])
    assert train.cost is not None and train.fits and train.num_chips == 4

    # The same program lowered by hand, as train.py builds it, is the one compiled (the same StableHLO, shardings
    # included), and the report's bytes are that executable's memory_analysis().
    run = run_programs.build(config, build.model_config_for(config, v5e_2x2), sharding.make_mesh(2, v5e_2x2.devices))
    state = run_programs.abstract_with_sharding(run.abstract_state, run.state_sharding)
    by_hand = run.train_step.lower(state, run_programs.abstract_batch(16, 32, run.batch_sharding))
    assert by_hand.as_text() == kept["train step"].lowered.as_text()
    compiled = kept["train step"].compiled
    assert_memory_is_the_executables(train.cost, compiled)
    assert train.cost.flops == compiled.cost_analysis()["flops"]
    # FSDP: the parameters are all-gathered and the gradients reduce-scattered inside the step.
    assert train.cost.collective_bytes > 0
    assert 0 < train.mfu < 1 and train.roofline.seconds > 0


@pytest.mark.slow
def test_model_flops_match_the_compiled_matmuls(v5e_2x2):
    """The analytic count MFU divides by agrees with XLA's count of the compiled forward (one chip, no remat):
    a formula that forgot the position terms or the head would be off by far more than the 10% allowed for the
    element-wise work XLA also counts."""
    config = micro()
    config.model.update(hidden_size=128, intermediate_size=512, num_heads=4)
    model_config = config_checks.validate(config, num_devices=4)
    # 4 rows of 256 (1024 tokens), not eval.py's 16: the compile time grows with the rows (29 s at 16, 3 s at 4),
    # the ratio barely does (0.981 at 16 rows, 0.982 at 4; only a single row, where the batch-independent work is
    # not amortized, moves it, to 1.09).
    report = build._compile_length_forward(model_config, "dense", None, 256, 4 * 256, v5e_2x2)
    assert report.cost is not None
    assert 0.9 < report.cost.flops / report.model_flops < 1.1, (report.cost.flops, report.model_flops)


@pytest.mark.slow
def test_a_program_that_does_not_fit_names_the_knobs():
    tpu = tpu_slice("v5e:1x1")
    config = micro(bert, batch_size=2048)
    config.data.seq_len = 512
    train, = build.compile_run(config, tpu, programs=["train"])
    assert not train.fits and train.oom is not None  # libtpu refuses it, naming what it needed
    assert train.oom.required_bytes > train.oom.available_bytes > 15 * GIB
    hints = build.fit_hints(train, config, tpu)
    assert "GiB libtpu can use on a v5e chip" in hints[0]
    assert any("--config.model.remat=dots_no_batch" in h for h in hints)
    assert any("--config.train.grad_accum_steps=2" in h for h in hints)


def test_multi_slice_mesh_keeps_fsdp_inside_a_slice():
    """FSDP's all-gathers stay on a slice's inter-chip links; only the data axis crosses slices."""
    tpu = tpu_slice("v5e:2x2", num_slices=2)
    assert tpu.num_chips == 8 and tpu.name == "v5e:2x2 x 2 slices"
    mesh = sharding.make_mesh(4, tpu.devices)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4}
    assert [{device.slice_index for device in group} for group in mesh.devices] == [{0}, {1}]


def test_hlo_census_counts_gathers_and_collective_bytes():
    hlo = """
  %gather.1 = f32[8,128]{1,0} gather(f32[64,128]{1,0} %p, s32[8,1]{1,0} %i), offset_dims={1}
  %fusion.3 = bf16[4,4]{1,0} fusion(%a), kind=kLoop, calls=%fused_gather
  %gather.7 = bf16[2,2]{1,0} gather(bf16[4,2]{1,0} %q, s32[2,1]{1,0} %j)
  %all-gather-start = (bf16[16,32]{1,0}, bf16[64,32]{1,0}) all-gather-start(bf16[16,32]{1,0} %w)
  %reduce-scatter.2 = f32[16,32]{1,0} reduce-scatter(f32[64,32]{1,0} %g), dimensions={0}
  %all-reduce.4 = (f32[], f32[10]{0}) all-reduce(f32[] %x, f32[10]{0} %y)
  %while.9 = (s32[], f32[8]{0}) while((s32[], f32[8]{0}) %t), condition=%c, body=%b
"""
    census = analysis.hlo_census(hlo)
    assert (census["gathers"], census["loops"], census["largest_gather_bytes"]) == (2, 1, 8 * 128 * 4)
    assert census["collective_bytes"] == 64 * 32 * 2 + 16 * 32 * 4 + (4 + 40)


@pytest.mark.slow
@pytest.mark.long
def test_command_prints_and_writes_the_figures(tmp_path):
    out = tmp_path / "aot.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_ENABLE_COMPILATION_CACHE": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "deberta_jax.aot", "--config", "configs/deberta.py:micro", "--topology", "v5e:2x2",
         "--config.model.remat=full", "--config.model.num_layers=1", "--length_kernels=blockwise", f"--out={out}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # one layer: a quarter less to compile
    assert result.returncode == 0, result.stderr[-2000:]
    assert "deberta.py:micro model.remat=full model.num_layers=1 on v5e:2x2 (4 chips" in result.stdout
    rows = json.loads(out.read_text())
    assert [r["program"] for r in rows] == ["train step", "eval step", "length forward 256 (blockwise)"]
    assert all(r["fits"] and r["hbm_gib"] > 0 and r["step_ms"] > 0 for r in rows)
    assert f"{rows[0]['hbm_gib']:.2f} of 16 GiB (fits" in result.stdout


def test_suite_runs_on_cpu_jax():
    """libtpu is installed for these compiles; the suite itself must still run on the CPU backend."""
    assert jax.default_backend() == "cpu"


@pytest.mark.slow
@pytest.mark.parametrize("topology", ["v5e:2x2", "v5p:2x2x1"])
def test_fused_tpu_kernel_compiles_into_the_train_step(topology):
    """DeBERTa's train step with attention_kernel='pallas_tpu' and the published attention dropout (0.1, drawn inside
    the kernels) compiles for v5e and v5p (Mosaic lowers the kernels forward and backward), and its optimized program
    holds no gather whose output grows with N^2: the only gathers left are the per-distance table expansion (O(N d))
    and the embeddings'."""
    config = micro(batch_size=8)
    config.data.seq_len = 256
    config.model.update(attention_kernel="pallas_tpu", num_layers=1)  # one layer: a quarter less to compile
    assert config.model.attention_dropout == 0.1
    tpu = tpu_slice(topology)
    train, = build.compile_run(config, tpu, programs=["train"])
    assert train.cost is not None, train.error
    n = config.data.seq_len
    assert 0 < train.cost.largest_gather_bytes < 4 * n * n  # less than one float32 [N, N] score matrix
    # XLA counts the kernels' work through their cost estimates: about the model's FLOPs or more (recompute).
    assert train.cost.flops > 0.9 * train.model_flops / train.num_chips


@pytest.mark.slow
def test_length_forward_compiles_with_the_tpu_kernel_under_every_length_method(v5e_2x2):
    """The 8x forward of a model trained with attention dropout, with the fused TPU kernel as trained and under each
    length method (the temperature, the window with and without its global tokens, and interpolated distances
    compile for a TPU); a method with nothing to act on is a row saying why not."""
    config = micro()
    assert config.model.attention_dropout > 0
    config.model.update(attention_kernel="pallas_tpu", num_layers=1)  # one layer: a quarter less to compile
    reports = build.compile_run(config, v5e_2x2, programs=["length"], length_kernels=["pallas_tpu"],
                                length_methods=list(length_study.LENGTH_METHODS), tokens_per_batch=256)
    by_name = {report.name: report for report in reports}
    methods = ["log_length", "window", "window_global", "interpolate_distances"]
    assert list(by_name) == ["length forward 256 (pallas_tpu)",
                             *(f"length forward 256 (pallas_tpu, {method})" for method in methods)]
    for method in ("", *(f", {method}" for method in methods)):
        report = by_name[f"length forward 256 (pallas_tpu{method})"]
        assert report.cost is not None and report.fits, (method, report.error)
    bert_config = build.model_config_for(micro(bert), v5e_2x2)  # no relative distances to interpolate
    nothing = build._compile_length_forward(bert_config, "pallas_tpu", "interpolate_distances", 256, 256, v5e_2x2)
    assert nothing.cost is None and "has nothing to act on" in nothing.error
    with pytest.raises(ValueError, match="length methods \\['far'\\] are unknown"):
        build.compile_run(config, v5e_2x2, programs=["length"], length_methods=["far"])


def assert_memory_is_the_executables(cost, compiled):
    """A report's memory figures are the compiled executable's own, its donated state counted once."""
    memory = compiled.memory_analysis()
    assert cost.temp_bytes == memory.temp_size_in_bytes
    assert cost.argument_bytes == memory.argument_size_in_bytes
    assert cost.alias_bytes == memory.alias_size_in_bytes > 0  # the state is donated
    assert cost.hbm_bytes == (memory.argument_size_in_bytes + memory.output_size_in_bytes
                              - memory.alias_size_in_bytes + memory.temp_size_in_bytes
                              + memory.generated_code_size_in_bytes)
