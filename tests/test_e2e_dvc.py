"""End to end with real git, dvc and a real SQLite MLflow store, in a temporary repo (tiny config)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, TINY, raw_params

pytestmark = pytest.mark.slow

E2E = {**TINY, "data.label_values": [0, 1, 2, 3], "data.subjects": 4, "data.synth_spacing": 4.0,
       "data.val_subjects": 1, "preprocess.spacing": [12.0, 12.0, 12.0], "evaluate.sampling_steps": 3,
       "train.max_samples": 16, "train.batch_size": 1}


# One file whose edit must not retrain (report code) and one that reruns the train stage (training code).
UNRELATED_TO_TRAINING = "src/voxdiff/report/compare.py"
TRAINING_CODE = "src/voxdiff/training/trainer.py"
RECORDING_CODE = "src/voxdiff/tracking/runs.py"  # a train dep outside the code hash (a floor above the loop: codehash.FLOORS)


def sh(repo: Path, *cmd: str, check: bool = True, env=None) -> subprocess.CompletedProcess:
    out = subprocess.run(list(cmd), cwd=repo, capture_output=True, text=True, env=env or repo_env(repo), timeout=900)
    if check and out.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    return out


def repo_env(repo: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "DVC_", "PYTEST_"))}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t", GIT_COMMITTER_EMAIL="t@t")
    return env


def make_repo(path: Path, overrides: dict | None = None, baseline: bool = False) -> Path:
    """A fresh git + DVC repo holding the project as a user would clone it, with a tiny params.yaml; with
    `baseline`, also the committed baseline (dvc.lock, metrics, plots) a clone holds before `make demo`."""
    path.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("stages", "src"):
        shutil.copytree(REPO / name, path / name, ignore=ignore)
    shutil.copytree(REPO / "data" / "mni152", path / "data" / "mni152")
    for name in ("dvc.yaml", ".gitignore", ".dvcignore", "Makefile"):
        if (REPO / name).exists():
            shutil.copy(REPO / name, path / name)
    for name in baseline_files() if baseline else ():  # a clone's committed baseline: dvc.lock, metrics, plots
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, path / name)
    (path / "params.yaml").write_text(yaml.safe_dump(raw_params(**{**E2E, **(overrides or {})}), sort_keys=False))
    sh(path, "git", "init", "-q", "-b", "main")
    sh(path, "dvc", "init", "-q")
    sh(path, "dvc", "config", "core.analytics", "false")
    sh(path, "git", "add", "-A")
    sh(path, "git", "commit", "-qm", "init")
    return path


def baseline_files() -> list[str]:
    """The committed baseline's files in this checkout (git ls-files: dvc.lock and the pipeline's `cache: false`
    metrics and plots), which a fresh clone has before `make demo` rewrites them."""
    out = subprocess.run(["git", "ls-files", "--", "dvc.lock", "metrics", "plots"], cwd=REPO, capture_output=True,
                         text=True)
    return [name for name in out.stdout.splitlines() if (REPO / name).is_file()] if out.returncode == 0 else []


def experiment_refs(repo: Path) -> int:
    """How many experiments the repo holds: DVC writes refs/exps/<baseline sha as 2 + 38>/<name> when an experiment
    ends (its queue's own refs, refs/exps/celery/... and refs/exps/temp/..., are not experiments)."""
    refs = sh(repo, "git", "for-each-ref", "--format=%(refname)", "refs/exps").stdout.split()
    return sum(bool(re.fullmatch(r"refs/exps/[0-9a-f]{2}/[0-9a-f]{38}/[^/]+", ref)) for ref in refs)


def run_queue(repo: Path, grid: str, jobs: int, timeout_s: float = 600) -> None:
    """Queue the grid (one -S key=v1,v2,...; the whole pipeline), run the queue with `jobs` workers, wait; fail with
    the failed tasks' logs. It waits on the experiments' git refs (a git call) and asks `dvc queue status` (~1.5 s
    of CPU, taken from the trainings it waits for) only every 20 s and once their refs are all there."""
    import time

    expected = experiment_refs(repo) + len(grid.split("=", 1)[1].split(","))
    sh(repo, "dvc", "exp", "run", "--queue", "-S", grid)
    sh(repo, "dvc", "queue", "start", "-j", str(jobs))
    asked = time.time()
    deadline = asked + timeout_s
    status = ""
    while True:
        if time.time() > deadline:
            sh(repo, "dvc", "queue", "stop", "--kill", check=False)  # no training left running after the test
            raise AssertionError(f"the queue did not finish within {timeout_s:.0f} s:\n{status}")
        if experiment_refs(repo) >= expected or time.time() - asked > 20:
            status, asked = sh(repo, "dvc", "queue", "status").stdout, time.time()
            if "Queued" not in status and "Running" not in status:
                break
        time.sleep(0.5)
    failed = [line.split()[0] for line in status.splitlines() if "Failed" in line]
    assert not failed, status + "".join(sh(repo, "dvc", "queue", "logs", t, check=False).stdout[-3000:] for t in failed)


def mlflow_runs(repo: Path) -> list:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("voxdiff")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`voxdiff.kind` = 'train'")
    return client, runs


def without_venv(path: str) -> str:
    """PATH as a shell has it before `source .venv/bin/activate`: no entry into this project's .venv."""
    venv = (REPO / ".venv").resolve()
    return os.pathsep.join(p for p in path.split(os.pathsep)
                           if p and not Path(p).resolve().is_relative_to(venv) and Path(p) != Path(sys.executable).parent)


def make_variable(repo: Path, name: str) -> str:
    """A variable of the repo's Makefile, as `make demo` prints it (printed in single quotes: BASELINE holds
    `&& git commit`, which an unquoted echo would run)."""
    return sh(repo, "make", "-s", "--no-print-directory", "--eval", "print-%: ; @printf '%s\\n' '$($*)'",
              f"print-{name}").stdout.strip()


def show_width(repo: Path, *args: str) -> tuple[int, str]:
    """The widest line of `dvc exp show --no-pager ...` when the terminal never squeezes the table."""
    env = {**repo_env(repo), "COLUMNS": "100000"}
    out = sh(repo, "dvc", "exp", "show", "--no-pager", *args, env=env).stdout
    return max(len(line) for line in out.splitlines()), out


def test_pipeline_repro_experiments_and_queue(tmp_path):
    repo = make_repo(tmp_path / "proj", {"evaluate.samples_per_condition": 2}, baseline=True)  # 2: a diversity figure

    # 1. dvc repro runs the four stages and produces every declared output.
    out = sh(repo, "dvc", "repro")
    for stage in ("prepare", "preprocess", "train", "evaluate"):
        assert f"Running stage '{stage}'" in out.stdout
    for path in ("data/raw/index.json", "data/processed/images.npy", "data/processed/preview.png",
                 "models/checkpoint.pt", "metrics/train.json", "metrics/eval.json", "plots/convergence.png",
                 "metrics/train_detail.json", "metrics/eval_detail.json", "metrics/checkpoint.json"):
        assert (repo / path).is_file(), path
    # The DVC metrics are a few figures (tracking/dvc_metrics.py); every field is in the detail files.
    assert set(json.loads((repo / "metrics/train.json").read_text())) == {"val_loss", "plateau", "samples", "samples/s"}
    assert set(json.loads((repo / "metrics/eval.json").read_text())) == {"ssim", "ssim_floor", "diversity",
                                                                         "diversity_ref", "dice"}
    train = json.loads((repo / "metrics/train_detail.json").read_text())
    assert train["total_samples"] == 16 and train["effective_batch_size"] == 2
    client, runs = mlflow_runs(repo)
    assert len(runs) == 1 and runs[0].info.run_id == train["mlflow_run_id"]
    assert "eval_ssim" in runs[0].data.metrics  # evaluate logged into the training's run

    # 1b. The workspace as `make demo` leaves a fresh clone: nothing untracked, and what changed is what DVC's
    # convention commits (dvc.lock, the `cache: false` metrics and plots); the line `make demo` prints to make
    # this the baseline (Makefile BASELINE), run verbatim, leaves nothing to commit.
    status = sh(repo, "git", "status", "--porcelain", "--untracked-files=all").stdout.splitlines()
    assert not [line for line in status if line.startswith("??")], status
    assert status and all(line[3:].startswith(("dvc.lock", "metrics/", "plots/")) for line in status), status
    sh(repo, "bash", "-c", make_variable(repo, "BASELINE"))
    assert sh(repo, "git", "status", "--porcelain", "--untracked-files=all").stdout == ""

    # 2. Nothing changed: nothing reruns.
    again = sh(repo, "dvc", "repro")
    assert "Running stage" not in again.stdout

    # 2b. Edits that cannot change training (the report code, the MLflow experiment name) leave it alone ...
    ckpt = repo / "models" / "checkpoint.pt"
    before = ckpt.read_bytes()
    unrelated = repo / UNRELATED_TO_TRAINING
    unrelated.write_text(unrelated.read_text() + "\n# an edit that cannot change training\n")
    params_text = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params_text.replace("experiment: voxdiff", "experiment: voxdiff-renamed"))
    status = sh(repo, "dvc", "status", "train").stdout
    assert "changed" not in status, status
    (repo / "params.yaml").write_text(params_text)
    # ... an edit to recording code reruns the stage, which keeps the finished model ...
    recording = repo / RECORDING_CODE
    recording.write_text(recording.read_text() + "\n# a comment\n")
    rerun = sh(repo, "dvc", "repro", "train")
    assert "Running stage 'train'" in rerun.stdout and "nothing to train" in rerun.stderr
    assert ckpt.read_bytes() == before
    assert json.loads((repo / "metrics/train_detail.json").read_text())["mlflow_run_id"] == train["mlflow_run_id"]
    # ... and an edit to the training code trains again: the old weights do not stand for new code.
    trainer_py = repo / TRAINING_CODE
    # (code, not a comment: the code hash reads the syntax tree, so a comment alone changes nothing)
    trainer_py.write_text(trainer_py.read_text() + "\nA_FIX = 1\n")
    retrain = sh(repo, "dvc", "repro", "train")
    assert "training code" in retrain.stderr and "nothing to train" not in retrain.stderr
    retrained = json.loads((repo / "metrics/train_detail.json").read_text())
    assert retrained["mlflow_run_id"] != train["mlflow_run_id"]
    train = retrained

    # 3. The demo's next command exactly as `make demo` prints it (Makefile TRY_EXP), from a shell whose
    # PATH lacks the venv, as on a fresh clone after `make demo`: PATH's python3 has no torch, so every
    # stage re-runs itself with .venv's python (stages/_entry.py). An MLflow run named after the DVC
    # experiment, with the new setting.
    sh(repo, "dvc", "repro")  # evaluate too: the baseline's dvc.lock and metrics are what experiments compare to
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "baseline", check=False)
    (repo / ".venv").symlink_to(REPO / ".venv", target_is_directory=True)  # the .venv `make demo` made
    with open(repo / ".git" / "info" / "exclude", "a") as fh:
        fh.write(".venv\n")
    try_exp = make_variable(repo, "TRY_EXP")
    assert try_exp == f"{repo.resolve()}/.venv/bin/dvc exp run -S train.accumulate_every=4"
    bare = {**repo_env(repo), "PATH": without_venv(os.environ.get("PATH", ""))}
    no_deps = subprocess.run(["python3", "-c", "import torch"], env=bare, capture_output=True)
    assert no_deps.returncode != 0, "python3 on the PATH without the venv must lack torch for this test"
    exp = sh(repo, "bash", "-c", try_exp, env=bare)
    assert "Running stage 'train'" in exp.stdout and "Running stage 'prepare'" not in exp.stdout
    assert "Traceback" not in exp.stderr
    client, runs = mlflow_runs(repo)
    acc4 = [r for r in runs if r.data.params["train.accumulate_every"] == "4"]
    assert len(acc4) == 1
    p = acc4[0].data.params
    assert p["train.accumulate_every"] == "4" and p["effective_batch_size"] == "4"
    name = acc4[0].data.tags["voxdiff.dvc_exp_name"]
    assert name and acc4[0].info.run_name == name and name in sh(repo, "dvc", "exp", "ls", "--name-only").stdout
    val_steps = [m.step for m in client.get_metric_history(acc4[0].info.run_id, "val_loss")]
    assert len(val_steps) >= 2 and len(set(val_steps)) == len(val_steps)
    # ... and its other half, `voxdiff compare`, also verbatim, gives the MLflow view of the same runs.
    compare = sh(repo, "bash", "-c", make_variable(repo, "TRY_COMPARE"), env=bare)
    assert (repo / "reports" / "compare.md").is_file()
    assert "MLflow view of the same runs and groups against samples seen: http://127.0.0.1:5000/#/experiments/" in compare.stdout
    show = sh(repo, "dvc", "exp", "show", "--csv")
    header = show.stdout.splitlines()[0]
    assert "train.accumulate_every" in header and "val_loss" in header and "final_val_loss" not in header

    # 4. A 3-run grid from the committed baseline (accumulate 2), on 2 workers, into no MLflow store: two trainings
    # create one store at once, a worker then takes the third task, and the evaluations log into it from both
    # workers. Exactly one run per setting, with its params and its evaluation, in the user's repo root and not in
    # the deleted queue temp dirs, and the store's schema at MLflow's revision (as the migrations MLflow ran for the
    # first store left it). The store so far moves out of the repo (inside, as an untracked file, the queue would
    # commit it to each experiment). Every setting differs from the baseline's and the Try line's, so each trains.
    # (Read with sqlite3: this process's MLflow client keeps its engine on the path, now the moved store's file.)
    before = tmp_path / "mlflow-before-grid.db"
    (repo / "mlflow.db").rename(before)
    run_queue(repo, "train.accumulate_every=1,3,8", jobs=2)
    with sqlite3.connect(repo / "mlflow.db") as db:
        runs = db.execute(
            "select r.status, k.value, b.value, (select count(*) from latest_metrics m where m.run_uuid = r.run_uuid"
            " and m.key = 'eval_ssim') from runs r join experiments e on e.experiment_id = r.experiment_id"
            " and e.name = 'voxdiff' join tags t on t.run_uuid = r.run_uuid and t.key = 'voxdiff.kind'"
            " and t.value = 'train' left join params k on k.run_uuid = r.run_uuid and k.key = 'train.accumulate_every'"
            " left join params b on b.run_uuid = r.run_uuid and b.key = 'effective_batch_size'"
            " where r.lifecycle_stage = 'active' order by k.value").fetchall()
        (location,) = db.execute("select artifact_location from experiments where name='voxdiff'").fetchone()
        revision = db.execute("select version_num from alembic_version").fetchall()
    assert runs == [("FINISHED", k, k, 1) for k in ("1", "3", "8")], runs
    assert location.startswith("file://") and str(repo) in location
    with sqlite3.connect(before) as db:
        assert revision == db.execute("select version_num from alembic_version").fetchall() and len(revision) == 1
    # `dvc exp show --only-changed` fits a 160-column terminal. Before the DVC metrics were split it was 2467
    # characters wide (70 metric columns and a 32-character hash for each of models/checkpoint.pt and
    # metrics/train.json).
    width, table = show_width(repo, "--only-changed")
    assert width <= 160, table
    lines = table.splitlines()
    assert "checkpoint" in lines[1] and "models/checkpoint.pt" not in table and "val_loss" in lines[1]
    assert len([l for l in lines if "[" in l]) >= 4, table  # the Try line's experiment and the grid's three
    narrow = sh(repo, "dvc", "exp", "show", "--no-pager", "--only-changed", env={**repo_env(repo), "COLUMNS": "160"})
    assert "…" not in narrow.stdout, narrow.stdout  # nothing cut at 160 columns
