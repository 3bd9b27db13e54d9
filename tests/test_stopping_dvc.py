"""SIGTERM to the process group of `dvc repro train` on a loaded machine (issue 36 item 11), with real git, DVC
and MLflow: the step made slow by a hook that sleeps inside it (sitecustomize, in the stage's process).

DVC installs no SIGTERM handler (dvc/stage/run.py ignores only SIGINT while the stage runs): `dvc repro`
dies at once (-15) and the stage, in the same group, goes on alone to the end of its step and saves in the
background (measured: 6.8 s after dvc's exit with a 3 s step). Two ways it then died before its save:
- a reader of its output gone with the group (`dvc repro train 2>&1 | tee log`): the next progress line
  raised BrokenPipeError;
- a SIGTERM while the stage was still starting up (imports, data, MLflow: slow under load): SIGTERM's
  default action, no line, no checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from test_e2e_dvc import make_repo, repo_env, sh

pytestmark = pytest.mark.slow

HOOK = r'''
"""Test hook: VOXDIFF_SLOW_STEP_S seconds of sleep inside every Trainer.train_step (a loaded machine), and
a marker file VOXDIFF_STEP_MARK written when a step starts."""
import os
import sys

if os.environ.get("VOXDIFF_SLOW_STEP_S"):
    import importlib.abc
    import importlib.util

    class _Patch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "voxdiff.training.trainer":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                import time
                step = module.Trainer.train_step

                def slow_step(self, *a, **k):
                    with open(os.environ["VOXDIFF_STEP_MARK"], "a") as f:
                        f.write(f"{self.counters.step}\n")
                    time.sleep(float(os.environ["VOXDIFF_SLOW_STEP_S"]))
                    return step(self, *a, **k)

                module.Trainer.train_step = slow_step

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Patch())
'''


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    root = make_repo(tmp_path_factory.mktemp("stop") / "repo",
                     {"train.max_samples": 64, "train.checkpoint_every": 1000, "train.val_every_samples": 1})
    sh(root, "dvc", "repro", "preprocess")
    hook = root.parent / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOOK)
    return root


def start(repo: Path, mark: Path, stderr) -> subprocess.Popen:
    for stale in (repo / "models" / "checkpoint.pt", mark, repo / "mlflow.db"):
        stale.unlink(missing_ok=True)
    env = {**repo_env(repo), "PYTHONPATH": str(repo.parent / "hook"), "VOXDIFF_SLOW_STEP_S": "3",
           "VOXDIFF_STEP_MARK": str(mark)}
    return subprocess.Popen(["dvc", "repro", "train"], cwd=repo, env=env, stdin=subprocess.DEVNULL,
                            stdout=stderr, stderr=stderr, start_new_session=True)


def wait_for_group(pgid: int, timeout_s: float = 300) -> None:
    """Until no process of the group is left (the stage outlives dvc)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    os.killpg(pgid, signal.SIGKILL)
    raise AssertionError("the stage did not end within its grace")


def mlflow_statuses(repo: Path) -> list[str]:
    from mlflow import MlflowClient

    if not (repo / "mlflow.db").exists():
        return []
    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("voxdiff")
    return [r.info.status for r in client.search_runs([exp.experiment_id])] if exp else []


def test_sigterm_to_the_group_with_its_output_reader_gone_still_saves(repo):
    """The group is signalled as the second step starts and the reader of the stage's output goes with it (as
    tee does): dvc exits at once, the stage ends its step and saves at that boundary."""
    mark = repo.parent / "steps"
    read, write = os.pipe()
    proc = start(repo, mark, write)
    os.close(write)
    deadline = time.time() + 300
    while not (mark.exists() and "1" in mark.read_text().split()) and time.time() < deadline:
        time.sleep(0.1)
    sent = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    os.close(read)  # the reader is gone: every later write to the stage's stderr is EPIPE
    assert proc.wait(timeout=60) == -signal.SIGTERM  # dvc: no handler, exits at once
    wait_for_group(proc.pid)
    ckpt = repo / "models" / "checkpoint.pt"
    assert ckpt.exists(), "the stage ended before its save"
    state = torch.load(ckpt, weights_only=True)
    assert state["step"] == 2 and not state["finished"]
    assert ckpt.stat().st_mtime - sent < 3 + 30  # the step's remaining sleep and compute, then the save
    assert mlflow_statuses(repo) == ["KILLED"]


def test_sigterm_to_the_group_while_the_stage_starts_up_ends_it_cleanly(repo, tmp_path):
    """The group is signalled as soon as the stage's python runs (imports of torch and MONAI still under way):
    the stop is noted, not fatal; the stage says so and ends, its MLflow run (if any) KILLED, not RUNNING."""
    mark = repo.parent / "steps"
    log = tmp_path / "log"
    with open(log, "w") as out:
        proc = start(repo, mark, out)
        deadline = time.time() + 120
        while time.time() < deadline:
            found = subprocess.run(["pgrep", "-g", str(proc.pid), "-f", "stages/train.py"], capture_output=True,
                                   text=True).stdout.split()
            if [p for p in found if int(p) != proc.pid]:
                break
            time.sleep(0.05)
        time.sleep(0.5)  # inside the stage's start-up
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        wait_for_group(proc.pid)
    text = log.read_text()
    assert "[voxdiff train] stopped before" in text, text[-3000:]
    assert not mark.exists()  # no step was taken
    assert "RUNNING" not in mlflow_statuses(repo)
