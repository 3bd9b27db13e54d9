"""Shared by stages/*.py: run one stage from this checkout's own src/.

DVC queue runs execute in a temporary copy of the repo; putting that copy's src/ first on sys.path
makes the stage run the committed code it was queued with, not an editable install elsewhere.

dvc.yaml runs `python3` from PATH. When that interpreter lacks the project's dependencies (the venv was
not activated: `.venv/bin/dvc exp run ...` as the demo prints it), the stage re-runs itself with the
project's .venv interpreter, or says in one line what to do when there is none.
"""

from __future__ import annotations  # `Path | None` below must not fail on an older python3 from PATH

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def _venv_python() -> Path | None:
    for base in (ROOT, Path(os.environ["DVC_ROOT"]) if os.environ.get("DVC_ROOT") else None):
        if base is not None and (base / ".venv" / "bin" / "python").is_file():
            return base / ".venv" / "bin" / "python"
    return None


# The project's dependencies, looked up without importing them: importing MONAI alone costs ~4 s of CPU, which
# the data stages (no torch, no MONAI) need not pay, and the train and evaluate stages pay once, where they use it.
DEPENDENCIES = ("numpy", "yaml", "nibabel", "torch", "monai", "mlflow")


def _missing_dependency() -> str | None:
    from importlib.util import find_spec

    def installed(name: str) -> bool:
        spec = find_spec(name)
        return spec is not None and spec.origin is not None  # origin None: a leftover folder, no package in it

    return next((name for name in DEPENDENCIES if not installed(name)), None)


def _ensure_dependencies() -> None:
    missing = _missing_dependency()
    if missing is None:
        return
    venv = _venv_python()
    if venv is not None and Path(sys.prefix).resolve() != venv.parents[1].resolve() and not os.environ.get("VOXDIFF_REEXEC"):
        os.environ["VOXDIFF_REEXEC"] = "1"  # once: a broken venv must not loop
        os.execv(str(venv), [str(venv), *sys.argv])
    sys.exit(f"error: {sys.executable} has no module {missing!r}: run `make demo` (creates .venv) and "
             f"`source .venv/bin/activate`, then rerun")


def run(stage: str) -> None:
    if stage == "train":  # first: a SIGTERM while torch and MONAI load is noted, not fatal (voxdiff.runtime.stopping)
        from voxdiff.runtime import stopping

        stopping.defer()
    _ensure_dependencies()
    from voxdiff.entry import run_stage

    run_stage(stage)
