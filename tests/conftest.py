"""Shared fixtures: params from the real params.yaml with overrides, and a tiny preprocessed cache."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
BASE_RAW = yaml.safe_load((REPO / "params.yaml").read_text())

# A configuration small enough for many training runs per test (16^3, two UNet levels).
TINY = {
    "preprocess.shape": [16, 16, 16],
    "model.channels": [8, 16],
    "model.attention_levels": [False, True],
    "model.num_head_channels": 8,
    "model.norm_num_groups": 4,
    "diffusion.timesteps": 50,
    # epsilon: the sampler tests use an analytic epsilon denoiser, and samples of an x0 model this young
    # barely depend on their noise (see docs/tuning.md); the demo's x0 setting is run by the e2e tests
    "diffusion.prediction": "epsilon",
    "data.label_values": [0, 1, 2],
    "train.max_samples": 8,
    "train.max_steps": 0,
    "train.lr": 1.0e-3,
    "train.warmup_samples": 0,
    "train.precision": "fp32",  # exactness tests compare trajectories bit for bit or to 1e-5; bf16 has its own tests
    "train.val_every_samples": 2,
    "train.val_draws": 2,
    "train.checkpoint_every": 2,
    "train.gns_probe_samples": 4,   # the probe's cost in every tiny run: 2 x (4 buckets x 3 + 4) gradients
    "train.gns_bucket_samples": 3,
    "evaluate.sampling_steps": 5,
    "evaluate.samples_per_condition": 1,
    "evaluate.subjects": 1,
    # the Dice metrics run, wired as in the demo, at a token cost (test_segmenter.py scores them at the demo's size)
    "evaluate.segmenter_steps": 20,
    "evaluate.segmenter_seeds": 1,
}


def raw_params(**overrides) -> dict:
    """params.yaml as a dict with dotted-key overrides (`train__batch_size=4` or {"train.batch_size": 4})."""
    raw = copy.deepcopy(BASE_RAW)
    for key, value in overrides.items():
        node = raw
        parts = key.replace("__", ".").split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value
    return raw


def make_params(overrides: dict | None = None, tiny: bool = True):
    from voxdiff.params import validate

    merged = {**(TINY if tiny else {}), **(overrides or {})}
    return validate(raw_params(**merged))


def write_tiny_cache(root: Path, n_train: int = 4, n_val: int = 2, shape=(16, 16, 16), classes: int = 3,
                     seed: int = 0) -> Path:
    """A preprocessed cache in the cache.py format: smooth blobs whose intensity follows the class."""
    from scipy.ndimage import gaussian_filter

    from voxdiff.data.cache import FORMAT_VERSION

    rng = np.random.default_rng(seed)
    n = n_train + n_val
    labels = np.zeros((n, *shape), np.uint8)
    images = np.full((n, *shape), -1.0, np.float32)
    for i in range(n):
        field = gaussian_filter(rng.standard_normal(shape), 2.0)
        inside = gaussian_filter(rng.standard_normal(shape), 3.0) > -0.05
        lab = np.where(inside, 1 + (field > 0).astype(np.uint8) * (classes - 2), 0).astype(np.uint8)
        labels[i] = lab
        img = np.where(lab == 0, -1.0, np.where(lab == 1, -0.2, 0.6)) + 0.05 * rng.standard_normal(shape)
        images[i] = np.clip(img, -1, 1)
    out = root / "data" / "processed"
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "images.npy", images)
    np.save(out / "labels.npy", labels)
    affine = np.diag([6.0, 6.0, 6.0, 1.0]).tolist()
    manifest = {
        "version": FORMAT_VERSION, "shape": list(shape), "spacing": [6.0] * 3,
        "label_values": list(range(classes)), "fingerprint": f"tiny{seed}",
        "subjects": [{"id": f"sub-{i:03d}", "index": i, "split": "train" if i < n_train else "val",
                      "affine": affine} for i in range(n)],
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture
def tiny_root(tmp_path, monkeypatch):
    """A project root with a tiny cache and a private MLflow store."""
    write_tiny_cache(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    return tmp_path


@pytest.fixture(autouse=True)
def _quiet_threads():
    import torch

    torch.set_num_threads(1)  # 2 threads on 2 busy cores is many times slower
    yield
