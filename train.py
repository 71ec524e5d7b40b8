"""Masked-LM pre-training of BERT (entangled) and DeBERTa (disentangled) encoders.

    python train.py --config configs/deberta.py:tiny --workdir runs/deberta_tiny \
        --config.data.train_files=corpus/train.txt \
        --config.data.eval_files=corpus/valid.txt \
        --config.train.num_steps=2000

Rerunning the same command resumes from the latest checkpoint in --workdir, exactly: data order,
masks and dropout are functions of (config.seed, step). `deberta_jax.train.checkpoint.load_workdir`
rebuilds the trained model from the workdir alone.

Devices: a (data, fsdp) mesh over every device (`jax.make_mesh`); batches split over all of them,
parameters and optimizer state replicated, or split over `config.mesh.fsdp` devices (FSDP). Several
processes (multi-host TPU/GPU): pass --multiprocess to call `jax.distributed.initialize()`, which
auto-detects TPU pods, SLURM, Open MPI and Kubernetes; for a manual launch set
JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES and JAX_PROCESS_ID on every process
(setting JAX_COORDINATOR_ADDRESS alone also turns multi-process mode on).

The workdir may be in object storage (`--workdir gs://bucket/run`), the one place every host of a pod can
write and every later host can restore from. SIGTERM (a preemption notice) makes every process save a
checkpoint at the same step and exit with status 143 (`deberta_jax.train.preemption`). A process that dies or hangs
stops the others of its run, each with one line and status 75 (`deberta_jax.train.peers`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_dict, config_flags
from tqdm import tqdm

from deberta_jax import storage
from deberta_jax.data import batches, errors, library_logs, packing, row_lengths, synthetic
from deberta_jax.data import tokenizer as tokenizer_lib
from deberta_jax.data.text import DocumentStream
from deberta_jax.model.config import COMPUTATION_FIELDS, ModelConfig
from deberta_jax.storage import deadlines
from deberta_jax.train import (
    branching,
    checkpoint,
    config_checks,
    metrics_io,
    peers,
    preemption,
    sharding,
    workdir_lock,
)
from deberta_jax.train import programs as run_programs

config_flags.DEFINE_config_file("config", None, "Experiment config, e.g. configs/deberta.py:tiny.", lock_config=True)
flags.DEFINE_string("workdir", None, "Directory for config, tokenizer, checkpoints and metrics, on a local disk or in "
                    "a bucket (gs://bucket/run); resumed if it has any.")
flags.DEFINE_bool("multiprocess", False, "Call jax.distributed.initialize() (multi-host runs).")
deadlines.define_flag()
flags.DEFINE_string("branch_from", None, "A workdir whose run differs from this one only in its long phase "
                    "(config.train.long_steps and what goes with it): a new --workdir starts from its newest "
                    "checkpoint before the two could differ instead of from step 0 (deberta_jax.train.branching). "
                    "Ignored once "
                    "--workdir holds checkpoints of its own.")
flags.DEFINE_integer("stop_at_step", None, "Stop (saving a checkpoint) after this step, as if preempted; the "
                     "schedule still spans config.train.num_steps. For time-limited jobs and resume tests.",
                     lower_bound=1)

FLAGS = flags.FLAGS

# config.json's record of the vocabulary size the workdir's tokenizer was trained for (None: given or synthetic).
VOCAB_REQUEST = "tokenizer_trained_for_vocab_size"

# Training metrics checked for NaN/inf before anything is logged or saved.
FINITE_METRICS = ("loss", "grad_norm", "param_norm")


class NonFiniteError(FloatingPointError):
    """Training produced NaN or inf; the run stopped without saving the bad state."""


def prepare_tokenizer(config: config_dict.ConfigDict, workdir: storage.AnyPath,
                      branch_from: storage.AnyPath | None = None):
    """The workdir's own tokenizer when resuming, else the trunk's of a branch (`branch_from`), else
    config.data.tokenizer, else the symbol tokenizer of synthetic train_files, else one trained on train_files. A
    workdir with checkpoints but without its tokenizer is refused: a checkpoint is never continued with another
    tokenizer.

    With several processes, process 0 trains the tokenizer and the others read it from the workdir: every
    process must map text to the same ids, and that should not rest on the trainer being deterministic.
    """
    own = workdir / checkpoint.TOKENIZER_FILE
    resuming = own.is_file()
    if not resuming and checkpoint.has_checkpoints(workdir):
        raise FileNotFoundError(f"{own} is missing, but {workdir} holds checkpoints trained with its token ids. "
                                f"{checkpoint.RESTORE_TOKENIZER}, or train anew in another --workdir.")
    sharding.sync_processes("tokenizer looked up")  # no process may see the file process 0 is about to write
    if resuming:  # config.data.tokenizer is ignored: the checkpoints' own tokenizer or none
        return checkpoint.load_tokenizer(workdir)
    if branch_from is not None:  # the trunk's checkpoints read its token ids
        return checkpoint.load_tokenizer(branch_from)
    if config.data.tokenizer:
        return tokenizer_lib.load_tokenizer(config.data.tokenizer)
    if synthetic.is_synthetic_spec(config.data.train_files):
        logging.info("using the symbol tokenizer of %s (config.model.vocab_size is not used)", config.data.train_files)
        return synthetic.tokenizer(config.data.train_files)
    if jax.process_index() == 0:
        logging.info("training a %d-token tokenizer on %s", config.model.vocab_size, config.data.train_files)
        tokenizer = tokenizer_lib.train_tokenizer(DocumentStream(config.data.train_files), config.model.vocab_size)
        if tokenizer.get_vocab_size() < config.model.vocab_size:
            logging.warning("the tokenizer trained on %s has %d tokens, not config.model.vocab_size=%d: the text holds "
                            "too few distinct words and pieces for more, so the model's vocabulary is %d",
                            config.data.train_files, tokenizer.get_vocab_size(), config.model.vocab_size,
                            tokenizer.get_vocab_size())
        if jax.process_count() == 1:
            return tokenizer
        tokenizer_lib.save_tokenizer(tokenizer, own)
    sharding.sync_processes("tokenizer trained")
    return tokenizer_lib.load_tokenizer(own)


def check_resumable(workdir: storage.AnyPath, run: config_dict.ConfigDict) -> None:
    """Refuses to continue a workdir's checkpoints with another model (or a vocabulary its tokenizer was not
    trained for); logs every other change (another attention kernel, remat policy or layer scan among them)."""
    saved = checkpoint.read_config(workdir)
    # Model fields added since the workdir was written hold their defaults, which is what it trained with.
    saved.model = config_dict.ConfigDict(ModelConfig.from_dict(saved.model.to_dict()).to_dict())
    if VOCAB_REQUEST not in saved.data:  # a workdir from before the request was recorded
        saved.data[VOCAB_REQUEST] = run.data[VOCAB_REQUEST]
    changes = config_checks.differences(saved, run)
    # Kernel, remat and scan change how the parameters are computed with, not what they are: checkpoints load.
    computation = {f"model.{name}" for name in COMPUTATION_FIELDS}
    model_changes = {k: v for k, v in changes.items()
                     if (k.startswith("model.") and k not in computation) or k == "data." + VOCAB_REQUEST}
    if "model.trained_length" in model_changes:  # derived, not settable: name the field the user changed
        model_changes["data.seq_len"] = model_changes.pop("model.trained_length")
    if model_changes:
        raise config_checks.ConfigError(
            f"{workdir} holds checkpoints of another model; changed: "
            + ", ".join(f"config.{k} {a!r} -> {b!r}" for k, (a, b) in model_changes.items())
            + ". Use a new --workdir, or the saved config.json's model values.")
    for key, (before, after) in changes.items():
        logging.warning("config.%s changed from %r to %r since %s was written", key, before, after,
                        checkpoint.CONFIG_FILE)


def check_steps(pending: list[tuple[int, dict]], last_good: str) -> None:
    """Stops the run at the first step whose loss, gradient norm or parameter norm is not finite, or
    whose masked tokens overflowed the MLM head's static budget (`steps.prediction_budget`)."""
    for step, metrics in pending:
        values = {name: float(metrics[name]) for name in FINITE_METRICS}
        if not all(np.isfinite(v) for v in values.values()):
            raise NonFiniteError(
                f"non-finite training metrics at step {step}: {values}. Stopped without saving; {last_good}. "
                "Lower config.train.learning_rate, raise warmup_steps, or check the data.")
        if int(metrics["dropped"]):
            raise RuntimeError(
                f"step {step} masked {int(metrics['dropped'])} tokens more than the MLM head scores "
                f"(deberta_jax.train.steps.prediction_budget, mean + 8 sigma); stopped without saving; {last_good}. "
                "The masking rate no longer matches config.data.mask_prob: check deberta_jax.data.masking.")


def summarize(pending: list[tuple[int, dict]]) -> dict[str, float]:
    """Means of loss, accuracy and gradient norm over the steps since the last log; rate and
    parameter norm at the last of them."""
    values = [metrics for _, metrics in pending]
    mean = lambda name: float(np.mean([m[name] for m in values]))  # noqa: E731
    last = values[-1]
    return dict(loss=mean("loss"), accuracy=mean("accuracy"), grad_norm=mean("grad_norm"),
                learning_rate=float(last["learning_rate"]), param_norm=float(last["param_norm"]))


def train_and_evaluate(config: config_dict.ConfigDict, workdir: str | Path, *, stop_at_step: int | None = None,
                       branch_from: str | Path | None = None) -> dict:
    """Trains (or resumes) the run in `workdir`, holding its lock throughout; returns the metrics logged at the last
    step (none where a stop falls between two records). A `workdir` without checkpoints starts from `branch_from`'s
    (`branching`) where given.
    Raises `preemption.Preempted` after saving a checkpoint when the run received SIGTERM. In a multi-process run, a
    process that stops responding ends this one with one line and `peers.EXIT_CODE`."""
    workdir = storage.path(workdir)
    if branch_from is not None:
        errors.check_location("--branch_from", str(branch_from))
        branch_from = storage.path(branch_from)
        if not checkpoint.has_checkpoints(workdir):
            try:  # a folder that is not a training workdir, named before any work
                checkpoint.read_config(branch_from)
            except FileNotFoundError as err:
                raise FileNotFoundError(f"--branch_from: {err}") from None
        else:
            logging.info("%s holds checkpoints of its own: resuming them (--branch_from is not used)", workdir)
            branch_from = None
    with peers.Watch("train.py", workdir) as progress:  # from the moment jax.distributed has joined the processes
        storage.check_writable(workdir, "--workdir")  # every process writes its checkpoint shards there
        # A run whose bucket lock another run took over writes nothing more there: the lock fences the workdir.
        with workdir_lock.hold(workdir) if jax.process_index() == 0 else contextlib.nullcontext():
            return _train(config, workdir, stop_at_step, branch_from, progress)


def prepare_data(config: config_dict.ConfigDict, tokenizer, special) -> tuple:
    """The training phases' rows (the long phase None without `train.long_steps`) and this process's eval batches
    (empty without eval files); refuses eval text that yields no masked target, whose loss would be undefined."""
    seq_len, train_cfg = config.data.seq_len, config.train
    train_data = packing.load_or_pack(config.data.train_files, tokenizer, seq_len, config.data.cache_dir)
    evals = []
    if config.data.eval_files:
        eval_data = packing.load_or_pack(config.data.eval_files, tokenizer, seq_len, config.data.cache_dir)
        evals = batches.eval_batches(eval_data, special, batch_size=train_cfg.batch_size,
                                     max_batches=train_cfg.eval_batches,
                                     process_index=jax.process_index(), process_count=jax.process_count())
    if evals and not any(batch["weights"].any() for batch in evals):
        raise config_checks.ConfigError(
            f"config.data.eval_files={config.data.eval_files!r} yields no masked targets ({len(evals)} batches): "
            "the eval loss would be undefined. Give more evaluation text, or set config.data.eval_files='' to "
            "train without evaluation.")
    logging.info("train: %d rows of %d tokens; eval: %d batches", train_data.num_rows, seq_len, len(evals))
    short, long = row_lengths.Phase(train_data, train_cfg.batch_size), None
    if train_cfg.long_steps:  # the same token stream, cut into longer rows (the cache holds only the stream)
        long_len = config.data.long_seq_len
        long = row_lengths.Phase(packing.load_or_pack(config.data.train_files, tokenizer, long_len,
                                                      config.data.cache_dir),
                                 row_lengths.long_batch_size(train_cfg.batch_size, seq_len, long_len))
        logging.info("%d of the last %d steps train on %d rows of %d tokens",
                     row_lengths.long_step_count(train_cfg.long_steps, train_cfg.long_share), train_cfg.long_steps,
                     long.batch_size, long_len)
    return short, long, evals


def resume_or_initialize(workdir: storage.AnyPath, run: config_dict.ConfigDict, programs, keep: int,
                         branch: tuple | None):
    """`(checkpoint manager, train state, manager of the state's checkpoint)`: the newest intact checkpoint of a run
    with this config, else the trunk's checkpoint a branch starts from (`branch`: the trunk's workdir, manager and
    step), else a fresh state (interrupted saves cleared first, and never over a run whose checkpoints are all
    damaged)."""
    if jax.process_index() == 0:
        for name in checkpoint.clear_interrupted_saves(workdir):
            logging.warning("removed %s: a save that was interrupted (the checkpoint before it is intact)", name)
    sharding.sync_processes("checkpoints cleared")
    manager = checkpoint.checkpoint_manager(workdir, keep=keep)
    state = None
    if manager.all_steps():
        check_resumable(workdir, run)
        targets = run_programs.abstract_with_sharding(programs.abstract_state, programs.state_sharding)
        state = checkpoint.restore_newest_intact(manager, targets, workdir)
        logging.info("resuming from the checkpoint at step %d", int(state.step))
    elif branch is not None:
        trunk_dir, trunk, step = branch
        targets = run_programs.abstract_with_sharding(programs.abstract_state, programs.state_sharding)
        state = checkpoint.restore(trunk, step, targets)
        branching.start_branch(trunk_dir, workdir, step, jax.process_index() == 0)
        sharding.sync_processes("branch started")
        return manager, state, trunk
    if state is None:
        checkpoint.refuse_to_start_over(workdir)
        state = programs.init()
    return manager, state, manager


def evaluator(evals: list[dict], eval_step, batch_sharding):
    """`evaluate(params) -> {eval_loss, eval_accuracy}` over all eval batches: sums added on device, divided once."""
    def evaluate(params) -> dict[str, float]:
        totals = None
        for batch in evals:
            sums = eval_step(params, sharding.global_batch(batch, batch_sharding))
            totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
        totals = jax.device_get(totals)
        if int(totals["dropped"]):
            raise RuntimeError(f"evaluation masked {int(totals['dropped'])} tokens more than the MLM head scores "
                               "(deberta_jax.train.steps.prediction_budget); the eval loss would be wrong")
        count = float(totals["count"])  # > 0: checked at start-up
        return dict(eval_loss=float(totals["loss_sum"]) / count, eval_accuracy=float(totals["correct_sum"]) / count)
    return evaluate


def _train(config: config_dict.ConfigDict, workdir: storage.AnyPath, stop_at_step: int | None,
           branch_from: storage.AnyPath | None, progress: peers.Watch) -> dict:
    is_main = jax.process_index() == 0

    # ------------------------------------------------------------------ config & mesh
    model_config = config_checks.validate(config, num_devices=jax.device_count())
    mesh = sharding.make_mesh(config.mesh.fsdp)
    train_cfg, seq_len = config.train, config.data.seq_len
    if train_cfg.warmup_steps >= train_cfg.num_steps:
        logging.warning("config.train.warmup_steps=%d >= num_steps=%d: the run ends before the learning rate "
                        "reaches its peak", train_cfg.warmup_steps, train_cfg.num_steps)
    logging.info("%d devices over %d processes; mesh %s", jax.device_count(), jax.process_count(), mesh.shape)

    # ------------------------------------------------------------------ input
    tokenizer = prepare_tokenizer(config, workdir, branch_from)
    vocab_size = tokenizer.get_vocab_size()
    model_config = dataclasses.replace(model_config, vocab_size=vocab_size)  # the model reads every token id
    run = config_checks.resolved(config, model_config)  # what config.json records
    # The vocabulary a trained tokenizer was asked for: resuming reuses the workdir's tokenizer, so a changed
    # config.model.vocab_size must be refused (check_resumable), not silently ignored.
    trains_tokenizer = not (config.data.tokenizer or synthetic.is_synthetic_spec(config.data.train_files))
    run.data[VOCAB_REQUEST] = config.model.vocab_size if trains_tokenizer else None
    branch = None
    if branch_from is not None:  # refused before the data and the model are built
        trunk = checkpoint.checkpoint_manager(branch_from, read_only=True)
        branch = branch_from, trunk, branching.branch_step(branch_from, run, list(trunk.all_steps()))
    masker = batches.Masker(tokenizer_lib.SpecialIds.from_tokenizer(tokenizer), vocab_size,
                            config.data.mask_prob, config.data.whole_word_masking)
    short_phase, long_phase, evals = prepare_data(config, tokenizer, masker.special)

    # ------------------------------------------------------------------ model, optimizer, sharding, steps
    programs = run_programs.build(config, model_config, mesh)
    train_step, eval_step = programs.train_step, programs.eval_step
    num_params = sum(x.size for x in jax.tree.leaves(programs.abstract_state.params))
    logging.info("model: %s, %.2fM parameters", model_config, num_params / 1e6)

    # ------------------------------------------------------------------ checkpoint: resume or initialize
    manager, state, origin = resume_or_initialize(workdir, run, programs, train_cfg.keep_checkpoints, branch)
    start_step = int(state.step)
    checkpoints = str(workdir / checkpoint.CHECKPOINT_DIR)
    if start_step:
        progress.saved(start_step)
    if is_main:
        tokenizer_lib.save_tokenizer(tokenizer, workdir / checkpoint.TOKENIZER_FILE)
        checkpoint.write_config(workdir, run)
    evaluate = evaluator(evals, eval_step, programs.batch_sharding)

    # ------------------------------------------------------------------ loop
    last_step = train_cfg.num_steps if stop_at_step is None else min(train_cfg.num_steps, stop_at_step)
    tokens_per_step = train_cfg.batch_size * seq_len
    writer = metrics_io.MetricsWriter(workdir, resume_step=start_step, enabled=is_main)
    # Off a terminal (a log file, a job's output) no bar: its carriage-return updates would fill the log, which has
    # the logged metrics instead.
    bar = tqdm(total=train_cfg.num_steps, initial=start_step, desc="train", unit="step",
               disable=None if is_main else True)
    # (step, metrics) not yet logged: a resumed run goes on with the window its checkpoint saved.
    pending: list[tuple[int, dict]] = checkpoint.restore_log_window(origin, start_step) if start_step else []
    record: dict[str, float] = {}
    timer_start, timer_steps = time.perf_counter(), 0

    def check_pending_steps():
        latest = manager.latest_step()
        check_steps(pending, "no checkpoint was saved before it" if latest is None else
                    f"the last good checkpoint is step {latest} in {checkpoints}")

    compiled = set()  # the phases whose step shape has been compiled (two when a long phase alternates)
    watch = preemption.Watch()  # from here on, SIGTERM stops the run at a checkpoint instead of killing it
    logging.info("training steps %d to %d of %d", start_step + 1, last_step, train_cfg.num_steps)
    failed = False
    try:
        for step in range(start_step + 1, last_step + 1):  # `step` counts updates, this one included
            progress.step = step
            phase = row_lengths.phase_at(step - 1, train_cfg.num_steps, train_cfg.long_steps, short_phase, long_phase,
                                         train_cfg.long_share)
            rows = batches.train_batch(
                phase.rows, masker, batch_size=phase.batch_size, step=step - 1, seed=config.seed,
                process_index=jax.process_index(), process_count=jax.process_count(),
                min_row_length=config.data.min_row_length)
            state, metrics = train_step(state, sharding.global_batch(rows, programs.batch_sharding))
            pending.append((step, metrics))
            timer_steps += 1
            bar.update()
            if id(phase) not in compiled:  # the first step of each shape compiles: not counted in tokens/s
                jax.block_until_ready(metrics)
                timer_start, timer_steps = time.perf_counter(), 0
                compiled.add(id(phase))

            preempted = watch.reached(step)  # the same step on every process
            final, stopping = step == train_cfg.num_steps, step == last_step or preempted
            record = {}
            # Not at an early stop: its window goes into the checkpoint, and the record the resumed run writes at
            # the next multiple of log_every averages the same steps as an uninterrupted run's.
            if step % train_cfg.log_every == 0 or final:
                pending = jax.device_get(pending)
                check_pending_steps()
                elapsed = time.perf_counter() - timer_start
                record.update(summarize(pending))
                if timer_steps:
                    record["tokens_per_s"] = timer_steps * tokens_per_step / elapsed
                pending = []
                bar.set_postfix(loss=f"{record['loss']:.3f}",
                                **({"tok_s": f"{record['tokens_per_s']:.0f}"} if "tokens_per_s" in record else {}))
            eval_metrics = None
            if evals and (step % train_cfg.eval_every == 0 or final):
                eval_metrics = evaluate(state.params)
                record.update(eval_metrics)
            if record:
                writer.write(step, record)
                logging.info("step %d: %s", step, record)
            saving = step % train_cfg.checkpoint_every == 0 or eval_metrics is not None or stopping
            if saving:
                check_pending_steps()
                pending = jax.device_get(pending)
                progress.saving(step)
                checkpoint.save(manager, state, eval_metrics, log_window=pending)
                progress.saved(step)
            if preempted and not final:
                raise preemption.Preempted(step, checkpoints)
            if record or saving:  # time only training steps
                timer_start, timer_steps = time.perf_counter(), 0
    except preemption.Preempted:  # a stop, not a failure
        raise
    except BaseException:
        failed = True
        raise
    finally:
        watch.close()
        bar.close()
        manager.close()
        # After a failure nothing more goes up: a failing upload would replace the error that stopped the run (a
        # checkpoint save's) with its own. A preempted run's last TensorBoard events still go up.
        writer.close(upload=not failed)
    return record


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    errors.check_location("--workdir", FLAGS.workdir)
    library_logs.quiet()
    deadlines.set_limit(FLAGS.storage_deadline_s, "train.py", "--storage_deadline_s")
    sharding.initialize_distributed(FLAGS.multiprocess)
    try:
        train_and_evaluate(FLAGS.config, FLAGS.workdir, stop_at_step=FLAGS.stop_at_step,
                           branch_from=FLAGS.branch_from)
    except preemption.Preempted as notice:
        preemption.stop("train.py", notice)


if __name__ == "__main__":
    flags.mark_flags_as_required(["config", "workdir"])
    app.run(errors.reporting_user_errors(main, "train.py", also=(checkpoint.DamagedCheckpointError, NonFiniteError,
                                                                     workdir_lock.WorkdirBusyError)),
            flags_parser=lambda argv: config_checks.parse_config_flags(FLAGS, argv, "config"))
