"""A DVC stage run with a python3 that lacks the project's dependencies (the venv not activated, as after
`.venv/bin/dvc exp run ...`): stages/_entry.py re-runs it with the project's .venv, or, with no .venv,
fails with one line that says what to do. tests/test_e2e_dvc.py runs the demo's printed command this way."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, raw_params


def bare_env() -> dict:
    venv = (REPO / ".venv").resolve()
    path = [p for p in os.environ.get("PATH", "").split(os.pathsep)
            if p and not Path(p).resolve().is_relative_to(venv) and Path(p) != Path(sys.executable).parent]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DVC_", "VOXDIFF_", "PYTHON"))}
    return {**env, "PATH": os.pathsep.join(path)}


@pytest.fixture
def python3_without_deps():
    env = bare_env()
    exe = shutil.which("python3", path=env["PATH"])
    # the stage entry's own check (stages/_entry.py), run by that python3
    check = f"import sys; sys.path.insert(0, {str(REPO / 'stages')!r}); import _entry; print(_entry._missing_dependency())"
    missing = subprocess.run([exe, "-c", check], env=env, capture_output=True, text=True) if exe else None
    if missing is None or missing.returncode != 0 or missing.stdout.strip() == "None":
        pytest.skip("needs a python3 on PATH (outside the venv) without the project's dependencies")
    return exe, env


def project(tmp_path: Path, venv: bool) -> Path:
    root = tmp_path / "proj"
    shutil.copytree(REPO / "stages", root / "stages", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "src", root / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (root / "data").mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump(raw_params(**{"data.source": "no-such-folder"})))
    if venv:
        (root / ".venv").symlink_to(REPO / ".venv", target_is_directory=True)
    return root


def test_without_a_venv_one_line_says_what_to_do(tmp_path, python3_without_deps):
    exe, env = python3_without_deps
    root = project(tmp_path, venv=False)
    out = subprocess.run([exe, "../stages/prepare.py"], cwd=root / "data", env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "make demo" in lines[0], out.stderr
    assert "source .venv/bin/activate" in lines[0]


def test_with_the_projects_venv_the_stage_runs_in_it(tmp_path, python3_without_deps):
    """The stage gets past the dependency check into voxdiff's own code (here: a one-line user error
    about the missing data folder, exit 2), so it ran under .venv's python."""
    exe, env = python3_without_deps
    root = project(tmp_path, venv=True)
    out = subprocess.run([exe, "../stages/prepare.py"], cwd=root / "data", env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "no-such-folder" in last and "Traceback" not in out.stderr, out.stderr
