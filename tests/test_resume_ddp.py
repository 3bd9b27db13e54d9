"""Real processes: resume after SIGKILL is bitwise exact, DDP on 2 gloo processes equals one process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import TINY, make_params, raw_params, without_timing, write_tiny_cache
from mlflow_server import free_port  # torchrun's port: a free one, so that runs side by side never share it

pytestmark = pytest.mark.slow


def project(root: Path, overrides: dict) -> Path:
    """A project root with the tiny cache and a params.yaml holding TINY + overrides."""
    root.mkdir(parents=True, exist_ok=True)
    write_tiny_cache(root)
    (root / "params.yaml").write_text(yaml.safe_dump(raw_params(**{**TINY, **overrides}), sort_keys=False))
    return root


NOT_INHERITED = ("DVC_", "WORLD_SIZE", "RANK", "LOCAL_RANK")  # set around pytest by `dvc exp run` or torchrun


def env_for(root: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(NOT_INHERITED)}
    env.update(MLFLOW_TRACKING_URI=f"sqlite:///{root / 'mlflow.db'}", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def train_cmd(root: Path) -> list[str]:
    return [sys.executable, "-m", "voxdiff.cli", "train", "--root", str(root), "--no-progress"]


def load_ckpt(root: Path) -> dict:
    return torch.load(root / "models" / "checkpoint.pt", weights_only=True)


def trained_here(root: Path, overrides: dict, monkeypatch) -> dict:
    """`project(root, overrides)` trained to its end in this test process, and its checkpoint: the code path of
    `voxdiff train` from `run_training` on, without a second interpreter's start-up (~6 s of CPU importing
    torch, MONAI and MLflow). The environment is env_for's, so the run logs to the project's own store."""
    from voxdiff.pipeline.train import run_training

    project(root, overrides)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", env_for(root)["MLFLOW_TRACKING_URI"])
    for name in [k for k in os.environ if k.startswith(NOT_INHERITED)]:
        monkeypatch.delenv(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # env_for's OMP_NUM_THREADS=1: a bit-for-bit comparison needs the same kernels' threads
    try:
        run_training(make_params(overrides), root, progress=False)
    finally:
        torch.set_num_threads(threads)  # the worker's later tests run as they would have
    return load_ckpt(root)


def same_tensors(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_tensors(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_tensors(x, y) for x, y in zip(a, b))
    return a == b


def test_resume_after_sigkill_is_bitwise_exact(tmp_path, monkeypatch):
    cfg = {"train.max_samples": 80, "train.batch_size": 1, "train.accumulate_every": 2,
           "train.checkpoint_every": 4, "train.val_every_samples": 8, "train.phema_snapshots": 10}
    ref = tmp_path / "ref"
    a = trained_here(ref, cfg, monkeypatch)  # the killed and resumed run below is two `voxdiff train` processes

    run = project(tmp_path / "run", cfg)
    proc = subprocess.Popen(train_cmd(run), env=env_for(run), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ckpt = run / "models" / "checkpoint.pt"
    deadline = time.time() + 120
    while not ckpt.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    time.sleep(0.7)  # let it run on past the checkpoint, into the middle of later windows
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "training finished before it could be killed"
    killed_at = load_ckpt(run)
    assert not killed_at["finished"] and 0 < killed_at["step"] < 40

    resumed = subprocess.run(train_cmd(run), env=env_for(run), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming from {ckpt} at step {killed_at['step']}" in resumed.stderr
    b = load_ckpt(run)
    for key in ("model", "ema", "optimizer", "gns"):
        assert same_tensors(a[key], b[key]), key
    # The snapshots are named after each run's fingerprint, which holds the training code: equal here
    # unless the code was edited between the two runs, which is no matter for exactness.
    assert same_tensors({k: v for k, v in a["phema"].items() if k != "run"},
                        {k: v for k, v in b["phema"].items() if k != "run"})
    assert (a["step"], a["samples_seen"]) == (b["step"], b["samples_seen"]) == (40, 80)
    # Post-hoc EMA: the same snapshots (10 per profile, none left over from past the kill), hence the
    # same reconstructed val losses.
    snaps = lambda root: sorted((root / "models" / "phema").glob("*.pt"))  # noqa: E731
    assert [p.name for p in snaps(run)] == sorted(f"{i}.{s}.{b['fingerprint']}.pt" for i in (0, 1) for s in range(4, 41, 4))
    assert [p.name.split(".")[:2] for p in snaps(ref)] == [p.name.split(".")[:2] for p in snaps(run)]
    for x, y in zip(snaps(ref), snaps(run)):
        assert same_tensors(torch.load(x), torch.load(y))
    ma, mb = (yaml.safe_load((r / "metrics" / "train_detail.json").read_text()) for r in (ref, run))
    assert {k: v for k, v in ma.items() if k.startswith("phema_")} == {k: v for k, v in mb.items() if k.startswith("phema_")}
    assert "phema_best_val_loss" in ma
    assert without_timing(a["history"]) == without_timing(b["history"])

    # The resumed training continued the same MLflow run without logging any step twice.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{run / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("voxdiff").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_id == b["mlflow_run_id"] and runs[0].info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(b["mlflow_run_id"], "train_loss")]
    assert sorted(steps) == list(range(1, 41))


def test_changed_params_start_fresh(tmp_path, monkeypatch):
    root = tmp_path / "p"
    trained_here(root, {"train.max_samples": 8, "train.batch_size": 1}, monkeypatch)  # finished, at lr 0.001
    (root / "params.yaml").write_text(yaml.safe_dump(raw_params(**{**TINY, "train.max_samples": 8, "train.batch_size": 1, "train.lr": 5.0e-4})))
    # `voxdiff train` in this process (trained_here's environment): resume across processes is the SIGKILL test's
    from click.testing import CliRunner

    from voxdiff.cli import main

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    second = CliRunner().invoke(main, ["train", "--root", str(root), "--no-progress"])
    assert second.exit_code == 0, second.output
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # the process's handlers, put back
    # a finished run: retrained, and the log names what changed
    assert "finished run of other training settings (train.lr 0.001 -> 0.0005)" in second.stderr
    assert "starting fresh" in second.stderr
    assert load_ckpt(root)["step"] == 4


def run_ddp(root: Path, port: int) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
           "-m", "voxdiff.cli", "train", "--root", str(root), "--no-progress"]
    out = subprocess.run(cmd, env=env_for(root), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def rel_diff(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).square().sum()) for k in a if a[k].is_floating_point())
    den = sum(float(a[k].double().square().sum()) for k in a if a[k].is_floating_point())
    return (num / den) ** 0.5


def test_ddp_two_gloo_processes_match_one_process(tmp_path, monkeypatch):
    """torchrun --nproc_per_node 2 (b=1, k=1) equals one process with b=1, k=2, over 7 samples: three full
    windows, then a last one that leaves one rank without a sample. With k=1 the noise scale is measured from
    each rank's local gradient (comm hook) and equals the single process's micro-batch estimate; the short
    last window is measured on neither side."""
    common = {"train.max_samples": 7, "train.batch_size": 1, "train.grad_clip": 0.0}
    single = tmp_path / "single"
    a = trained_here(single, {**common, "train.accumulate_every": 2}, monkeypatch)
    ddp = project(tmp_path / "ddp", {**common, "train.accumulate_every": 1})
    out = run_ddp(ddp, free_port())
    b = load_ckpt(ddp)
    assert b["step"] == a["step"] == 4 and b["samples_seen"] == a["samples_seen"] == 7
    assert [h["samples_seen"] for h in b["history"]] == [2, 4, 6, 7]
    assert rel_diff(a["model"], b["model"]) <= 1e-5
    assert "world size 2" in out.stderr and "not measurable" not in out.stderr
    ga, gb = a["gns"], b["gns"]
    assert gb["steps"] == ga["steps"] == 3  # the three full windows
    assert gb["grad_sq_ema"] == pytest.approx(ga["grad_sq_ema"], rel=1e-4)
    assert gb["trace_ema"] == pytest.approx(ga["trace_ema"], rel=1e-4)
    assert gb["trace_ema"] != 0.0
    # Post-hoc EMA under DDP: every rank built the tracker, rank 0 alone wrote the snapshots (one per step
    # here), the same as the single process's.
    sa, sb = (sorted((r / "models" / "phema").glob("*.pt")) for r in (single, ddp))
    assert [p.name.split(".")[:2] for p in sa] == [p.name.split(".")[:2] for p in sb] and len(sb) == 2 * 4
    as_float = lambda path: {k: v.float() for k, v in torch.load(path).items()}  # noqa: E731
    for x, y in zip(sa, sb):
        assert rel_diff(as_float(x), as_float(y)) <= 1e-3  # fp16 files of weights equal to 1e-5


def test_ddp_no_sync_accumulation_matches_one_process(tmp_path, monkeypatch):
    """2 processes x accumulate 2 (the no_sync path) equal 1 process x accumulate 4, with gradient
    clipping on: weights, EMA weights and the logged pre-clip gradient norms. The tiny model's norms are
    0.6-0.8, so the limit is 0.5 (the default 1.0 would never clip here and test nothing)."""
    common = {"train.max_samples": 16, "train.batch_size": 1, "train.grad_clip": 0.5}
    a = trained_here(tmp_path / "single", {**common, "train.accumulate_every": 4}, monkeypatch)
    ddp = project(tmp_path / "ddp", {**common, "train.accumulate_every": 2})
    run_ddp(ddp, free_port())
    b = load_ckpt(ddp)
    assert a["step"] == b["step"] == 4
    assert rel_diff(a["model"], b["model"]) <= 1e-5
    assert rel_diff(a["ema"], b["ema"]) <= 1e-5
    norms_a = [h["grad_norm"] for h in a["history"]]
    norms_b = [h["grad_norm"] for h in b["history"]]
    assert norms_b == pytest.approx(norms_a, rel=1e-5)
    assert min(norms_a) > 0.5  # clipping was active at every step, so the comparison covers it
