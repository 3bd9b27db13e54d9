"""MLflow tracking: clear failure at start, warnings (not crashes) mid-run, one run per training."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import yaml

from conftest import TINY, make_params, raw_params, write_tiny_cache
from voxdiff.errors import VoxdiffError
from voxdiff.tracking.runs import RunTracker


def test_unreachable_server_fails_before_training(tmp_path):
    write_tiny_cache(tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw_params(**TINY)))
    env = {**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9"}
    out = subprocess.run([sys.executable, "-m", "voxdiff.cli", "train", "--root", str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: MLflow tracking store http://127.0.0.1:9")
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "models").exists()


def test_sqlite_store_in_missing_directory_is_a_clear_error(tiny_root, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tiny_root / 'nope' / 'mlflow.db'}")
    p = make_params()
    with pytest.raises(VoxdiffError, match="does not exist"):
        RunTracker.start(p, tiny_root, resume_run_id="", tags={}, extra_params={})


def test_failure_mid_run_only_warns(tiny_root):
    p = make_params()
    tracker = RunTracker.start(p, tiny_root, resume_run_id="", tags={}, extra_params={"effective_batch_size": 2})
    tracker.log_history([{"step": 1, "train_loss": 0.5, "val_loss": None}])
    assert tracker.logged_through == 1
    (tiny_root / "mlflow.db").write_bytes(b"this is not a database" * 100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker.log_history([{"step": 1, "train_loss": 0.5}, {"step": 2, "train_loss": 0.4, "val_loss": 0.3}])
        tracker.finish()
    assert tracker.failed
    assert any("training continues" in str(w.message) for w in caught)


def test_each_metric_is_sent_once_per_step(tiny_root, monkeypatch):
    """gns_trace (a METRIC_KEYS key) starts with gns_t like the probe's per-bucket keys (gns_t0, gns_t0_lo
    ...): it must be in a step's batch once, and every probe key with it. The batch sent to the real SQLite
    store is read on its way (MLflow's store drops exact duplicates, so the run itself cannot show it)."""
    p = make_params()
    tracker = RunTracker.start(p, tiny_root, resume_run_id="", tags={}, extra_params={})
    sent = []
    real = tracker.client.log_batch
    monkeypatch.setattr(tracker.client, "log_batch", lambda run_id, **kw: (sent.extend(kw.get("metrics", [])),
                                                                         real(run_id, **kw))[1])
    tracker.log_history([{"step": 1, "train_loss": 0.5, "val_loss": None, "gns_trace": 3.0, "gns_grad_sq": 2.0,
                          "gns_t0": 7.0, "gns_t0_lo": 6.0, "gns_t12_hi": 9.0, "gns_marginal": 8.0}])
    keys = [m.key for m in sent]
    assert len(keys) == len(set(keys)), sorted(keys)
    assert {"gns_trace", "gns_grad_sq", "gns_t0", "gns_t0_lo", "gns_t12_hi", "gns_marginal"} <= set(keys)
    tracker.finish()
