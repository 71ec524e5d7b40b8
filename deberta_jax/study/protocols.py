"""The length study's evaluation protocols: what windows each scores, and how the report tabulates it.

A protocol is a `Protocol` in `PROTOCOLS`, the one list that `length_study.run_study` (scoring), `report` (its
summary tables) and the command lines (`eval.py --protocols`, a sweep's `eval.protocols`) read. Adding one is
this registry entry (and its window function, in `deberta_jax.data.targets` when it is a new way to cut the
stream) and a test: the study scores it, and the summary shows it under its `layout`, so no result of a
registered protocol can be left out of a report (`tests/study/test_protocols.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from deberta_jax.data import targets
from deberta_jax.data.targets import EvalCorpus, Windows

# How the report lays out a protocol's loss: one column per evaluation length (rows: model, policy, L), or one
# column per offset of the target span (rows: model, policy, evaluation length).
LAYOUTS = ("by_length", "by_offset")


@dataclasses.dataclass(frozen=True)
class Setting:
    """What a protocol's windows may depend on, for one model, corpus and evaluation length."""

    corpus: EvalCorpus
    eval_len: int
    train_len: int
    span: int  # centred-target span
    starts: np.ndarray | None  # stream positions of the target spans (`targets.centred_spans`), shared by lengths


@dataclasses.dataclass(frozen=True)
class Protocol:
    """An evaluation protocol: `windows(setting)` yields `(offset, windows)` pairs to score (offset None when the
    protocol has none); `per_position` keeps the loss per position bucket; `needs_starts` asks the study for the
    target spans; `layout` (`LAYOUTS`) is the summary table's."""

    name: str
    description: str
    windows: Callable[[Setting], Iterator[tuple[int | None, Windows]]]
    layout: str
    per_position: bool = False
    needs_starts: bool = False


def _chunked(setting: Setting):
    yield None, targets.chunked_windows(setting.corpus, setting.eval_len)


def _centred_target(setting: Setting):
    if setting.eval_len - 2 >= setting.span:  # a shorter window cannot hold the whole span: nothing to score
        yield None, targets.centred_windows(setting.corpus, setting.eval_len, setting.starts, setting.span)


PROTOCOLS = {
    "chunked": Protocol(
        "chunked", "the stream cut into consecutive windows of each length, every target scored once per length",
        _chunked, layout="by_length", per_position=True),
    "centred_target": Protocol(
        "centred_target", "the same target spans at the centre of windows of every length, inside their document",
        _centred_target, layout="by_length", needs_starts=True),
}
# Protocols no longer scored whose records committed results still hold, with the layout they were reported in:
# `fixed_target` placed its spans at offsets 0, L/2, L, 2L... from each window's start, across documents.
RETIRED_LAYOUTS = {"fixed_target": "by_offset"}


def get(name: str) -> Protocol:
    if name not in PROTOCOLS:
        raise ValueError(f"protocols: unknown protocol {name!r}; choose from {tuple(PROTOCOLS)}")
    return PROTOCOLS[name]


def layout_of(name: str) -> str:
    """The summary layout of protocol `name`: its registry entry's, a retired one's, or by length."""
    return PROTOCOLS[name].layout if name in PROTOCOLS else RETIRED_LAYOUTS.get(name, "by_length")
