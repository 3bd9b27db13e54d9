"""The package's import graph: the train stage's DVC deps cover exactly what training imports, and no
module imports itself back through others (import cycles)."""

from __future__ import annotations

from pathlib import Path

import yaml

from conftest import REPO
from voxdiff.codehash import TRAINING_MODULE, closure, imports_of, module_file, training_sources

SRC = REPO / "src"


def all_modules() -> list[str]:
    return sorted(".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
                  for p in (SRC / "voxdiff").rglob("*.py"))


def test_train_stage_deps_cover_what_training_imports():
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]
    deps = [d for d in stage["deps"] if d.startswith("src/")]
    for d in deps:
        assert (REPO / d).exists(), d
    needed = {str(module_file(m).relative_to(REPO)) for m in closure(TRAINING_MODULE) | {"voxdiff.entry"}}
    covered = lambda f: any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)  # noqa: E731
    assert [f for f in sorted(needed) if not covered(f)] == []
    # ... and nothing that training does not run: report and evaluation code stay out.
    # ... and nothing that training does not run: report and evaluation code stay out.
    for unrelated in ("src/voxdiff/report/compare.py", "src/voxdiff/evaluation/evaluate.py",
                      "src/voxdiff/diffusion/sampling.py", "src/voxdiff/cli.py"):
        assert not covered(unrelated), unrelated
    assert "mlflow" not in stage["params"]
    # The stage's entry imports only training (the CLI, with compare and sample, stays out of the run).
    assert "voxdiff.cli" not in closure("voxdiff.entry") | closure(TRAINING_MODULE)


def test_training_code_hash_covers_training_but_not_recording():
    files = {str(f.relative_to(SRC)) for f in training_sources()}
    assert {"voxdiff/training/trainer.py", "voxdiff/diffusion/objective.py", "voxdiff/training/schedule.py",
            "voxdiff/params.py"} <= files
    assert not any(f.startswith(("voxdiff/tracking/", "voxdiff/report/")) for f in files)


def test_no_import_cycles():
    graph = {m: imports_of(m) for m in all_modules()}
    state: dict[str, str] = {}  # grey while on the DFS stack, black when done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = "grey"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "grey":
                cycles.append(path[path.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = "black"

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_bytecode_caches_are_not_part_of_directory_dependencies(tmp_path):
    """Python writes __pycache__/ into src/voxdiff/<package> when anything imports it (a stage, `voxdiff
    compare` through the editable install): in a directory dependency's hash it would mark `train` and
    `evaluate` changed and add hash columns to `dvc exp show --only-changed`."""
    import shutil
    import subprocess
    import sys

    dvc = Path(sys.executable).parent / "dvc"
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([str(dvc), "init", "-q"], cwd=tmp_path, check=True)
    shutil.copy(REPO / ".dvcignore", tmp_path / ".dvcignore")
    pyc = tmp_path / "src" / "voxdiff" / "training" / "__pycache__" / "train.cpython-311.pyc"
    pyc.parent.mkdir(parents=True)
    pyc.write_bytes(b"")
    (tmp_path / "src" / "voxdiff" / "training" / "train.py").write_text("")
    out = subprocess.run([str(dvc), "check-ignore", str(pyc.relative_to(tmp_path)), "src/voxdiff/training/train.py"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.split() == [str(pyc.relative_to(tmp_path))]
