"""`voxdiff train --plan` and the disk check every training runs first (pipeline/plan.py)."""

from __future__ import annotations

import collections
import math
import shutil

import pytest
import torch
import yaml
from click.testing import CliRunner

from conftest import REPO, TINY, make_params, raw_params
from voxdiff.runtime.errors import VoxdiffError
from voxdiff.params import load
from voxdiff.pipeline import plan
from voxdiff.training import posthoc_ema

# 10 samples at effective batch 2 x 2 = 4: ceil(10 / 4) = 3 steps, the last a window of 2.
CASE = {"train.max_samples": 10, "train.batch_size": 2, "train.accumulate_every": 2}
Usage = collections.namedtuple("Usage", "total used free")


def fake_free(monkeypatch, free: int) -> None:
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10**13, 10**13 - free, free))


def test_plan_on_the_tiny_config_prints_the_fields_with_the_right_arithmetic(tiny_root):
    p = make_params(CASE)
    out: list[str] = []
    result = plan.run_plan(p, tiny_root, steps=1, echo=out.append)
    e = result["events"]
    assert (e["total_steps"], e["total_samples"], e["effective_batch"]) == (math.ceil(10 / 4), 10, 4)
    # val_every_samples 2: every window crosses one; checkpoint_every 2: after step 2, and the finished one;
    # 20 snapshot points in 10 samples: one per step; the probe (every 768 samples) only at the end.
    assert (e["validations"], e["checkpoints"], e["snapshots"], e["probes"]) == (3, 2, 3, 1)

    from voxdiff.diffusion.model import build_network

    net = build_network(p.model, 3)
    weights = sum(v.numel() for v in net.state_dict().values() if v.is_floating_point())
    assert result["sizes"]["weights"] == weights
    tensors = sum(v.is_floating_point() for v in net.state_dict().values())
    assert result["snapshot_bytes"] == (weights * 2 + plan.SNAPSHOT_TENSOR_OVERHEAD_BYTES * tensors) * 2 * 3
    # The estimate against the checkpoint the plan wrote (history of 2 steps against 3: 200 B), which holds no
    # best-point EMA copies yet (no validation has been judged): the end of the run holds best_copies(3) = 2.
    one_copy = 4 * weights + plan.TENSOR_OVERHEAD_BYTES * tensors
    assert plan.best_copies(3) == 2
    assert result["checkpoint_bytes"] == pytest.approx(
        result["measured"]["checkpoint_measured_bytes"] + 2 * one_copy, rel=0.03)
    assert result["checkpoint_bytes"] > result["measured"]["checkpoint_measured_bytes"] + 1.5 * one_copy
    d, = result["disk"]  # one file system here: checkpoint twice, the snapshots, the MLflow model, no DVC
    assert d["need"] == 2 * result["checkpoint_bytes"] + result["snapshot_bytes"] + 4 * weights and d["ok"]
    m, pred = result["measured"], result["predicted"]
    assert pred["parts"]["training steps"] == pytest.approx(3 * m["step_s"])
    assert pred["parts"]["validation"] == pytest.approx(3 * m["validation_s"])
    assert pred["probe_gradients"] == 2 * (TINY["train.gns_buckets"] * TINY["train.gns_bucket_samples"]
                                           + TINY["train.gns_probe_samples"])  # two passes over each gradient
    assert pred["total_s"] == pytest.approx(sum(pred["parts"].values()))
    text = "\n".join(out)
    for field in ("budget", "10 samples in 3 optimizer steps of effective batch 4", "ceil(10 / 4)", "checkpoint",
                  "snapshots", "DVC cache copy", "disk", "memory", "step time", "predicted", "rank-0 pause"):
        assert field in text, field
    # Nothing of the run written: no models/, no scratch left behind, no MLflow store
    assert not (tiny_root / "models").exists() and not list(tiny_root.glob(".voxdiff-plan-*"))
    assert not (tiny_root / "mlflow.db").exists()


def test_checkpoint_estimate_matches_a_real_training(tiny_root):
    from voxdiff.pipeline.train import run_training

    p = make_params(CASE)
    run_training(p, tiny_root, progress=False)
    events = plan.count_events(p.train)
    real = (tiny_root / "models" / "checkpoint.pt").stat().st_size
    assert plan.checkpoint_bytes(plan.sizes_for(p, 3), p.train, events) == pytest.approx(real, rel=0.03)
    snaps = sorted((tiny_root / "models" / "phema").glob("*.pt"))
    assert len(snaps) == events.snapshots * len(p.train.phema_sigma_rels)
    per_set = plan.snapshot_set_bytes(plan.sizes_for(p, 3), p.train)
    assert sum(f.stat().st_size for f in snaps) == pytest.approx(events.snapshots * per_set, rel=0.05)


def test_training_is_refused_when_the_disk_cannot_hold_it(tiny_root, monkeypatch):
    from voxdiff.pipeline.train import run_training

    fake_free(monkeypatch, 999)
    with pytest.raises(VoxdiffError) as e:
        run_training(make_params(CASE), tiny_root, progress=False)
    msg = str(e.value)
    assert "\n" not in msg and str(tiny_root) in msg and "not enough free disk" in msg and "999 B are free" in msg
    assert "checkpoint 2 x" in msg and "post-hoc EMA snapshots" in msg
    assert not (tiny_root / "models" / "checkpoint.pt").exists() and not (tiny_root / "mlflow.db").exists()


def test_cli_plan_prints_then_refuses_with_one_line(tiny_root, monkeypatch):
    from voxdiff.cli import main

    raw = raw_params(**{**TINY, **CASE})
    (tiny_root / "params.yaml").write_text(yaml.safe_dump(raw))
    runner = CliRunner()
    ok = runner.invoke(main, ["train", "--plan", "--plan-steps", "1", "--root", str(tiny_root)])
    assert ok.exit_code == 0, ok.output
    assert "[voxdiff plan]" in ok.output and "3 optimizer steps" in ok.output and ": ok (" in ok.output
    fake_free(monkeypatch, 5 * 10**6)
    short = runner.invoke(main, ["train", "--plan", "--plan-steps", "1", "--root", str(tiny_root)])
    assert short.exit_code == 2
    assert "NOT ENOUGH" in short.output
    errors = [line for line in short.output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "needs" in errors[0] and "5.00 MB are free" in errors[0]
    assert not (tiny_root / "models").exists()


def test_params_gpu_plan_arithmetic(tmp_path, monkeypatch):
    """params-gpu.yaml (no training at that size: the network is built on the meta device)."""
    p = load(REPO / "params-gpu.yaml")
    e = plan.count_events(p.train)
    assert (e.total_samples, e.effective_batch, e.total_steps) == (200_000, 2, math.ceil(200_000 / 2))
    # every 1000 samples and the end (which is one of them); every 20,000 samples; 20 points; every 1000 steps
    assert (e.validations, e.probes, e.snapshots, e.checkpoints) == (200, 10, 20, 100)
    sizes = plan.sizes_for(p)
    assert 40e6 < sizes.weights < 42e6 and sizes.trainable == sizes.weights
    snapshots = e.snapshots * plan.snapshot_set_bytes(sizes, p.train)
    data = posthoc_ema.snapshot_bytes(sizes.weights, 2, 20)  # 41.0 M x 2 B x 2 profiles x 20
    assert data < snapshots < data + 5e6 and snapshots <= 5e9  # + each file's pickle
    assert round(data / 1e9, 2) == round(snapshots / 1e9, 2) == 3.28
    ckpt = plan.checkpoint_bytes(sizes, p.train, e)
    # 9 fp32 copies (weights, EMA, 2 profiles, Adam's 2 moments, the best point's 3 EMA copies: 1 kept + 2
    # pending) = 1.477 GB, + history of 100,000 steps
    assert plan.best_copies(e.validations) == 3
    assert 9 * 4 * sizes.weights < ckpt < 9 * 4 * sizes.weights + 25e6 and round(ckpt / 1e9, 2) == 1.5

    # A DVC project with its cache on the same disk: checkpoint twice, snapshots, DVC copy, MLflow model
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text("[core]\n    autostage = true\n")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("DVC_ROOT", raising=False)
    fake_free(monkeypatch, 10 * 10**9)
    need, = plan.disk_needs(p, tmp_path, sizes, e)
    assert plan.dvc_cache_dir(tmp_path) == tmp_path / ".dvc" / "cache"
    assert need.need == 2 * ckpt + snapshots + ckpt + 4 * sizes.weights and need.ok
    assert round(need.need / 1e9, 2) == 7.94
    plan.check_disk([need])
    fake_free(monkeypatch, 5 * 10**9)
    with pytest.raises(VoxdiffError, match=r"needs 7\.94 GB there .*DVC cache copy 1\.50 GB.*5\.00 GB are free"):
        plan.check_disk(plan.disk_needs(p, tmp_path, sizes, e))
    # A cache that links instead of copying takes no second copy
    (tmp_path / ".dvc" / "config").write_text("[cache]\n    type = hardlink,symlink\n")
    assert plan.dvc_cache_dir(tmp_path) is None


def test_a_resumed_run_counts_only_what_is_left(tiny_root):
    p = make_params(CASE)
    whole, rest = plan.count_events(p.train), plan.count_events(p.train, start_step=2)
    assert rest.steps == 1 and rest.validations == 1 and rest.snapshots == 1 and rest.checkpoints == 1
    assert whole.steps == 3 and whole.checkpoints == 2
    assert plan.count_events(p.train, start_step=3).checkpoints == 0


def test_meta_device_sizes_equal_a_real_networks():
    p = make_params()
    from voxdiff.diffusion.model import build_network

    assert plan.sizes_for(p, 3) == plan.network_sizes(build_network(p.model, 3))
    assert torch.empty(0).device.type == "cpu"  # the meta device did not leak into the default


def test_the_plan_is_run_by_training_but_not_part_of_its_identity():
    """An edit to the plan (or its disk check) must not retrain a finished run: it changes no weight."""
    from voxdiff.runtime.codehash import TRAINING_MODULE, closure, training_sources

    assert "voxdiff.pipeline.plan" in closure(TRAINING_MODULE)
    assert not any(f.name == "plan.py" for f in training_sources())


def test_measured_peak_memory_is_the_steps_own_on_the_cpu(tiny_root):
    """plan.measure and advise share one reset of the peak (distributed.reset_peak_memory): on the CPU it
    resets the process's peak RSS, so a large allocation before the plan's steps is not their peak."""
    import numpy as np

    from voxdiff.data.cache import open_cache
    from voxdiff.runtime.distributed import init_runtime, peak_memory_mb
    from voxdiff.training.trainer import Trainer

    big = np.ones(100_000_000)  # 800 MB touched, then freed: the process's peak RSS holds it
    del big
    before = peak_memory_mb()
    trainer = Trainer(plan.measuring_params(make_params(CASE), 2), tiny_root, init_runtime("cpu", "fp32"),
                      open_cache(tiny_root / "data" / "processed"))
    m = plan.measure(trainer, 1, tiny_root / "models")
    assert m["peak_memory_mb"] < before - 400, (m["peak_memory_mb"], before)
