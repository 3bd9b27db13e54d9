"""`voxdiff doctor`: what a bug report needs, in one screen (device, precision, threads, versions, store)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def report(root: Path, params=None) -> list[tuple[str, str]]:
    """(label, value) lines; nothing here trains or writes."""
    import torch

    from voxdiff import __version__
    from voxdiff.training.distributed import auto_precision, pick_device

    requested = params.train.device if params else "auto"
    lines = [("voxdiff", __version__), ("python", platform.python_version()),
             ("platform", f"{platform.system()} {platform.machine()}")]
    try:
        device = pick_device(requested)
        dtype, why = auto_precision(device)
        auto = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        lines.append(("device", f"{device} (train.device: {requested})"))
        chosen = params.train.precision if params else "auto"
        lines.append(("precision", f"{auto if chosen == 'auto' else chosen} (train.precision: {chosen}; "
                                   f"auto picks {auto}: {why})"))
    except Exception as e:  # a bad device request is itself worth reporting
        lines.append(("device", f"error: {e}"))
    if torch.cuda.is_available():
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
        lines.append(("cuda", f"{torch.version.cuda}, {torch.cuda.device_count()} device(s): {names}"))
    else:
        lines.append(("cuda", "not available"))
    lines.append(("cpu", f"{os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}, "
                         f"capability {torch.backends.cpu.get_cpu_capability()}, "
                         f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}"))
    for name in ("torch", "monai", "mlflow", "dvc", "nibabel", "numpy"):
        lines.append((name, _version(name)))
    lines += tracking_lines(root, params)
    return lines


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "not installed"


def tracking_lines(root: Path, params) -> list[tuple[str, str]]:
    from voxdiff.tracking.uri import resolve_tracking_uri

    uri = resolve_tracking_uri(params, root)
    source = ("MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI")
              else "mlflow.tracking_uri" if params and params.mlflow.tracking_uri.strip() else "default")
    shown = uri
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        try:
            shown = f"sqlite:///{db.relative_to(root)} (relative to the project)"
        except ValueError:
            pass
    return [("tracking URI", f"{shown} [{source}]"), ("tracking store", reachable(uri))]


def reachable(uri: str) -> str:
    """Whether the store answers: a SQLite file's folder must exist; a server must answer a search."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        if db.is_file():
            return "reachable (database exists)"
        return "reachable (created on first run)" if db.parent.is_dir() else f"NOT reachable: {db.parent} missing"
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        return "reachable"
    except Exception as e:
        return f"NOT reachable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def print_report(root: Path, params, echo=print) -> None:
    lines = report(root, params)
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        echo(f"{k:<{width}}  {v}")
    if params is None:
        echo(f"{'params':<{width}}  no params.yaml under {root}: showing defaults")
    sys.stdout.flush()
