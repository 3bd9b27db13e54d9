"""Entry point of stages/<stage>.py (what `dvc repro` runs): load params.yaml, run one stage.

Kept apart from cli.py on purpose: a stage imports only its own code, so the train stage's DVC deps
(dvc.yaml) are exactly what training runs — an edit to `compare` or `sample` cannot rerun training.
VOXDIFF_DEBUG=1 shows tracebacks, as `voxdiff --debug` does.
"""

from __future__ import annotations

import importlib
import os
import warnings
from pathlib import Path

STAGES = {  # stage -> (module, function(params, root))
    "prepare": ("voxdiff.data.prepare", "run_prepare"),
    "preprocess": ("voxdiff.data.preprocess", "run_preprocess"),
    "train": ("voxdiff.pipeline.train", "run_training"),
    "evaluate": ("voxdiff.pipeline.evaluate", "run_evaluate"),
}


def quiet_library_warnings() -> None:
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="monai")
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


def run_stage(stage: str) -> None:
    from voxdiff.runtime.errors import exit_on_user_error
    from voxdiff.params import load

    root = Path(__file__).resolve().parents[2]
    debug = bool(os.environ.get("VOXDIFF_DEBUG"))
    if not debug:
        quiet_library_warnings()
    module, function = STAGES[stage]

    def run():
        params = load(root / "params.yaml")
        getattr(importlib.import_module(module), function)(params, root)

    exit_on_user_error(run, debug)
