"""Where MLflow runs live: one rule shared by the trainer, evaluate and compare."""

from __future__ import annotations

import os
from pathlib import Path

from voxdiff.fsutil import project_relative, project_root
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
    return f"sqlite:///{project_root(root) / 'mlflow.db'}"


def display_uri(uri: str, root: str | os.PathLike | None = None) -> str:
    """A tracking URI as a reader can use it: a SQLite store under the project as a relative path
    (sqlite:///mlflow.db), never the absolute path of the machine that made a report."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        inside = project_relative(db, root)
        return f"sqlite:///{inside}" if inside is not None else f"sqlite:///{db.name} (outside the project)"
    return uri
