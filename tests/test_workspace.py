"""A clean workspace after `make demo`: every path the pipeline writes is either committed (DVC's convention for
the `cache: false` metrics and plots, with dvc.lock) or ignored by git (DVC's cached outputs, the persisted
models, MLflow's store, reports), so `git status` after the demo lists nothing untracked. Read from dvc.yaml and
git alone, without running anything; tests/test_e2e_dvc.py checks the same after a real pipeline run."""

from __future__ import annotations

import hashlib
import subprocess

import pytest
import yaml

from conftest import REPO

# Written by the pipeline or by the commands `make demo` prints, outside dvc.yaml's outs.
ALSO_WRITTEN = ["mlflow.db", "mlflow.db.lock", "mlruns/0/meta.yaml", "mlartifacts/1/x", "reports/compare.md",
                "reports/advise.md", "data/processed/preview.png", ".venv/bin/python", "src/voxdiff.egg-info/PKG-INFO",
                "src/voxdiff/__pycache__/cli.cpython-311.pyc"]


def git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


pytestmark = pytest.mark.skipif(git("rev-parse", "--git-dir").returncode != 0, reason="not a git checkout")


def outputs() -> list[tuple[str, bool, bool]]:
    """(path from the repo root, cache, persist) of every out, metric and plot file in dvc.yaml."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    found = []
    for stage in stages.values():
        wdir = stage.get("wdir", ".")
        for kind in ("outs", "metrics", "plots"):
            for entry in stage.get(kind, []):
                path, opts = (entry, {}) if isinstance(entry, str) else next(iter(entry.items()))
                rel = (REPO / wdir / path).resolve().relative_to(REPO.resolve()).as_posix()
                found.append((rel, opts.get("cache", True), opts.get("persist", False)))
    return found


def test_every_pipeline_output_is_committed_or_ignored():
    """`cache: false` metrics and plots (not persisted): committed to git, so that after the demo they show
    as modified, never untracked, and `git add dvc.lock metrics plots` commits the baseline. Everything else
    the pipeline writes: ignored (DVC refuses to cache a path git tracks, and models/ holds gigabytes)."""
    committed = set(git("ls-files").stdout.splitlines())
    for path, cache, persist in outputs():
        tracked = path in committed or any(name.startswith(path + "/") for name in committed)
        if not cache and not persist:
            assert path.startswith(("metrics/", "plots/")), f"{path}: a cache: false output outside metrics/ and plots/"
            assert tracked, (f"{path}: a `cache: false` output of dvc.yaml that git does not track: after `make demo` "
                             "it shows as untracked; commit the demo's (git add dvc.lock metrics plots)")
        else:
            assert not tracked, f"{path}: a DVC-cached or persisted output that git tracks"
            assert git("check-ignore", "-q", "--no-index", path).returncode == 0, f"{path}: not ignored by git"
    for path in ALSO_WRITTEN:
        assert git("check-ignore", "-q", "--no-index", path).returncode == 0, f"{path}: not ignored by git"


def test_the_committed_baseline_is_one_run():
    """The committed metrics and plots are the outputs the committed dvc.lock records (md5 and size of each
    file, size and file count of each folder): a baseline is one run's lock file and its figures, committed
    together, as the line `make demo` prints does."""
    lock = yaml.safe_load(git("show", "HEAD:dvc.lock").stdout or "{}").get("stages", {})
    committed = {}
    for name in git("ls-tree", "-r", "--name-only", "HEAD", "--", "metrics", "plots").stdout.splitlines():
        committed[name] = subprocess.run(["git", "show", f"HEAD:{name}"], cwd=REPO, capture_output=True).stdout
    checked = 0
    for path, cache, persist in outputs():
        if cache or persist:
            continue
        entry = next((o for s in lock.values() for o in s.get("outs", []) if o["path"] == path), None)
        assert entry is not None, f"{path}: not in the committed dvc.lock"
        if entry["md5"].endswith(".dir"):
            files = {n: b for n, b in committed.items() if n.startswith(path + "/")}
            assert (len(files), sum(map(len, files.values()))) == (entry["nfiles"], entry["size"]), path
        else:
            assert path in committed, f"{path}: not committed (git add dvc.lock metrics plots)"
            assert hashlib.md5(committed[path]).hexdigest() == entry["md5"], (
                f"{path}: the committed file is not the one the committed dvc.lock records: commit dvc.lock, "
                "metrics and plots of one run together (git add dvc.lock metrics plots)")
        checked += 1
    assert checked >= 8
