"""The package's import graph: the train stage's DVC deps cover exactly what training imports, and no
module imports itself back through others (import cycles)."""

from __future__ import annotations

import ast
from pathlib import Path

import yaml

from conftest import REPO

SRC = REPO / "src"
TRAIN_MODULE = "voxdiff.training.train"  # what stages/train.py runs


def module_file(name: str) -> Path | None:
    """src/ path of dotted module `name` (voxdiff.x.y): x/y.py or x/y/__init__.py."""
    base = SRC.joinpath(*name.split("."))
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def imports_of(name: str) -> set[str]:
    """voxdiff modules that module `name` imports (at any depth of its code, lazy imports included)."""
    f = module_file(name)
    package = name if f.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            if not target.startswith("voxdiff"):
                continue
            for alias in node.names:  # `from . import x` may name a module
                sub = f"{target}.{alias.name}"
                out.add(sub if module_file(sub) else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("voxdiff"))
    return {m for m in out if module_file(m) and m != name}


def closure(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += imports_of(m)
            parent = m.rpartition(".")[0]
            if parent:  # importing a.b runs a/__init__.py first
                todo.append(parent)
    return seen


def all_modules() -> list[str]:
    return sorted(".".join(p.relative_to(SRC).with_suffix("").parts).removesuffix(".__init__")
                  for p in (SRC / "voxdiff").rglob("*.py"))


def test_train_stage_deps_cover_what_training_imports():
    stage = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["train"]
    deps = [d for d in stage["deps"] if d.startswith("src/")]
    for d in deps:
        assert (REPO / d).exists(), d
    needed = {str(module_file(m).relative_to(REPO)) for m in closure(TRAIN_MODULE)}
    covered = lambda f: any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps)  # noqa: E731
    assert [f for f in sorted(needed) if not covered(f)] == []
    # ... and nothing that training does not run: report and evaluation code stay out.
    for unrelated in ("src/voxdiff/report/compare.py", "src/voxdiff/evaluation/evaluate.py",
                      "src/voxdiff/diffusion/sampling.py", "src/voxdiff/cli.py"):
        assert not covered(unrelated), unrelated
    assert "mlflow" not in stage["params"]


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
