"""MLflow tracking: clear failure at start, warnings (not crashes) mid-run, one run per training."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import yaml

from conftest import TINY, make_params, raw_params, write_tiny_cache
from voxdiff.runtime.errors import VoxdiffError
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


# --- issue 36 item 5: the logged EMA model loads where voxdiff is not importable ------------------------
LOAD_WITHOUT_VOXDIFF = r"""
import importlib.abc, json, sys

class NoVoxdiff(importlib.abc.MetaPathFinder):  # a machine with torch, monai and mlflow only
    def find_spec(self, name, path=None, target=None):
        if name == "voxdiff" or name.startswith("voxdiff."):
            raise ModuleNotFoundError(f"No module named {name!r}")
        return None

sys.meta_path.insert(0, NoVoxdiff())
try:
    import voxdiff  # noqa: F401
    raise SystemExit("the blocker let voxdiff through")
except ModuleNotFoundError:
    pass
import mlflow, torch

net = mlflow.pytorch.load_model(sys.argv[1])
meta = mlflow.models.get_model_info(sys.argv[1]).metadata
x = torch.load(sys.argv[2])
with torch.no_grad():
    out = net(x, timesteps=torch.tensor([7]))
torch.save(out, sys.argv[3])
requirements = open(mlflow.pyfunc.get_model_dependencies(sys.argv[1])).read().split()
print(json.dumps({"classes": sorted({type(m).__module__.split(".")[0] for m in net.modules()}),
                  "requirements": [r.split("==")[0] for r in requirements], "num_classes": meta["num_classes"]}))
"""


@pytest.mark.parametrize("activation_checkpointing", [False, True])
def test_logged_ema_model_loads_without_voxdiff(tiny_root, activation_checkpointing):
    """The EMA model in a real SQLite store loads and gives the training network's output in a process where
    `import voxdiff` fails: its pickle names only classes of its declared requirements (torch, MONAI, einops;
    no BatchOneConv3d, no wrapper of activation checkpointing), while the network trained with stays routed
    to oneDNN."""
    import json

    import torch
    from torch.optim.swa_utils import AveragedModel

    from voxdiff.diffusion.cpu_conv import BatchOneConv3d
    from voxdiff.diffusion.model import build_network

    p = make_params({"model.activation_checkpointing": activation_checkpointing})
    torch.manual_seed(0)
    net = build_network(p.model, 3)
    with torch.no_grad():
        for q in net.parameters():
            q.normal_(0, 0.05)  # MONAI zero-initialises the output convolution: make the output say something
    ema = AveragedModel(net, use_buffers=True).module  # as the trainer's EMA (a deep copy of the network)
    x = torch.randn(1, 4, 16, 16, 16)
    with torch.no_grad():
        expected = ema(x, timesteps=torch.tensor([7]))
    tracker = RunTracker.start(p, tiny_root, resume_run_id="", tags={}, extra_params={})
    tracker.log_model(ema, {"num_classes": 3})
    assert tracker.finish() and not tracker.failed
    assert sum(isinstance(m, BatchOneConv3d) for m in ema.modules()) > 0  # training's network is untouched

    torch.save(x, tiny_root / "x.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # timeout: the subprocess's mlflow and torch imports take minutes on a loaded machine
    out = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_VOXDIFF, f"runs:/{tracker.run_id}/ema_model",
                          str(tiny_root / "x.pt"), str(tiny_root / "y.pt")],
                         capture_output=True, text=True, env=env, cwd=tiny_root, timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    # every package the pickle names is a declared requirement (MONAI's attention is einops' Rearrange)
    assert set(found["classes"]) <= set(found["requirements"]) and found["num_classes"] == 3
    assert torch.allclose(torch.load(tiny_root / "y.pt"), expected, atol=1e-6)


def test_sqlite_uris_are_parsed_in_tracking_uri_only(tiny_root):
    """One parser of sqlite:/// URIs (tracking/uri.py): the artifact folder the disk plan counts is the
    experiment's artifact location in the real store, and no other module slices the scheme off itself."""
    import re
    from pathlib import Path

    from voxdiff.tracking.runs import _client, ensure_experiment
    from voxdiff.tracking.uri import local_artifacts_dir, sqlite_path
    from voxdiff.pipeline.plan import mlflow_artifacts_dir

    uri = os.environ["MLFLOW_TRACKING_URI"]
    assert sqlite_path(uri) == tiny_root / "mlflow.db" and sqlite_path("http://host:5000") is None
    exp = _client(uri).get_experiment(ensure_experiment(uri, "x", tiny_root))
    assert exp.artifact_location == local_artifacts_dir(uri).as_uri()
    assert mlflow_artifacts_dir(make_params(), tiny_root) == local_artifacts_dir(uri)
    src = Path(__file__).resolve().parents[1] / "src" / "voxdiff"
    parsing = re.compile(r"""(startswith|len)\(\s*["']sqlite:///["']""")
    assert [str(f.relative_to(src)) for f in src.rglob("*.py")
            if f.name != "uri.py" and parsing.search(f.read_text())] == []
