"""Compiling a run's programs for a TPU slice or a GPU node from this CPU: the train step and eval step exactly as
`train.py` builds them (`deberta_jax.train.programs`), and the length study's forward pass as `eval.py` runs it
(`deberta_jax.study.scoring.score_function`, one chip per process, at a multiple of the training length), for the
model as trained and under each requested length method (`length_study.LENGTH_METHODS`, `eval.py --methods`).

Nothing executes: each program is lowered against shapes with shardings and compiled by libtpu or by XLA's GPU
compiler (the CUDA plugin, Triton included), and `deberta_jax.aot.analysis` reads the executable.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from jax.sharding import SingleDeviceSharding
from ml_collections import config_dict

from deberta_jax.aot import analysis
from deberta_jax.aot.chips import GIB, JAX_GPU_MEMORY_FRACTION, MAX_GPUS_PER_NODE, Target
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.model.flops import model_flops
from deberta_jax.study import length_study, scoring
from deberta_jax.train import config_checks, sharding, steps
from deberta_jax.train import programs as run_programs

PROGRAMS = ("train", "eval", "length")
# The kernels the length study's forward is compiled with by default, per platform: each platform's fused kernel
# ('pallas_tpu' is Mosaic (TPU) code, 'pallas' Triton (GPU) code; neither has the other's lowering).
LENGTH_KERNELS = {"tpu": ("dense", "blockwise", "pallas_tpu"), "gpu": ("dense", "blockwise", "pallas")}
# The fused kernel of each platform, and what the other one's would do there.
FUSED_KERNEL = {"tpu": "pallas_tpu", "gpu": "pallas"}
_FOREIGN_KERNEL = {
    "tpu": ("pallas", "the fused kernel is Triton (GPU) code; on TPU Pallas would interpret it tile by tile, which is "
            "not a TPU program worth measuring"),
    "gpu": ("pallas_tpu", "the fused TPU kernel is Mosaic (TPU) code; on a GPU Pallas would interpret it tile by "
            "tile, which is not a GPU program worth measuring (the GPU's fused kernel is 'pallas')"),
}


def _compile(name: str, lower: Callable, tpu: Target, *, num_chips: int, tokens: int, flops: float
             ) -> analysis.ProgramReport:
    start = time.perf_counter()
    try:
        compiled = lower().compile()
    except Exception as err:  # noqa: BLE001 - XLA reports every failure (memory included) as one error type
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return analysis.ProgramReport(name, tpu.chip, num_chips, tokens, flops, time.perf_counter() - start,
                                      error=message[:400], oom=analysis.out_of_memory(str(err)))
    return analysis.ProgramReport(name, tpu.chip, num_chips, tokens, flops, time.perf_counter() - start,
                                  cost=analysis.program_cost(compiled))


def length_forward_config(model_config: ModelConfig, kernel: str, method: str | None = None) -> ModelConfig | None:
    """The model as the length study scores it past the training length with `kernel`, under the length method
    `method` (None: as trained): a learned absolute table repeats its last trained row ('clip', one of the study's
    policies that reaches any length). None where the method has nothing to act on (as `length_study.with_methods`
    skips it); `ConfigError` where the kernel cannot run the model so."""
    policy = "clip" if model_config.uses_absolute_table else model_config.absolute_position_policy
    options = dict(attention_kernel=kernel, absolute_position_policy=policy)
    if method is not None:
        method_options = length_study.LENGTH_METHODS[method](model_config)
        if method_options is None:
            return None
        options.update(method_options)
    return model_config.with_options(**options)


def model_config_for(config: config_dict.ConfigDict, tpu: Target) -> ModelConfig:
    """The model `train.py` would build from `config` on `tpu` (a TPU slice or GPUs): validated for its devices,
    "auto" settings resolved for its platform rather than for this CPU."""
    model_config = config_checks.validate(config, num_devices=tpu.num_chips)
    return dataclasses.replace(model_config, relative_terms=model_config.relative_terms_for(tpu.platform))


def compile_run(config: config_dict.ConfigDict, tpu: Target, *, programs: Sequence[str] = PROGRAMS,
                length_multiple: int = 8, length_kernels: Sequence[str] | None = None,
                length_methods: Sequence[str] = (),
                tokens_per_batch: int = length_study.StudySettings.tokens_per_batch) -> list[analysis.ProgramReport]:
    """Compile `programs` of the run `config` describes for `tpu` (a TPU slice or GPUs); one report each (the length
    forward once per kernel of `length_kernels`, by default the platform's `LENGTH_KERNELS`, as trained, and once
    per kernel and method of `length_methods`). Raises `config_checks.ConfigError` for a config `train.py` would
    refuse on these devices or whose attention kernel is the other platform's, ValueError for an unknown length
    method."""
    unknown = [m for m in length_methods if m not in length_study.LENGTH_METHODS]
    if unknown:
        raise ValueError(f"length methods {unknown} are unknown; choose from {list(length_study.LENGTH_METHODS)}")
    foreign, why = _FOREIGN_KERNEL[tpu.platform]
    if config.model.attention_kernel == foreign and {"train", "eval"} & set(programs):
        raise ConfigError(f"config.model.attention_kernel={foreign!r} cannot be compiled for {tpu.name}: {why}")
    length_kernels = LENGTH_KERNELS[tpu.platform] if length_kernels is None else length_kernels
    model_config = model_config_for(config, tpu)
    mesh = sharding.make_mesh(config.mesh.fsdp, tpu.devices)
    run = run_programs.build(config, model_config, mesh)
    rows, seq_len, accum = config.train.batch_size, config.data.seq_len, config.train.grad_accum_steps
    state = run_programs.abstract_with_sharding(run.abstract_state, run.state_sharding)
    batch = run_programs.abstract_batch(rows, seq_len, run.batch_sharding)
    groups = tpu.num_chips  # the head scores each device's rows on that device (steps.masked_lm_sums)
    budget = steps.step_prediction_budget(rows, seq_len, config.data.mask_prob, accum, groups)
    reports = []
    if "train" in programs:
        reports.append(_compile(
            "train step", lambda: run.train_step.lower(state, batch), tpu, num_chips=tpu.num_chips,
            tokens=rows * seq_len, flops=model_flops(model_config, rows, seq_len, budget, train=True)))
    if "eval" in programs:
        eval_budget = steps.step_prediction_budget(rows, seq_len, config.data.mask_prob, groups=groups)
        reports.append(_compile(
            "eval step", lambda: run.eval_step.lower(state.params, batch), tpu, num_chips=tpu.num_chips,
            tokens=rows * seq_len, flops=model_flops(model_config, rows, seq_len, eval_budget, train=False)))
    if "length" in programs:
        eval_len = seq_len * length_multiple
        for kernel in length_kernels:
            for method in (None, *length_methods):
                reports.append(_compile_length_forward(model_config, kernel, method, eval_len, tokens_per_batch, tpu))
    return reports


def _compile_length_forward(model_config: ModelConfig, kernel: str, method: str | None, eval_len: int,
                            tokens_per_batch: int, tpu: Target) -> analysis.ProgramReport:
    """The length study's scoring forward at `eval_len` under `method` (None: as trained), on one chip, with
    eval.py's batch for that length."""
    name = f"length forward {eval_len} ({kernel}" + (f", {method})" if method else ")")
    try:
        cfg = length_forward_config(model_config, kernel, method)
    except ConfigError as err:
        # What a kernel cannot run: a window or a temperature with the GPU kernel.
        return analysis.ProgramReport(name, tpu.chip, 1, 0, 0.0, 0.0, error=str(err))
    if cfg is None:
        return analysis.ProgramReport(name, tpu.chip, 1, 0, 0.0, 0.0, error=(
            f"the length method {method!r} has nothing to act on in this model (attention={model_config.attention!r}, "
            f"attention_temperature={model_config.attention_temperature!r}); eval.py skips it too"))
    rows = max(1, tokens_per_batch // eval_len)
    targets = scoring.scored_count(rows * eval_len, 0)
    flops = model_flops(cfg, rows, eval_len, targets, train=False)
    foreign, why = _FOREIGN_KERNEL[tpu.platform]
    if kernel == foreign:
        return analysis.ProgramReport(name, tpu.chip, 1, rows * eval_len, flops, 0.0, error=why)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: MaskedLM(cfg, rngs=nnx.Rngs(params=0))))
    one_chip = SingleDeviceSharding(tpu.devices[0])
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_chip), params)
    arrays = [jax.ShapeDtypeStruct(shape, dtype, sharding=one_chip) for shape, dtype in (
        ((rows, eval_len), "int32"), ((rows, eval_len), "int32"), ((targets,), "int32"), ((targets,), "int32"))]
    score = jax.jit(scoring.score_function(graphdef))
    return _compile(name, lambda: score.lower(params, *arrays), tpu, num_chips=1, tokens=rows * eval_len,
                    flops=flops)


def fit_hints(report: analysis.ProgramReport, config: config_dict.ConfigDict, tpu: Target) -> list[str]:
    """What to change when `report`'s program does not fit a chip (a GPU), largest saving first, from where its
    memory goes: the training state (arguments) shrinks with FSDP (over a slice's chips, a node's GPUs), activations
    (temporaries) with the platform's fused kernel, remat, gradient accumulation or a smaller batch. A GPU program
    that fits only above the memory JAX's GPU client takes by default gets the variable that raises it."""
    needed = report.needed_bytes
    chip, unit = report.chip, report.chip.unit
    if needed is not None and report.above_default_gpu_memory:
        fraction = min(0.99, math.ceil(100 * needed / chip.hbm_bytes + 2) / 100)  # 2% for CUDA and its libraries
        return [f"{report.name} needs {needed / GIB:.2f} GiB per GPU, {needed / chip.hbm_bytes:.0%} of its memory, "
                f"more than the {JAX_GPU_MEMORY_FRACTION:.0%} JAX's GPU client takes by default: run it with "
                f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction:.2f}."]
    if needed is None or report.fits:
        return []
    if report.cost is not None:
        cost = report.cost
        state_large = cost.argument_bytes > 0.2 * chip.hbm_bytes
        hints = [f"{report.name} needs {needed / GIB:.2f} GiB per {unit}, {(needed - chip.hbm_bytes) / GIB:.2f} GiB "
                 f"more than the {_capacity(chip)} GiB of a{'n' if chip.name[0] in 'aeiou' else ''} {chip.name} "
                 f"{unit} ({cost.argument_bytes / GIB:.2f} GiB arguments, {cost.temp_bytes / GIB:.2f} GiB "
                 "temporaries)."]
    else:
        oom = report.oom
        state_large = True  # unknown: libtpu stopped before reporting the arguments
        hints = [f"{report.name} needs at least {needed / GIB:.2f} GiB of {oom.what} per chip, "
                 f"{(needed - oom.available_bytes) / GIB:.2f} GiB more than the {oom.available_bytes / GIB:.2f} GiB "
                 f"libtpu can use on a {chip.name} chip."]
    fused = FUSED_KERNEL[tpu.platform]
    if not report.name.startswith(("train", "eval")):
        blockwise = "(dense)" in report.name and "a kernel with memory linear in length (eval.py --attention_kernel " \
            f"{fused} or blockwise) or "
        hints.append(f"Use {blockwise or ''}fewer tokens per batch (eval.py --tokens_per_batch).")
        return hints
    per_slice = tpu.devices_per_slice
    fsdp = config.mesh.fsdp
    larger = [f for f in range(fsdp * 2, per_slice + 1) if per_slice % f == 0]
    if larger and state_large:
        hints.append(f"--config.mesh.fsdp={larger[0]} (now {fsdp}): splits parameters and AdamW moments "
                     f"{larger[0]} ways instead of {fsdp}.")
    elif tpu.platform == "gpu" and per_slice < MAX_GPUS_PER_NODE and state_large:
        node = f"{chip.name}:{MAX_GPUS_PER_NODE}"
        hints.append(f"--topology {node} --config.mesh.fsdp={MAX_GPUS_PER_NODE} (now {tpu.name}): a node's "
                     f"{MAX_GPUS_PER_NODE} GPUs split parameters and AdamW moments {MAX_GPUS_PER_NODE} ways.")
    rows = config.train.batch_size
    if report.name.startswith("eval"):  # no backward pass: nothing to recompute or accumulate
        hints.append(f"--config.train.batch_size={rows // 2} (now {rows}; evaluation batches have the training "
                     "batch's size).")
        return hints
    if config.model.attention_kernel != fused:
        hints.extend(_fused_kernel_hint(config, tpu))
    remat = config.model.remat
    if remat != "full":
        hints.append(f"--config.model.remat={'dots_no_batch' if remat == 'none' else 'full'} (now {remat!r}): "
                     "recomputes activations in the backward pass instead of keeping them.")
    accum = config.train.grad_accum_steps
    if rows % (accum * 2 * tpu.num_chips) == 0:
        hints.append(f"--config.train.grad_accum_steps={accum * 2} (now {accum}): half the activations per "
                     "micro-batch, the same global batch and update.")
    hints.append(f"--config.train.batch_size={rows // 2} (now {rows}): changes the recipe; the last resort.")
    return hints


def _capacity(chip) -> str:
    """A chip's memory in GiB as messages print it: whole where it is whole (16, 80), else to a tenth (79.1)."""
    gib = chip.hbm_bytes / GIB
    return f"{gib:.0f}" if gib == round(gib) else f"{gib:.1f}"


def _fused_kernel_hint(config: config_dict.ConfigDict, tpu: Target) -> list[str]:
    """The platform's fused kernel as a fit hint, where `train.py` would train this config with it (with attention
    dropout off, saying so, where the kernel has none)."""
    fused = FUSED_KERNEL[tpu.platform]
    what = ("the fused TPU kernel keeps no [B, H, N, N] scores or probabilities for the backward pass (every "
            "variant, attention dropout included)." if tpu.platform == "tpu" else
            "the fused GPU kernel (Pallas on Triton) keeps no [B, H, N, N] scores or probabilities for the backward "
            "pass.")
    trial = config.copy_and_resolve_references()
    trial.model.attention_kernel = fused
    try:
        config_checks.validate(trial, num_devices=tpu.num_chips)
        return [f"--config.model.attention_kernel={fused}: {what}"]
    except ConfigError:
        pass
    trial.model.attention_dropout = 0.0
    try:
        config_checks.validate(trial, num_devices=tpu.num_chips)
    except ConfigError:
        return []  # the kernel cannot run this model (e.g. a window or a temperature it does not implement)
    return [f"--config.model.attention_kernel={fused} --config.model.attention_dropout=0: {what} It draws no "
            f"attention dropout (now {config.model.attention_dropout}): a change of recipe."]
