"""Training checkpoints: one file, loadable with torch.load(weights_only=True), written atomically and
durably (fsync of the file and its folder)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from voxdiff.errors import VoxdiffError
from voxdiff.fsutil import atomic_path

FORMAT_VERSION = 1
RESTART_HINT = "run `voxdiff train --restart` (or VOXDIFF_RESTART=1 dvc repro) to train from scratch over it"


def save(path: str | os.PathLike, state: dict) -> None:
    """Write `state` (tensors, numbers, strings, lists and dicts only) to `path`, never half-written:
    the previous checkpoint stays in place until the new one is complete on disk."""
    with atomic_path(path, durable=True) as tmp:
        torch.save({"format_version": FORMAT_VERSION, **state}, tmp)


def load(path: str | os.PathLike, map_location="cpu") -> dict:
    path = Path(path)
    if not path.is_file():
        raise VoxdiffError(f"{path}: checkpoint not found (run `dvc repro train` first)")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises several types for corrupt or foreign files
        raise VoxdiffError(f"{path}: not a readable voxdiff checkpoint ({type(e).__name__})") from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise VoxdiffError(f"{path}: checkpoint format {state.get('format_version') if isinstance(state, dict) else '?'} "
                           f"is not {FORMAT_VERSION}")
    return state


def resumable(path: str | os.PathLike, fingerprint: str, restart: bool = False,
              precision: str = "", fingerprint_at=None) -> tuple[dict | None, str]:
    """The checkpoint at `path` if it was made by this exact configuration, and a sentence saying why not.

    A checkpoint that cannot be read is refused (VoxdiffError), not silently trained over: it may hold
    days of progress that a fixable problem (a full disk, a copy in progress) only hides. `restart`
    trains from scratch whatever the file holds. An unfinished run that differs only in the resolved
    precision (`fingerprint_at(precision)` matches: train.precision auto on another machine) is refused
    too: resuming would switch bf16 <-> fp32 mid-run under tags that describe the first part.
    """
    path = Path(path)
    if restart:
        return None, "--restart: training from scratch" + (f" (over {path})" if path.exists() else "")
    if not path.is_file():
        return None, "no checkpoint: starting fresh"
    try:
        state = load(path)
    except VoxdiffError as e:
        raise VoxdiffError(f"{e}; it is kept: move it away, or {RESTART_HINT}") from None
    if state.get("fingerprint") != fingerprint:
        theirs = state.get("precision_resolved", "")
        if (fingerprint_at is not None and theirs and theirs != precision and not state.get("finished")
                and state.get("fingerprint") == fingerprint_at(theirs)):
            raise VoxdiffError(f"{path}: an unfinished run trained in {theirs}, but train.precision resolves to "
                               f"{precision} here: set train.precision: {theirs} to resume it exactly, or "
                               f"{RESTART_HINT}")
        return None, (f"{path} was made by other params, data or training code (fingerprint "
                      f"{state.get('fingerprint')} != {fingerprint}): starting fresh")
    if state.get("finished"):
        return state, f"{path} holds a finished run of this configuration (step {state['step']})"
    return state, f"resuming from {path} at step {state['step']} ({state['samples_seen']} samples seen)"
