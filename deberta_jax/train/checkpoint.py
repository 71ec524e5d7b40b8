"""The workdir: resolved config, tokenizer, checkpoints; and `load_workdir`, the way back to a model.

Layout of a workdir:
    config.json          the resolved config (its `model` section is the complete ModelConfig)
    tokenizer.json       the tokenizer the run trained or was given
    checkpoints/<step>/  params + opt_state (orbax); `metrics` holds eval_loss at evaluation steps; `log_window`
                         the training metrics of the steps since the last logged record
    metrics.jsonl, tensorboard/   written by `metrics_io`

A checkpoint holds the parameters, the optimizer state and (as its name) the step. Nothing else is
needed to resume exactly: data order, masks and dropout keys are functions of (seed, step). The log window (each
step's metrics since the last record of metrics.jsonl) is saved beside them, so the first record after a resume
averages the same steps as an uninterrupted run's.

Retention: the latest `keep` checkpoints plus the single best by eval loss, in one orbax manager
(`LatestN` or `BestN` preservation). Checkpoints without eval metrics never count as "best".

Saves are synchronous (the train step donates its input state, so a background writer must not
read buffers the next step reuses; a save is rare and small next to the steps between saves).
On a disk, orbax writes each checkpoint into a temporary directory and renames it when complete, so an
interrupted save leaves no checkpoint that `latest_step` would pick up; the previous one stays, and
`clear_interrupted_saves` removes the temporary directory before the next manager opens the folder. In a
bucket, which cannot rename, orbax writes in place and commits a checkpoint by writing `commit_success.txt`
last; a step folder without it is never listed, and the next manager deletes it. In a store orbax cannot write to
(s3://), orbax saves to a local stage and the step is published with the same rule (`staged_checkpoints`).

Checkpoints prove themselves: after a save, `<step>/sha256.json` records a digest of every file (on a disk
SHA-256 of the bytes; in a bucket the MD5 the store computed on upload, read from one listing), and
`restore_newest_intact` accepts a checkpoint only if its files match their digests and every restored
value is finite. A damaged checkpoint (a flipped bit, a truncated or deleted file) is moved to
`damaged_checkpoints/` with a warning that names it, and the next newest is tried, so a restart never
stops on one bad save. A checkpoint without a digest (the process died between orbax's commit and the
digest, or a workdir from before digests) is still restored, and still checked for finite values.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from flax import nnx
from ml_collections import config_dict
from tokenizers import Tokenizer

from deberta_jax import storage
from deberta_jax.data import tokenizer as tokenizer_lib
from deberta_jax.model.config import ModelConfig
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.train.sharding import sync_processes
from deberta_jax.train.staged_checkpoints import StagedCheckpointManager
from deberta_jax.train.steps import TrainState

CONFIG_FILE = "config.json"
TOKENIZER_FILE = "tokenizer.json"
CHECKPOINT_DIR = "checkpoints"
DAMAGED_DIR = "damaged_checkpoints"
DIGEST_FILE = "sha256.json"
BEST_METRIC = "eval_loss"
ARRAY_ITEMS = ("params", "opt_state")  # the large items of a step, which a staged manager fetches when read
_ORBAX_TMP = ".orbax-checkpoint-tmp"


class DamagedCheckpointError(RuntimeError):
    """A checkpoint's files do not match their digests, cannot be read, or hold non-finite values."""


def _best_metric(metrics: dict) -> float:
    return metrics[BEST_METRIC]


Manager = ocp.CheckpointManager | StagedCheckpointManager


def checkpoint_manager(workdir: str | Path, keep: int = 1, read_only: bool = False) -> Manager:
    """Manager of `workdir/checkpoints`, keeping the latest `keep` plus the best by eval loss."""
    policies = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        read_only=read_only,
        create=not read_only,
        save_interval_steps=0 if read_only else 1,
        cleanup_tmp_directories=not read_only,  # remove what an interrupted save left behind
        enable_async_checkpointing=False,
        best_fn=_best_metric,  # lets `best_step()` rank checkpoints and makes `save` record metrics
        best_mode="min",
        preservation_policy=policies.AnyPreservationPolicy([
            policies.LatestN(n=keep),
            policies.BestN(get_metric_fn=_best_metric, reverse=True, n=1, keep_checkpoints_without_metrics=False),
        ]),
    )
    directory = storage.path(workdir) / CHECKPOINT_DIR
    if not storage.orbax_writes(directory):
        return StagedCheckpointManager(directory, options, read_only, lazy=ARRAY_ITEMS)
    with storage.deadline(directory, "list the checkpoints in"):
        return ocp.CheckpointManager(directory if storage.is_remote(directory) else directory.absolute(),
                                     options=options)


def clear_interrupted_saves(workdir: str | Path) -> list[str]:
    """Removes what a save killed midway left in `workdir/checkpoints` (orbax's temporary directories);
    returns their names. Call from one process before the manager opens the folder. (In a bucket a killed save
    leaves an uncommitted step folder, which the manager itself deletes.)"""
    root = storage.path(workdir) / CHECKPOINT_DIR
    if storage.is_remote(root):
        return []
    removed = sorted(p.name for p in root.glob(f"*{_ORBAX_TMP}*")) if root.is_dir() else []
    for name in removed:
        storage.remove_tree(root / name)
    return removed


def has_checkpoints(workdir: str | Path) -> bool:
    """Whether `workdir/checkpoints` holds a step folder, committed or not: a run has saved there, so the workdir's
    config and tokenizer are those of its parameters."""
    root = storage.path(workdir) / CHECKPOINT_DIR
    return root.is_dir() and any(p.name.isdigit() for p in root.iterdir())


def is_committed(workdir: str | Path, step: int) -> bool:
    """Whether the checkpoint of `step` in `workdir` is committed: its folder renamed into place (a disk) or holding
    orbax's `commit_success.txt` (a bucket). Read from storage, for a process that cannot ask a save's outcome."""
    step_dir = storage.path(workdir) / CHECKPOINT_DIR / str(step)
    return (step_dir / "commit_success.txt").exists() if storage.is_remote(step_dir) else step_dir.is_dir()


def _step_dir(manager: Manager, step: int) -> storage.AnyPath:
    """The folder orbax reads `step` from (a staged manager's fetched copy)."""
    if isinstance(manager, StagedCheckpointManager):
        return manager.step_dir(step)
    return storage.path(manager.directory) / str(step)


def _home(manager: Manager) -> storage.AnyPath:
    """The workdir's checkpoints folder a manager keeps (a staged manager's bucket, not its stage)."""
    return manager.remote if isinstance(manager, StagedCheckpointManager) else storage.path(manager.directory)


def write_digest(step_dir: storage.AnyPath) -> None:
    """Records a digest of every file of a committed checkpoint (`storage.fingerprints`), written whole."""
    digests = storage.fingerprints(step_dir, skip=DIGEST_FILE)
    storage.write_text(step_dir / DIGEST_FILE, json.dumps(digests, indent=0, sort_keys=True))


def verify_files(step_dir: storage.AnyPath, shown: storage.AnyPath | None = None) -> None:
    """Raises DamagedCheckpointError unless every file recorded in the digest is there, unchanged; messages name the
    folder as `shown` (the bucket's, for a staged copy). A checkpoint without a digest passes with a warning (nothing
    to compare; its values are still checked)."""
    recorded_path, shown = step_dir / DIGEST_FILE, shown or step_dir
    if not recorded_path.is_file():
        logging.warning("checkpoint %s has no %s (saved before checkpoints carried a digest, or its process died "
                        "before writing one): its files are not checked against what was saved, only its values for "
                        "NaN and inf", shown, DIGEST_FILE)
        return
    try:
        recorded = json.loads(storage.read_text(recorded_path))
    except (OSError, json.JSONDecodeError) as err:
        raise DamagedCheckpointError(f"{shown / DIGEST_FILE} is unreadable ({err})") from None
    actual = storage.fingerprints(step_dir, kind=storage.checksum_kind(recorded), skip=DIGEST_FILE)
    missing = sorted(set(recorded) - set(actual))
    changed = sorted(k for k in recorded if k in actual and actual[k] != recorded[k])
    if missing or changed:
        raise DamagedCheckpointError(
            f"{shown}: " + "; ".join(filter(None, [missing and f"missing files {missing[:5]}",
                                                        changed and f"files changed since the save {changed[:5]}"])))


def _verify(manager: Manager, step: int) -> None:
    verify_files(_step_dir(manager, step), shown=_home(manager) / str(step))


LOG_WINDOW = "log_window"


def save(manager: Manager, state: TrainState, eval_metrics: dict | None = None,
         log_window: list[tuple[int, dict]] = ()) -> None:
    """Saves params and optimizer state under `state.step`; `eval_metrics` make it a candidate for best;
    `log_window` is `[(step, {name: host scalar})]` of the steps not yet logged (`restore_log_window`)."""
    # Each value with its dtype, so the restored window averages to the very bits the uninterrupted run logs.
    window = [{"step": step, "metrics": {name: [np.asarray(v).dtype.name, np.asarray(v).item()]
                                         for name, v in metrics.items()}} for step, metrics in log_window]
    args = ocp.args.Composite(params=ocp.args.StandardSave(state.params),
                              opt_state=ocp.args.StandardSave(state.opt_state),
                              **{LOG_WINDOW: ocp.args.JsonSave({"steps": window})})
    metrics = None if eval_metrics is None else {BEST_METRIC: float(eval_metrics[BEST_METRIC])}
    step = int(state.step)
    storage.check_fence(_home(manager))  # orbax writes by itself, past the storage writers that ask the fence
    try:
        with storage.deadline(manager.directory, f"save the checkpoint of step {step} to"):
            manager.save(step, args=args, metrics=metrics)
            manager.wait_until_finished()
    except (ValueError, OSError) as err:  # tensorstore reports a failed write as ValueError, with the errno in text
        if not storage.no_room(err):
            raise
        workdir = storage.path(manager.directory).parent
        raise OSError(f"{workdir}: no room to save the checkpoint of step {step} (the disk is full, or a file-size or "
                      "quota limit was reached); the checkpoints before it are intact. Free space there, or move the "
                      "workdir to a disk with room, then rerun the same command to resume") from None
    sync_processes(f"checkpoint {step} committed")  # every process's shards, before process 0 digests them
    if jax.process_index() == 0:
        write_digest(_step_dir(manager, step))
    if isinstance(manager, StagedCheckpointManager):
        manager.publish(step)


@jax.jit
def _all_finite(tree) -> jax.Array:
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def restore(manager: Manager, step: int, abstract_state: TrainState) -> TrainState:
    """Restores a full train state onto the shardings given in `abstract_state` (ShapeDtypeStructs),
    after checking the files against their digests; non-finite values raise DamagedCheckpointError."""
    with storage.deadline(_home(manager) / str(step), "restore the checkpoint"):  # fetching and digest check too
        _verify(manager, step)
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract_state.params),
            opt_state=ocp.args.StandardRestore(abstract_state.opt_state)))
    if not bool(_all_finite((restored.params, restored.opt_state))):
        raise DamagedCheckpointError(f"{_home(manager) / str(step)} holds NaN or inf values")
    step = jax.device_put(np.asarray(step, np.int32), abstract_state.step.sharding)
    return TrainState(step=step, params=restored.params, opt_state=restored.opt_state)


def restore_log_window(manager: Manager, step: int) -> list[tuple[int, dict]]:
    """The log window saved with checkpoint `step` (`save`); empty for a checkpoint written before windows were
    saved."""
    if not (_step_dir(manager, step) / LOG_WINDOW).is_dir():
        return []
    saved = manager.restore(step, args=ocp.args.Composite(**{LOG_WINDOW: ocp.args.JsonRestore()}))[LOG_WINDOW]
    return [(entry["step"], {name: np.asarray(value, dtype) for name, (dtype, value) in entry["metrics"].items()})
            for entry in saved["steps"]]


def restore_newest_intact(manager: Manager, abstract_state: TrainState, workdir: str | Path
                          ) -> TrainState | None:
    """The newest checkpoint that restores intact (see `restore`), or None when there is none at all.

    Each damaged one met on the way is moved to `workdir/damaged_checkpoints/` (kept for inspection, out of
    the manager's sight so retention and `latest_step` ignore it) with a warning naming it. If every
    checkpoint is damaged, raises DamagedCheckpointError: starting over silently would discard the run.
    """
    damaged = []
    for step in sorted(manager.all_steps(), reverse=True):
        try:
            state = restore(manager, step, abstract_state)
        except Exception as err:  # noqa: BLE001 - tensorstore/orbax raise many types for unreadable data
            reason = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
            damaged.append(step)
            logging.warning("checkpoint %d in %s is damaged (%s); moving it to %s and trying the previous one",
                            step, _home(manager), reason, DAMAGED_DIR)
            if jax.process_index() == 0:
                _quarantine(_home(manager) / str(step), storage.path(workdir) / DAMAGED_DIR)
            sync_processes(f"checkpoint {step} quarantined")
            continue
        if damaged:
            manager.reload()
            logging.warning("resumed from step %d, the newest intact checkpoint; damaged: %s", step, damaged)
        return state
    if damaged:
        raise DamagedCheckpointError(
            f"every checkpoint in {storage.path(workdir) / CHECKPOINT_DIR} was damaged ({damaged}; moved to "
            f"{storage.path(workdir) / DAMAGED_DIR}; the warnings above give each reason). If the reason is not "
            f"damage (e.g. a library that cannot read them), move them back into {CHECKPOINT_DIR}/; otherwise restore "
            "them from a backup, or start over with another --workdir.")
    return None


def refuse_to_start_over(workdir: str | Path) -> None:
    """Raises DamagedCheckpointError when `workdir` has no checkpoint left but damaged ones set aside: a run
    whose every checkpoint was damaged must not restart from step 0 the next time the same command runs. The
    user says otherwise by moving `DAMAGED_DIR` away."""
    damaged = storage.path(workdir) / DAMAGED_DIR
    if damaged.is_dir() and any(damaged.iterdir()):
        raise DamagedCheckpointError(
            f"{workdir} has no intact checkpoint; its damaged ones are in {damaged}. Restore checkpoints from a "
            f"backup into {storage.path(workdir) / CHECKPOINT_DIR}, or, to start this run over from step 0, move "
            f"{damaged} "
            "out of the workdir.")


def _quarantine(step_dir: storage.AnyPath, damaged_root: storage.AnyPath) -> None:
    target, n = damaged_root / step_dir.name, 1
    while target.exists():
        target, n = damaged_root / f"{step_dir.name}.{n}", n + 1
    storage.move_tree(step_dir, target)


def write_config(workdir: str | Path, config: config_dict.ConfigDict) -> None:
    """Writes config.json whole (`storage.write_text`), so a kill never leaves half of it."""
    path = storage.path(workdir) / CONFIG_FILE
    try:
        storage.write_text(path, json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n")
    except storage.StorageError:
        raise
    except OSError as err:
        raise OSError(f"cannot write {path} ({err.strerror}); is {path.parent} writable?") from None


def read_config(workdir: str | Path) -> config_dict.ConfigDict:
    path = storage.path(workdir) / CONFIG_FILE
    with storage.reporting(path, "read"):  # the first call to a workdir's store: an unreachable one said here
        found = path.is_file()
        orphaned = not found and (storage.path(workdir) / CHECKPOINT_DIR).is_dir()
    if not found:
        if orphaned:
            raise FileNotFoundError(
                f"{path} is missing, but {workdir} holds checkpoints: the model they belong to is described only "
                f"in {CONFIG_FILE}, so neither a resumed train.py nor eval.py can rebuild it. Restore {CONFIG_FILE} "
                "from a backup, or start over with another --workdir.")
        raise FileNotFoundError(f"{path} not found: {workdir} is not a training workdir (train.py writes "
                                f"{CONFIG_FILE} there at start-up)")
    try:
        config = json.loads(storage.read_text(path))
    except json.JSONDecodeError as err:  # truncated (a full disk, an interrupted copy) or edited by hand
        raise ValueError(f"{path} is not valid JSON ({err}): the model of the checkpoints in {workdir} is described "
                         f"only there. Restore {CONFIG_FILE} from a copy of the workdir, or repair it by hand "
                         "(a new workdir's config.json shows the layout)") from None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        what = (f"a transformers checkpoint's (model_type={config['model_type']!r}: an export, which eval.py reads "
                "with --hf_checkpoint)" if isinstance(config, dict) and "model_type" in config else
                "not the one train.py writes (it has no 'model' section)")
        raise ValueError(f"{path} is {what}: {workdir} is not a training workdir; give the folder a run trained in")
    return config_dict.ConfigDict(config)


# Any other tokenizer would give the checkpoints' token ids other pieces, so the fix for a lost one is this very file.
RESTORE_TOKENIZER = (f"Restore {TOKENIZER_FILE} from a copy of the workdir or an export of it (python -m "
                     "deberta_jax.export writes it)")


def load_tokenizer(workdir: str | Path) -> Tokenizer:
    """The tokenizer of `workdir`'s checkpoints; missing or unreadable, it is named with `RESTORE_TOKENIZER` (neither
    a resumed run nor an evaluation reads config.data.tokenizer, the general advice)."""
    return tokenizer_lib.load_tokenizer(storage.path(workdir) / TOKENIZER_FILE, fix=(
        f"the checkpoints in {workdir} were trained with its token ids. {RESTORE_TOKENIZER}"))


def parse_step(text: str) -> int | str:
    """A `--checkpoint` flag's value as `select_step` takes it: 'latest', 'best' or a step number."""
    if text in ("latest", "best"):
        return text
    if text.isdigit():
        return int(text)
    raise ValueError(f"--checkpoint={text!r}: use 'latest', 'best' or a step number")


def select_step(manager: Manager, step: int | str | None, workdir) -> int:
    """`None` or "latest" -> latest, "best" -> lowest eval loss, int -> that step."""
    available = manager.all_steps()
    if not available:
        raise FileNotFoundError(f"no checkpoint in {storage.path(workdir) / CHECKPOINT_DIR}: the run has not saved "
                                "one yet (checkpoints are written every config.train.checkpoint_every steps)")
    if step in (None, "latest"):
        return manager.latest_step()
    if step == "best":
        best = manager.best_step()
        if best is None:
            raise FileNotFoundError(f"no best checkpoint in {workdir}: no eval loss was logged (config.data.eval_files "
                                    "was empty, or the run stopped before its first evaluation); pass --checkpoint "
                                    f"latest, or one of its steps {sorted(available)}")
        return best
    if step not in available:
        raise FileNotFoundError(f"no checkpoint for step {step} in {workdir}; available steps: {sorted(available)}")
    return step


def content_fingerprint(workdir: str | Path, step: int) -> str:
    """sha256 over everything a model loaded from checkpoint `step` of `workdir` depends on: the step's parameter
    files, the resolved config and the tokenizer. Caches of results computed from a run are keyed by it, so they
    stay valid when the workdir is moved or spelled differently and miss when the run is trained again."""
    step_dir = storage.path(workdir) / CHECKPOINT_DIR / str(step)
    if not step_dir.is_dir():
        raise FileNotFoundError(f"no checkpoint for step {step} in {workdir}")
    digest = hashlib.sha256(json.dumps(storage.fingerprints(step_dir / "params"), sort_keys=True).encode())
    for name in (CONFIG_FILE, TOKENIZER_FILE):
        digest.update(storage.read_bytes(storage.path(workdir) / name))
    return digest.hexdigest()


def resolve_step(workdir: str | Path, step: int | str | None = None) -> int:
    """The checkpoint step that `step` (as `load_workdir` takes it) names in `workdir`."""
    manager = checkpoint_manager(workdir, read_only=True)
    try:
        return select_step(manager, step, workdir)
    finally:
        manager.close()


def load_workdir(workdir: str | Path, step: int | str | None = None, **overrides
                 ) -> tuple[config_dict.ConfigDict, MaskedLM, Tokenizer]:
    """Rebuilds `(config, model, tokenizer)` from a training workdir, nothing else needed.

    `step`: None (or "latest") for the latest checkpoint, "best" for the lowest eval loss, or a step number.
    Only the parameters are read (not the optimizer state); they land on the default device.
    `overrides` replace `ModelConfig` fields that leave the parameters as they are (`ModelConfig.with_options`), e.g.
    `attention_kernel="blockwise"` to evaluate at lengths whose dense attention would not fit.
    """
    config = read_config(workdir)
    model_config = ModelConfig.from_dict(config.model.to_dict()).with_options(**overrides)
    tokenizer = load_tokenizer(workdir)
    manager = checkpoint_manager(workdir, read_only=True)
    chosen = select_step(manager, step, workdir)
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: MaskedLM(model_config, rngs=nnx.Rngs(params=0))))
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract_params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                                   nnx.to_pure_dict(abstract_state))
    try:
        with storage.deadline(_home(manager) / str(chosen), "fetch and check the checkpoint"):
            _verify(manager, chosen)
    except DamagedCheckpointError as err:
        others = sorted(set(manager.all_steps()) - {chosen})
        raise DamagedCheckpointError(f"checkpoint {chosen} is damaged: {err}. Load another step "
                                     f"(available: {others}), or resume training, which sets damaged ones aside."
                                     ) from None
    with storage.deadline(_home(manager) / str(chosen), "restore the parameters of"):
        restored = manager.restore(chosen, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
    manager.close()
    if not bool(_all_finite(restored.params)):  # a diverged run's save: every score and export would be NaN
        leaves = jax.tree_util.tree_flatten_with_path(restored.params)[0]
        bad = [jax.tree_util.keystr(path) for path, x in leaves if not np.isfinite(np.asarray(x)).all()]
        others = sorted(set(checkpoint_manager(workdir, read_only=True).all_steps()) - {chosen})
        raise DamagedCheckpointError(f"checkpoint {chosen} in {workdir} holds NaN or inf in {len(bad)} parameter(s), "
                                     f"e.g. {bad[:3]}; load another step (available: {others})")
    return config, nnx.merge(graphdef, restored.params), tokenizer
