"""A trained workdir as a transformers checkpoint directory: the model through `hf.save`, the tokenizer as
`tokenizer.json` plus the `tokenizer_config.json` that tells `AutoTokenizer` how to read it.

Nothing here needs transformers: the files are the documented formats, written with `tokenizers`,
`safetensors` and JSON, and the tests load them with transformers to prove it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from deberta_jax import storage
from deberta_jax.data.tokenizer import SPECIAL_TOKENS, SpecialIds
from deberta_jax.model import hf
from deberta_jax.model.encoder import MaskedLM
from deberta_jax.storage import atomic
from deberta_jax.train import checkpoint

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
EXPORTED_FILES = (hf.CONFIG_FILE, hf.WEIGHTS_FILE, hf.TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)
# The class every transformers version maps to a tokenizer.json-backed tokenizer (v5 writes "TokenizersBackend",
# which v4 does not know).
_TOKENIZER_CLASS = "PreTrainedTokenizerFast"


def save_tokenizer(tokenizer: Tokenizer, path: str | os.PathLike, *, model_max_length: int, token_types: bool) -> None:
    """Write `tokenizer` for `AutoTokenizer.from_pretrained(path)`, with this project's special tokens in their
    transformers roles; `token_types` says whether the model takes `token_type_ids`."""
    SpecialIds.from_tokenizer(tokenizer)  # every special token is there, or an error naming the missing one
    tokenizer.save(os.path.join(path, hf.TOKENIZER_FILE))
    # SpecialIds' fields follow SPECIAL_TOKENS: pad, unk, cls, sep, mask -> pad_token="[PAD]", ...
    roles = {f"{field.name}_token": token for field, token in zip(dataclasses.fields(SpecialIds), SPECIAL_TOKENS)}
    inputs = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    config = {"tokenizer_class": _TOKENIZER_CLASS, **roles, "model_max_length": model_max_length,
              "model_input_names": inputs}
    with open(os.path.join(path, TOKENIZER_CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")


def check_out_dir(out: str | os.PathLike) -> None:
    """Refuses a directory holding files an export does not write (another checkpoint's `pytorch_model.bin` or
    `spm.model` beside ours would be read in place of, or mixed with, the exported files), and a bucket that
    cannot be written, before the model is loaded."""
    out = storage.path(out)
    if storage.is_remote(out):  # a local folder is made by the export itself, and only when it succeeds
        storage.check_writable(out, "--out")
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out={out} is a file; name a directory")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORTED_FILES) if out.is_dir() else []
    if foreign:
        raise FileExistsError(f"--out={out} already holds {foreign[:5]}, which an export does not write; "
                              "choose an empty or new directory")


def export_model(model: MaskedLM, tokenizer: Tokenizer, out: str | os.PathLike) -> list[str]:
    """Write `model` and `tokenizer` to `out`; returns the lengths past which transformers' logits differ
    (`hf.export_differences`, also warned). Raises `hf.ExportError` naming any field transformers lacks.

    The files are written to a temporary directory beside `out` and renamed into it once all are complete, so a
    killed export leaves `out` as it was; the next export removes what a killed one left (`atomic`). For `out` in a
    bucket they are written to a local temporary directory and then uploaded, each file whole: a killed upload
    may leave some files of an earlier export beside new ones, which the next export replaces.
    """
    check_out_dir(out)
    out = storage.path(out)
    if storage.is_remote(out):
        with tempfile.TemporaryDirectory(prefix="deberta-jax-export-") as staging:
            with _reporting_no_room(Path(staging).parent, f"to stage the export before its upload to {out}",
                                    "set TMPDIR to a folder on a disk with room"):
                notes = _write(model, tokenizer, Path(staging))
            storage.upload_tree(staging, out)
        return notes
    atomic.remove_abandoned(out)
    staging = atomic.temporary(out)
    try:
        with _reporting_no_room(out, "to write the export", "give an --out on a disk with room"):
            notes = _write(model, tokenizer, staging)
        out.mkdir(parents=True, exist_ok=True)
        for name in EXPORTED_FILES:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return notes


@contextlib.contextmanager
def _reporting_no_room(folder, what: str, other: str):
    """A write that found no room (`storage.no_room`; safetensors raises its own error type) as one line naming
    `folder`; the partial files are the staging folder's, which the caller removes."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - kept as it was unless it says there was no room
        if not storage.no_room(err):
            raise
        raise OSError(f"{folder}: no room {what} (the disk is full, or a file-size or quota limit was reached); "
                      f"nothing was written there. Free space on its disk, or {other}") from None


def _write(model: MaskedLM, tokenizer: Tokenizer, folder: Path) -> list[str]:
    """The exported files in local `folder`; returns `hf.save`'s notes."""
    notes = hf.save(model, folder, pad_token_id=SpecialIds.from_tokenizer(tokenizer).pad)
    save_tokenizer(tokenizer, folder, model_max_length=model.cfg.max_position_embeddings,
                   token_types=model.cfg.type_vocab_size > 0)
    return notes


def export_workdir(workdir: str | os.PathLike, out: str | os.PathLike, step: int | str | None = None) -> list[str]:
    """Export a training workdir's checkpoint (`step` as in `checkpoint.load_workdir`) to `out`; either may be in a
    bucket. `out` is checked before the model is loaded. The notes say where transformers' logits differ
    (`export_model`), and when the step exported is not the run's last (an unfinished or stopped run)."""
    check_out_dir(out)
    chosen = checkpoint.resolve_step(workdir, step)
    config, model, tokenizer = checkpoint.load_workdir(workdir, chosen)
    notes = export_model(model, tokenizer, out)
    planned = config.get("train", {}).get("num_steps")
    if planned is not None and chosen < planned:
        notes.append(f"exported step {chosen} of the {planned} that {workdir} is configured to train "
                     "(config.train.num_steps): the run is unfinished or was stopped early, or an earlier step was "
                     "asked for")
    return notes
