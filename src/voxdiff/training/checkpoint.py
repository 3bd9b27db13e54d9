"""Training checkpoints: one file, loadable with torch.load(weights_only=True), written atomically and
durably (fsync of the file and its folder)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from voxdiff.runtime.errors import VoxdiffError
from voxdiff.runtime.fsutil import atomic_path

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


def resumable(path: str | os.PathLike, parts: dict[str, str],
              restart: bool = False) -> tuple[dict | None, str]:
    """The checkpoint at `path` if it was made by this configuration (`parts`: Trainer.fingerprint_parts),
    and a sentence saying why or why not.

    Nothing that holds progress is trained over silently. A checkpoint that cannot be read is refused
    (VoxdiffError): a fixable problem (a full disk, a copy in progress) may hide days of progress. So is an
    unfinished run whose configuration changed: one line names what changed and how to restart deliberately
    (`restart` trains from scratch whatever the file holds). A finished run is retrained when what shapes
    training changed (the log names it), except for the resolved precision alone (train.precision auto on
    another machine), which is refused for both: resuming would switch bf16 <-> fp32 mid-run under tags that
    describe the first part, and retraining would replace a finished model only because of the machine.
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
    theirs = state.get("fingerprint_parts")
    if not isinstance(theirs, dict):  # written before the parts were stored: what differs cannot be named
        raise VoxdiffError(f"{path}: made by an older voxdiff whose fingerprint ({state.get('fingerprint')}) does "
                           "not say what it covers, so it cannot be matched to this configuration; it is kept: "
                           f"{RESTART_HINT}")
    changed = [k for k in {**theirs, **parts} if theirs.get(k) != parts.get(k)]
    run = f"{'a finished' if state.get('finished') else 'an unfinished'} run"
    if changed == ["precision"]:
        use = "to resume it exactly" if not state.get("finished") else "to use it"
        raise VoxdiffError(f"{path}: {run} trained in {theirs['precision']}, but train.precision resolves to "
                           f"{parts['precision']} here: set train.precision: {theirs['precision']} {use}, or "
                           f"{RESTART_HINT}")
    if changed and not state.get("finished"):
        raise VoxdiffError(f"{path}: {run} (step {state['step']}) was made with other training settings: "
                           f"{describe(changed, theirs, parts)}; set them back to resume it, or {RESTART_HINT}")
    if changed:
        return None, (f"{path} holds {run} of other training settings ({describe(changed, theirs, parts)}): "
                      "starting fresh")
    if state.get("finished"):
        return state, f"{path} holds a finished run of this configuration (step {state['step']})"
    return state, f"resuming from {path} at step {state['step']} ({state['samples_seen']} samples seen)"


def describe(changed: list[str], theirs: dict, ours: dict, most: int = 6) -> str:
    """What differs, checkpoint's value -> this configuration's, on one line: params and the run's setting
    first, then the training code's files (by name only: their hashes say nothing to a reader)."""
    def value(v: str | None) -> str:
        return "(none)" if v is None else (v if len(v) <= 40 else v[:37] + "...")

    settings = [f"{k} {value(theirs.get(k))} -> {value(ours.get(k))}" for k in changed if not k.startswith("code ")]
    files = [k[len("code "):].removeprefix("voxdiff/") for k in changed if k.startswith("code ")]
    items = settings + ([f"training code ({', '.join(files)})"] if files else [])
    return "; ".join(items[:most]) + (f"; and {len(items) - most} more" if len(items) > most else "")
