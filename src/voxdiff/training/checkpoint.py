"""Training checkpoints: one file, loadable with torch.load(weights_only=True), written atomically."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from voxdiff.errors import VoxdiffError
from voxdiff.fsutil import atomic_path

FORMAT_VERSION = 1


def save(path: str | os.PathLike, state: dict) -> None:
    """Write `state` (tensors, numbers, strings, lists and dicts only) to `path`, never half-written."""
    with atomic_path(path) as tmp:
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


def resumable(path: str | os.PathLike, fingerprint: str) -> tuple[dict | None, str]:
    """The checkpoint at `path` if it was made by this exact configuration, and a sentence saying why not."""
    path = Path(path)
    if not path.is_file():
        return None, "no checkpoint: starting fresh"
    try:
        state = load(path)
    except VoxdiffError as e:
        return None, f"{e}: starting fresh"
    if state.get("fingerprint") != fingerprint:
        return None, (f"{path} was made by other params or data (fingerprint {state.get('fingerprint')} "
                      f"!= {fingerprint}): starting fresh")
    if state.get("finished"):
        return state, f"{path} holds a finished run of this configuration (step {state['step']})"
    return state, f"resuming from {path} at step {state['step']} ({state['samples_seen']} samples seen)"
