"""Shared by stages/*.py: run `voxdiff <stage>` from this checkout's own src/.

DVC queue runs execute in a temporary copy of the repo; putting that copy's src/ first on sys.path
makes the stage run the committed code it was queued with, not an editable install elsewhere.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def run(stage: str) -> None:
    from voxdiff.cli import stage_main

    stage_main(stage)
