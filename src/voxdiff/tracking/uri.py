"""Where MLflow runs live: one rule shared by the trainer, evaluate and compare."""

from __future__ import annotations

import os
from pathlib import Path

from voxdiff.runtime.fsutil import project_relative, project_root
from voxdiff.params import Params


def resolve_tracking_uri(params: Params | None = None, root: str | os.PathLike | None = None) -> str:
    """MLFLOW_TRACKING_URI, else params' mlflow.tracking_uri if non-empty, else sqlite:///<root>/mlflow.db.

    The root is DVC_ROOT when set (a queued DVC experiment runs in a temp copy that is deleted, taking a
    cwd-relative database with it), else ``root``, else the repo root above the current directory.
    """
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if params is not None and params.mlflow.tracking_uri.strip():
        return params.mlflow.tracking_uri.strip()
    return f"{SQLITE}{project_root(root) / 'mlflow.db'}"


SQLITE = "sqlite:///"


def sqlite_path(uri: str) -> Path | None:
    """The database file of a SQLite tracking URI (sqlite:///<path>), None for any other store."""
    return Path(uri[len(SQLITE):]) if uri.startswith(SQLITE) else None


def local_artifacts_dir(uri: str) -> Path | None:
    """Where MLflow keeps a run's artifacts on this machine: mlartifacts/ beside a SQLite database (the
    experiment's artifact location, set by tracking.runs.ensure_experiment), the folder of a file store
    (file://... or a plain path); None for a server, whose artifacts are not on this disk."""
    db = sqlite_path(uri)
    if db is not None:
        return db.resolve().parent / "mlartifacts"
    if uri.startswith("file://") or "://" not in uri:
        return Path(uri.removeprefix("file://"))
    return None


def display_uri(uri: str, root: str | os.PathLike | None = None) -> str:
    """A tracking URI as a reader can use it: a SQLite store under the project as a relative path
    (sqlite:///mlflow.db), never the absolute path of the machine that made a report."""
    db = sqlite_path(uri)
    if db is not None:
        inside = project_relative(db, root)
        return f"sqlite:///{inside}" if inside is not None else f"sqlite:///{db.name} (outside the project)"
    return uri
