"""Atomic file and directory writes: outputs appear whole or not at all."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, durable: bool = False) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; rename it onto ``final`` only if the block succeeds.

    Works for files and directories alike (whatever the block creates at the yielded path). durable
    (files): fsync the new file before the rename and the folder after it, so that a power loss or
    a killed VM leaves either the previous file or the complete new one, never an empty one (the
    rename alone can reach the disk before the data does).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    target = tmp / final.name
    try:
        yield target
        if durable and target.is_file():
            fsync_path(target)
        if final.is_dir() and not final.is_symlink():
            shutil.rmtree(final)
        os.replace(target, final)
        if durable:
            fsync_path(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def fsync_path(path: str | os.PathLike) -> None:
    """Flush a file's or a folder's entries to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_writable(path: str | os.PathLike) -> None:
    """Fail before long work (sampling: minutes) rather than after: `path`'s folder must be creatable and
    writable, and `path` itself if it exists. One line naming `path` (VoxdiffError)."""
    from voxdiff.runtime.errors import VoxdiffError

    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise VoxdiffError(f"{path}: cannot create its folder ({e.strerror or type(e).__name__})") from None
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise VoxdiffError(f"{path}: not writable")


def write_json(path: str | os.PathLike, obj) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def repo_root() -> Path:
    """The project root: the directory holding params.yaml (stages run there)."""
    here = Path.cwd().resolve()
    for p in (here, *here.parents):
        if (p / "params.yaml").is_file() and (p / "dvc.yaml").is_file():
            return p
    return here


def project_root(root: str | os.PathLike | None = None) -> Path:
    """DVC_ROOT when set (a queued DVC experiment runs in a temporary copy of the project), else
    `root`, else the repo root above the current directory."""
    return Path(os.environ.get("DVC_ROOT") or root or repo_root()).resolve()


def project_relative(path: str | os.PathLike, root: str | os.PathLike | None = None) -> str | None:
    """`path` relative to the project root, or None outside it: what reports print instead of a
    machine's absolute path."""
    try:
        return str(Path(path).resolve().relative_to(project_root(root)))
    except ValueError:
        return None
