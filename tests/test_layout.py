"""The package's import graph: the train stage's DVC deps cover exactly what training imports, and no
module imports itself back through others (import cycles)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from conftest import REPO
from voxdiff.runtime.codehash import FLOORS, TRAINING_MODULE, closure, floor, imports_of, module_file, training_sources

SRC = REPO / "src"


def all_modules() -> list[str]:
    return sorted(".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
                  for p in (SRC / "voxdiff").rglob("*.py"))


def stage_deps(stage: str) -> tuple[list[str], callable]:
    """A dvc.yaml stage's src/ deps (each exists), and whether a repo path is among them or under one."""
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][stage]
    base = spec.get("wdir", ".")
    deps = [str(Path(base, d)).replace("\\", "/") for d in spec["deps"]]
    deps = [str((REPO / d).resolve().relative_to(REPO)) for d in deps if "src/" in d]
    for d in deps:
        assert (REPO / d).exists(), d
    return deps, lambda f: any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)


def test_train_stage_deps_cover_what_training_imports():
    deps, covered = stage_deps("train")
    needed = {str(module_file(m).relative_to(REPO)) for m in closure(TRAINING_MODULE) | {"voxdiff.entry"}}
    assert [f for f in sorted(needed) if not covered(f)] == []
    # ... and nothing that training does not run: report and evaluation code stay out.
    for unrelated in ("src/voxdiff/report/compare.py", "src/voxdiff/pipeline/evaluate.py",
                      "src/voxdiff/diffusion/sampling.py", "src/voxdiff/cli.py"):
        assert not covered(unrelated), unrelated
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]
    assert "mlflow" not in spec["params"]
    # The stage's entry imports only training (the CLI, with compare and sample, stays out of the run).
    assert "voxdiff.cli" not in closure("voxdiff.entry") | closure(TRAINING_MODULE)


@pytest.mark.parametrize("stage, module", [("prepare", "voxdiff.data.prepare"),
                                           ("preprocess", "voxdiff.data.preprocess"),
                                           ("evaluate", "voxdiff.pipeline.evaluate")])
def test_every_other_stage_depends_on_the_code_it_runs(stage, module):
    """An edit to code a stage runs reruns it (DVC does not follow imports): its deps cover its import closure.
    Negative control: training's loop is not among evaluate's deps (evaluate reads the checkpoint only)."""
    deps, covered = stage_deps(stage)
    needed = {str(module_file(m).relative_to(REPO)) for m in closure(module) | closure("voxdiff.entry")}
    assert [f for f in sorted(needed) if not covered(f)] == []
    assert not covered("src/voxdiff/training/trainer.py") and not covered("src/voxdiff/pipeline/train.py")


def test_imports_run_down_the_floors():
    """runtime at the bottom, then analysis, then data / model / loop / metrics, then recording and reports, and
    the stages and commands on top (codehash.FLOORS): no module imports from a floor above its own. The rule is
    live: the floor of the pre-layout upward import diffusion.sampling -> the pipeline's stage is higher."""
    def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
        return [(m, i) for m in sorted(graph) for i in sorted(graph[m]) if floor(i) > floor(m)]

    assert all(m.split(".")[1] in FLOORS for m in all_modules() if m != "voxdiff")
    assert upward({m: imports_of(m) for m in all_modules()}) == []
    # Negative controls: imports of the old layout, under today's names, are caught (statistics read run records
    # from report.loading; the train stage's plan sat beside the loop and read the tracking URI).
    assert upward({"voxdiff.analysis.statistics": {"voxdiff.report.loading"},
                   "voxdiff.training.trainer": {"voxdiff.pipeline.plan", "voxdiff.runtime.distributed"}}) == [
        ("voxdiff.analysis.statistics", "voxdiff.report.loading"), ("voxdiff.training.trainer", "voxdiff.pipeline.plan")]
    # The analysis floor is numbers in and out: it imports nothing of voxdiff but the runtime and itself.
    assert {i for m in all_modules() if m.startswith("voxdiff.analysis") for i in imports_of(m)
            if not i.startswith("voxdiff.analysis")} <= {m for m in all_modules() if floor(m) == 0}


def test_training_code_hash_covers_training_but_not_recording():
    files = {str(f.relative_to(SRC)) for f in training_sources()}
    assert {"voxdiff/training/trainer.py", "voxdiff/diffusion/objective.py", "voxdiff/training/schedule.py",
            "voxdiff/params.py", "voxdiff/pipeline/train.py", "voxdiff/analysis/convergence.py"} <= files
    assert not any(f.startswith(("voxdiff/tracking/", "voxdiff/report/")) for f in files)
    assert "voxdiff/pipeline/plan.py" not in files  # imported by the stage, but it only measures and refuses


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
    pyc = tmp_path / "src" / "voxdiff" / "pipeline" / "__pycache__" / "train.cpython-311.pyc"
    pyc.parent.mkdir(parents=True)
    pyc.write_bytes(b"")
    (tmp_path / "src" / "voxdiff" / "pipeline" / "train.py").write_text("")
    out = subprocess.run([str(dvc), "check-ignore", str(pyc.relative_to(tmp_path)), "src/voxdiff/pipeline/train.py"],
                         cwd=tmp_path, capture_output=True, text=True)
    assert out.stdout.split() == [str(pyc.relative_to(tmp_path))]
