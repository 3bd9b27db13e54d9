"""Which source files a module runs, and a hash of them: the code part of a training's identity.

A finished checkpoint stands for the code that trained it. DVC reruns the train stage after an edit to
any of its deps; the trainer then compares this hash with the one stored in the checkpoint, so an edit
to the training code retrains (it used to print "nothing to train" and keep the old weights) while an
edit to code outside the hash (tracking, plots, the plan: floors above the loop) rewrites the stage's
outputs from the finished model.
tests/test_layout.py checks that dvc.yaml's train deps are exactly this closure plus the stage entry.

We read the import graph with `ast` rather than from sys.modules: the result must not depend on what
happened to be imported already (tests, torchrun, a DVC queue worker all import differently).
"""

from __future__ import annotations

import ast
import functools
import hashlib
from pathlib import Path

SRC = Path(__file__).resolve().parents[2]  # .../src
TRAINING_MODULE = "voxdiff.pipeline.train"

# The package's floors (docs/development.md): a module imports only from its own floor and the floors below,
# which tests/test_layout.py checks. Keys are the first name under voxdiff (a package or a root module).
FLOORS = {
    "runtime": 0, "params": 0, "paramsdoc": 0,                  # errors, files, stops, device, the params schema
    "analysis": 1,                                              # convergence and statistics: numbers in and out
    "data": 2, "diffusion": 2, "training": 2, "evaluation": 2,  # the data, the model, the loop, the metrics
    "tracking": 3, "report": 3,                                 # recording (MLflow, DVC metrics) and reports
    "pipeline": 4, "advise": 4, "cli": 4, "entry": 4, "doctor": 4,  # stages and the commands on top
}
LOOP_FLOOR = FLOORS["training"]


def floor(module: str) -> int:
    """The floor of dotted module `module` (voxdiff itself: 0)."""
    parts = module.split(".")
    return FLOORS[parts[1]] if len(parts) > 1 else 0


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
    """`start` and every voxdiff module it imports, directly or not (parent packages included)."""
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


def training_sources() -> list[Path]:
    """The files whose code can change what training computes, sorted: the train stage and what it runs from the
    loop's floor and below (the runtime, analysis (the best point decides early stopping), data, model, loop).
    The floors above only record or draw what training did (tracking, report), and the stage's neighbours on
    its own floor only measure and refuse (the plan): an edit to them must not throw a finished run away (they
    are still deps of the stage, which then rewrites its outputs from the finished model)."""
    mods = [m for m in closure(TRAINING_MODULE) if m == TRAINING_MODULE or floor(m) <= LOOP_FLOOR]
    return sorted(module_file(m) for m in mods)


def _canonical(node) -> str:
    """A syntax tree as text: node types and fields only (no line numbers). Fields that are None or empty
    are left out, as Python 3.13's ast.dump does by default and earlier versions do not, so the text (and the
    hash) stays the same across Python versions for the same code."""
    if isinstance(node, ast.AST):
        fields = [f"{name}={_canonical(value)}" for name, value in ast.iter_fields(node)
                  if value is not None and value != []]
        return f"{type(node).__name__}({', '.join(fields)})"
    if isinstance(node, list):
        return f"[{', '.join(_canonical(x) for x in node)}]"
    return repr(node)


def source_hash(path: Path) -> str:
    """Hash of a file's syntax tree without its docstrings: a comment, a docstring or a reformatting cannot
    change what the code computes, so it must not make a run unresumable (the bytes' hash did)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:]
    return hashlib.sha256(_canonical(tree).encode()).hexdigest()[:16]


@functools.lru_cache(maxsize=1)
def training_code_hashes() -> dict[str, str]:
    """{path under src/: source_hash} of the training sources: per file, so that a refused resume can name
    the files that changed."""
    return {str(f.relative_to(SRC)): source_hash(f) for f in training_sources()}


def library_versions() -> str:
    """torch and MONAI as major.minor. A patch release fixes bugs without new numerics by policy, and a run
    resumed across one is like a run resumed on another GPU of the same kind (the last bits may differ): it
    must not make a run unresumable. A minor release may change kernels and defaults: it counts. Without the
    local part (+cpu, +cu128): a CPU and a CUDA build of one release compute the same on the same device."""
    import monai
    import torch

    def major_minor(version: str) -> str:
        return ".".join(version.split("+")[0].split(".")[:2])

    return f"torch {major_minor(torch.__version__)}, monai {major_minor(monai.__version__)}"


def training_code_hash() -> str:
    """One hash of the training sources and the libraries (the MLflow tag voxdiff.code_hash)."""
    h = hashlib.sha256()
    for name, digest in sorted(training_code_hashes().items()):
        h.update(f"{name}\0{digest}\0".encode())
    h.update(library_versions().encode())
    return h.hexdigest()[:16]
