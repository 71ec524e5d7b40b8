"""Compiling a run's programs for a TPU slice from this CPU: the train step and eval step exactly as `train.py`
builds them (`deberta_jax.train.programs`), and the length study's forward pass as `eval.py` runs it
(`deberta_jax.study.scoring.score_function`, one chip per process, at a multiple of the training length), for the
model as trained and under each requested length method (`length_study.LENGTH_METHODS`, `eval.py --methods`).

Nothing executes: each program is lowered against shapes with shardings and compiled by libtpu, and
`deberta_jax.aot.analysis` reads the executable.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from jax.sharding import SingleDeviceSharding
from ml_collections import config_dict

from deberta_jax.aot import analysis
from deberta_jax.aot.chips import GIB, TpuSlice
from deberta_jax.model.config import ConfigError, ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.study import length_study, scoring
from deberta_jax.train import config_checks, sharding, steps
from deberta_jax.train import programs as run_programs

PROGRAMS = ("train", "eval", "length")
# The kernels the length study's forward is compiled with by default; 'pallas' is Triton (GPU) code, which has no
# TPU lowering.
LENGTH_KERNELS = ("dense", "blockwise", "pallas_tpu")


def _compile(name: str, lower: Callable, tpu: TpuSlice, *, num_chips: int, tokens: int, flops: float
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


def model_config_for(config: config_dict.ConfigDict, tpu: TpuSlice) -> ModelConfig:
    """The model `train.py` would build from `config` on `tpu`: validated for its chips, "auto" settings resolved
    for a TPU rather than for this CPU."""
    model_config = config_checks.validate(config, num_devices=tpu.num_chips)
    return dataclasses.replace(model_config, relative_terms=model_config.relative_terms_for("tpu"))


def compile_run(config: config_dict.ConfigDict, tpu: TpuSlice, *, programs: Sequence[str] = PROGRAMS,
                length_multiple: int = 8, length_kernels: Sequence[str] = LENGTH_KERNELS,
                length_methods: Sequence[str] = (),
                tokens_per_batch: int = length_study.StudySettings.tokens_per_batch) -> list[analysis.ProgramReport]:
    """Compile `programs` of the run `config` describes for `tpu`; one report each (the length forward once per
    kernel as trained, and once per kernel and method of `length_methods`). Raises `config_checks.ConfigError` for a
    config `train.py` would refuse on this slice, ValueError for an unknown length method."""
    unknown = [m for m in length_methods if m not in length_study.LENGTH_METHODS]
    if unknown:
        raise ValueError(f"length methods {unknown} are unknown; choose from {list(length_study.LENGTH_METHODS)}")
    model_config = model_config_for(config, tpu)
    mesh = sharding.make_mesh(config.mesh.fsdp, tpu.devices)
    run = run_programs.build(config, model_config, mesh)
    rows, seq_len, accum = config.train.batch_size, config.data.seq_len, config.train.grad_accum_steps
    state = run_programs.abstract_with_sharding(run.abstract_state, run.state_sharding)
    batch = run_programs.abstract_batch(rows, seq_len, run.batch_sharding)
    groups = tpu.num_chips  # the head scores each device's rows on that device (steps.masked_lm_sums)
    budget = groups * steps.prediction_budget(rows // accum * seq_len // groups, config.data.mask_prob)
    reports = []
    if "train" in programs:
        reports.append(_compile(
            "train step", lambda: run.train_step.lower(state, batch), tpu, num_chips=tpu.num_chips,
            tokens=rows * seq_len, flops=analysis.model_flops(model_config, rows, seq_len, budget * accum, train=True)))
    if "eval" in programs:
        eval_budget = groups * steps.prediction_budget(rows * seq_len // groups, config.data.mask_prob)
        reports.append(_compile(
            "eval step", lambda: run.eval_step.lower(state.params, batch), tpu, num_chips=tpu.num_chips,
            tokens=rows * seq_len, flops=analysis.model_flops(model_config, rows, seq_len, eval_budget, train=False)))
    if "length" in programs:
        eval_len = seq_len * length_multiple
        for kernel in length_kernels:
            for method in (None, *length_methods):
                reports.append(_compile_length_forward(model_config, kernel, method, eval_len, tokens_per_batch, tpu))
    return reports


def _compile_length_forward(model_config: ModelConfig, kernel: str, method: str | None, eval_len: int,
                            tokens_per_batch: int, tpu: TpuSlice) -> analysis.ProgramReport:
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
    flops = analysis.model_flops(cfg, rows, eval_len, targets, train=False)
    if kernel == "pallas":
        return analysis.ProgramReport(name, tpu.chip, 1, rows * eval_len, flops, 0.0, error=(
            "the fused kernel is Triton (GPU) code; on TPU Pallas would interpret it tile by tile, which is not a "
            "TPU program worth measuring"))
    graphdef, params = nnx.split(nnx.eval_shape(lambda: MaskedLM(cfg, rngs=nnx.Rngs(params=0))))
    one_chip = SingleDeviceSharding(tpu.devices[0])
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_chip), params)
    arrays = [jax.ShapeDtypeStruct(shape, dtype, sharding=one_chip) for shape, dtype in (
        ((rows, eval_len), "int32"), ((rows, eval_len), "int32"), ((targets,), "int32"), ((targets,), "int32"))]
    score = jax.jit(scoring.score_function(graphdef))
    return _compile(name, lambda: score.lower(params, *arrays), tpu, num_chips=1, tokens=rows * eval_len,
                    flops=flops)


def fit_hints(report: analysis.ProgramReport, config: config_dict.ConfigDict, tpu: TpuSlice) -> list[str]:
    """What to change when `report`'s program does not fit a chip, largest saving first, from where its memory
    goes: the training state (arguments) shrinks with FSDP, activations (temporaries) with remat, gradient
    accumulation or a smaller batch."""
    needed = report.needed_bytes
    if needed is None or report.fits:
        return []
    chip = report.chip
    if report.cost is not None:
        cost = report.cost
        state_large = cost.argument_bytes > 0.2 * chip.hbm_bytes
        hints = [f"{report.name} needs {needed / GIB:.2f} GiB per chip, {(needed - chip.hbm_bytes) / GIB:.2f} GiB "
                 f"more than the {chip.hbm_bytes / GIB:.0f} GiB of a {chip.name} chip ({cost.argument_bytes / GIB:.2f} "
                 f"GiB arguments, {cost.temp_bytes / GIB:.2f} GiB temporaries)."]
    else:
        oom = report.oom
        state_large = True  # unknown: libtpu stopped before reporting the arguments
        hints = [f"{report.name} needs at least {needed / GIB:.2f} GiB of {oom.what} per chip, "
                 f"{(needed - oom.available_bytes) / GIB:.2f} GiB more than the {oom.available_bytes / GIB:.2f} GiB "
                 f"libtpu can use on a {chip.name} chip."]
    if not report.name.startswith(("train", "eval")):
        blockwise = "(dense)" in report.name and "a kernel with memory linear in length (eval.py --attention_kernel " \
            "pallas_tpu or blockwise) or "
        hints.append(f"Use {blockwise or ''}fewer tokens per batch (eval.py --tokens_per_batch).")
        return hints
    per_slice = tpu.num_chips // tpu.num_slices
    fsdp = config.mesh.fsdp
    larger = [f for f in range(fsdp * 2, per_slice + 1) if per_slice % f == 0]
    if larger and state_large:
        hints.append(f"--config.mesh.fsdp={larger[0]} (now {fsdp}): splits parameters and AdamW moments "
                     f"{larger[0]} ways instead of {fsdp}.")
    rows = config.train.batch_size
    if report.name.startswith("eval"):  # no backward pass: nothing to recompute or accumulate
        hints.append(f"--config.train.batch_size={rows // 2} (now {rows}; evaluation batches have the training "
                     "batch's size).")
        return hints
    if config.model.attention_kernel != "pallas_tpu":
        hints.append("--config.model.attention_kernel=pallas_tpu: the fused TPU kernel keeps no [B, H, N, N] scores "
                     "or probabilities for the backward pass (every variant, attention dropout included).")
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
