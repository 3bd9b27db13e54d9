"""Evaluation and sampling: metrics that separate a trained model from an untrained one, seeded samplers,
outputs on disk and in MLflow, `voxdiff sample` on a user's LPS label map, one-line errors.

One tiny model is trained once for the module (512 samples on the tiny cache, ~10-20 s) and reused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

from conftest import TINY, make_params, raw_params, write_tiny_cache

TRAIN = {"train.max_samples": 512, "train.batch_size": 4, "train.accumulate_every": 1,
         "train.val_every_samples": 64, "train.checkpoint_every": 1000}
EVAL = {"evaluate.subjects": 0, "evaluate.samples_per_condition": 2, "evaluate.sampling_steps": 10,
        "evaluate.ancestral": True}


def _one_thread():
    # Two OpenMP threads on the two shared cores stall whenever another process is busy (measured:
    # a 16^3 forward pass 0.56 s with 2 threads vs 0.03 s with 1); one thread is fast either way.
    torch.set_num_threads(1)


def _env(mp: pytest.MonkeyPatch, root: Path) -> None:
    mp.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{root / 'mlflow.db'}")
    for var in ("DVC_EXP_NAME", "DVC_ROOT", "WORLD_SIZE", "RANK", "LOCAL_RANK"):
        mp.delenv(var, raising=False)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, params, train summary) of a tiny model trained for 512 samples."""
    root = tmp_path_factory.mktemp("trained")
    write_tiny_cache(root)
    (root / "params.yaml").write_text(yaml.safe_dump(raw_params(**{**TINY, **TRAIN, **EVAL}), sort_keys=False))
    params = make_params({**TRAIN, **EVAL})
    _one_thread()
    with pytest.MonkeyPatch.context() as mp:
        _env(mp, root)
        from voxdiff.pipeline.train import run_training

        summary = run_training(params, root, progress=False)
    return root, params, summary


@pytest.fixture
def project(trained, monkeypatch):
    root, params, summary = trained
    _env(monkeypatch, root)
    return root, params, summary


def untrained_copy(root: Path, params, dest: Path) -> Path:
    """The same project with the network's step-0 weights as EMA (the trainer's own initialisation)."""
    from torch.optim.swa_utils import AveragedModel

    from voxdiff.training import checkpoint
    from voxdiff.diffusion.model import build_network

    shutil.copytree(root / "data", dest / "data")
    shutil.copy(root / "params.yaml", dest / "params.yaml")
    state = checkpoint.load(root / "models" / "checkpoint.pt")
    state.pop("format_version")
    torch.manual_seed(params.seed)
    state["ema"] = AveragedModel(build_network(params.model, state["num_classes"]), use_buffers=True).state_dict()
    state.pop("best", None)  # no best point kept: evaluate reads the (untrained) final weights
    state["mlflow_run_id"] = ""
    checkpoint.save(dest / "models" / "checkpoint.pt", state)
    return dest


def test_evaluate_writes_outputs_and_separates_trained_from_untrained(project, tmp_path):
    from voxdiff.data.cache import open_cache
    from voxdiff.pipeline.evaluate import run_evaluate

    root, params, summary = project
    m = run_evaluate(params, root, progress=False)

    # metrics/eval_detail.json holds what was returned, eval.json (the DVC metrics) a few figures of it;
    # the EMA val loss is training's, recomputed.
    assert json.loads((root / "metrics" / "eval_detail.json").read_text()) == m
    compact = json.loads((root / "metrics" / "eval.json").read_text())
    assert compact == {"ssim": round(m["eval_ssim"], 3),
                       "ssim_floor": round(max(m["eval_ssim_floor_noise"], m["eval_ssim_floor_tissue_mean"]), 3),
                       "diversity": m["eval_msssim_samples"],  # no diversity_ref: not the built-in data
                       "dice": round(m["eval_dice_fidelity_mean"], 2)}  # segmentation Dice (test_segmenter.py)
    assert m["eval_dice_tstr_ratio"] > 0 and m["eval_dice_fidelity_mean_ceiling"] > 0
    assert m.get("eval_final_val_loss", m["eval_val_loss"]) == pytest.approx(summary["final_val_loss"], rel=1e-6)
    for key in ("eval_ssim", "eval_psnr", "eval_mae", "eval_msssim_samples", "eval_msssim_real",
                "eval_contrast_order_ok", "eval_w1_label0", "eval_w1_label1", "eval_w1_label2",
                "eval_seconds_per_volume", "eval_peak_memory_mb", "eval_ssim_ancestral",
                "eval_seconds_per_volume_ancestral"):
        assert m[key] is not None, key
    assert m["eval_sampling_steps"] == 10 and m["eval_ancestral_steps"] == 50
    for k in ("ssim", "psnr", "mae"):
        assert m[f"eval_{k}_floor_noise"] is not None and m[f"eval_{k}_floor_tissue_mean"] is not None
    assert 0 <= m["eval_msssim_samples"] < 0.99  # two samples of one label map differ
    # The tiny cache is not built-in data: there is no second image of a label map, so no reference.
    assert "eval_diversity_reference" not in m

    # NIfTI samples on each subject's processed grid; montages; nothing half-written left behind.
    cache = open_cache(root / "data" / "processed")
    ids = [cache.subjects[r]["id"] for r in cache.split_indices("val")]
    assert sorted(p.name for p in (root / "samples").iterdir()) == sorted(
        f"{i}_{s}.nii.gz" for i in ids for s in ("s0", "s1", "a0"))
    img = nib.load(root / "samples" / f"{ids[0]}_s1.nii.gz")
    assert img.shape == (16, 16, 16) and np.allclose(img.affine, cache.affine(int(cache.split_indices("val")[0])))
    assert -1.0 <= img.get_fdata().min() and img.get_fdata().max() <= 1.0
    import matplotlib.image

    for i in ids:
        png = matplotlib.image.imread(root / "plots" / "eval" / f"{i}.png")
        assert png.shape[0] > png.shape[1] > 200  # 5 rows (label, real, 2 samples, ancestral) x 3 views
    assert not [p.name for d in (root, root / "plots", root / "metrics") for p in d.glob(".*.tmp")]

    # Logged into the training's MLflow run, montages included.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    run_id = summary["mlflow_run_id"]
    logged = client.get_run(run_id).data.metrics
    assert logged["eval_ssim"] == pytest.approx(m["eval_ssim"]) and logged["eval_val_loss"] == pytest.approx(m["eval_val_loss"])
    assert {f"eval/{i}.png" for i in ids} <= {a.path for a in client.list_artifacts(run_id, "eval")}

    # The step-0 network: same data, same sampler seeds. A missing MLflow run id only warns.
    bare = untrained_copy(root, params, tmp_path / "untrained")
    with pytest.warns(UserWarning, match="not logged to MLflow"):
        u = run_evaluate(params, bare, progress=False)
    assert m["eval_val_loss"] < 0.6 * u["eval_val_loss"]
    assert m["eval_mae"] < 0.6 * u["eval_mae"]
    assert m["eval_ssim"] > u["eval_ssim"] + 0.1
    assert m["eval_psnr"] > u["eval_psnr"] + 3
    assert m["eval_w1_label0"] < u["eval_w1_label0"] and m["eval_w1_label2"] < u["eval_w1_label2"]
    # The tiny cache's contrast is label 1 (-0.2) < label 2 (0.6): the trained model keeps it with a
    # clear gap; the untrained one outputs no class contrast at all (its means are within noise).
    assert m["eval_contrast_order_ok"] == 1 and m["eval_contrast_ratio"] > 0.4
    assert m["eval_mean_sample_label2"] - m["eval_mean_sample_label1"] > 0.3
    assert abs(u["eval_mean_sample_label2"] - u["eval_mean_sample_label1"]) < 0.1
    assert u["eval_contrast_order_ok"] == 0 and u["eval_contrast_ratio"] < 0.2


def test_floors_score_themselves_at_their_floor(project):
    """The two reference predictors, fed to the metric as if they were samples, score exactly their own
    floor; noise scores ~0 SSIM (windows centred in the brain only), the tissue-mean image far more."""
    from voxdiff.data.cache import open_cache
    from voxdiff.pipeline.evaluate import (fidelity, fidelity_floors, noise_image, BrainSSIM, tissue_mean_image,
                                             tissue_means)

    root, params, _ = project
    cache = open_cache(root / "data" / "processed")
    subjects = [{"real": np.asarray(cache.images[r], np.float32), "label": np.asarray(cache.labels[r])}
                for r in cache.split_indices("val")]
    ssim = BrainSSIM((16, 16, 16))
    floors = fidelity_floors(subjects, cache, ssim, seed=3)
    for name, make in (("noise", lambda s, e: noise_image(e["real"].shape, 3 + s)),
                       ("tissue_mean", lambda s, e: tissue_mean_image(tissue_means(cache), e["label"]))):
        scores = [fidelity(make(s, e), e["real"], e["label"] > 0, ssim) for s, e in enumerate(subjects)]
        for k in ("ssim", "psnr", "mae"):
            assert floors[f"eval_{k}_floor_{name}"] == pytest.approx(np.mean([f[k] for f in scores]))
    assert abs(floors["eval_ssim_floor_noise"]) < 0.05
    assert floors["eval_ssim_floor_tissue_mean"] > floors["eval_ssim_floor_noise"] + 0.3
    assert floors["eval_mae_floor_tissue_mean"] < floors["eval_mae_floor_noise"]
    # The real volume against itself is the ceiling.
    e = subjects[0]
    assert fidelity(e["real"], e["real"], e["label"] > 0, ssim)["ssim"] == pytest.approx(1.0)


def masked(volume: np.ndarray, brain: np.ndarray) -> np.ndarray:
    """The volume with a -1 background: how the metrics saw a sample before they kept to the brain."""
    return np.where(brain, volume, -1.0).astype(np.float32)


def test_noise_is_not_flattered_by_the_background():
    """Old metric (SSIM over the whole grid, background set to -1 in both) gave noise a high score from
    the identical background alone; the brain-centred SSIM does not. A 32^3 head: a ball of tissue in
    -1 background, as the cache stores it."""
    from monai.metrics import SSIMMetric

    from voxdiff.pipeline.evaluate import BrainSSIM, noise_image

    z, y, x = np.mgrid[:32, :32, :32]
    brain = (z - 16) ** 2 + (y - 16) ** 2 + (x - 16) ** 2 < 10 ** 2
    real = np.where(brain, np.sin(x / 3.0) * 0.5 + 0.2, -1.0).astype(np.float32)
    noise = noise_image(real.shape, 0)
    whole_grid = SSIMMetric(spatial_dims=3, data_range=2.0, win_size=11)
    as_before = float(whole_grid(torch.as_tensor(masked(noise, brain))[None, None],
                                 torch.as_tensor(masked(real, brain))[None, None]).mean())
    now = BrainSSIM(real.shape)(noise, real, brain)
    assert as_before > 0.2 and abs(now) < 0.05
    assert BrainSSIM(real.shape)(real, real, brain) == pytest.approx(1.0)


def test_contrast_order_needs_a_real_gap():
    from voxdiff.pipeline.evaluate import contrast_order, contrast_ratio

    real = {1: 0.40, 2: 0.65, 3: 0.84}  # CSF < GM < WM (MNI152 T1)
    assert contrast_order(real, {1: 0.1, 2: 0.5, 3: 0.7}) and contrast_ratio(real, real) == pytest.approx(1)
    assert not contrast_order(real, {1: 0.1, 2: 0.7, 3: 0.5})  # GM > WM
    assert not contrast_order(real, {1: 0.010, 2: 0.011, 3: 0.012})  # right order, but noise-level gaps


def test_sampler_is_seeded_and_independent_of_batching(project):
    from voxdiff.training import checkpoint
    from voxdiff.diffusion import sampling
    from voxdiff.data.cache import open_cache

    root, _, _ = project
    state = checkpoint.load(root / "models" / "checkpoint.pt")
    net, _, diff = sampling.load_ema_network(state, torch.device("cpu"))
    cache = open_cache(root / "data" / "processed")
    label = torch.from_numpy(np.asarray(cache.labels[int(cache.split_indices("val")[0])], np.int64))[None]

    def ddim(seed, labels=label, k=0):
        return sampling.generate(net, diff, labels, 3, 5, seed, "ddim", progress=False, subject=2, sample_index=k)

    a = ddim(7)
    assert a.shape == (1, 1, 16, 16, 16) and torch.equal(a, ddim(7))
    assert (a - ddim(8)).abs().max() > 0.1
    # Volume k of a batch is volume k sampled alone (up to the float rounding of another conv kernel).
    both = ddim(7, label.expand(2, -1, -1, -1))
    assert torch.allclose(both[0], a[0], atol=1e-3) and torch.allclose(both[1], ddim(7, k=1)[0], atol=1e-3)
    assert not torch.equal(both[0], both[1])

    rng = torch.get_rng_state()
    record: list = []
    x = sampling.generate(net, diff, label, 3, 5, 7, "ancestral", progress=False, record=record)
    assert torch.equal(x, sampling.generate(net, diff, label, 3, 5, 7, "ancestral", progress=False))
    assert (x - sampling.generate(net, diff, label, 3, 5, 8, "ancestral", progress=False)).abs().max() > 0.1
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's RNG is left as it was
    assert record[0]["steps"] == 50 and record[0]["seconds"] > 0 and record[0]["peak_memory_mb"] > 0


def test_ddim_eta_draws_fresh_seeded_noise_per_volume(project):
    """evaluate.ddim_eta > 0: each step adds noise drawn from the RNG seeded by (seed, subject, volume), so the volumes
    are reproducible, volume k of a batch is volume k alone bit for bit, they differ from eta 0's (negative control:
    eta 0 given explicitly is the default's output), and the caller's RNG is left alone; eta outside [0, 1] is refused."""
    from voxdiff.training import checkpoint
    from voxdiff.diffusion import sampling
    from voxdiff.data.cache import open_cache
    from voxdiff.runtime.errors import VoxdiffError

    root, _, _ = project
    net, _, diff = sampling.load_ema_network(checkpoint.load(root / "models" / "checkpoint.pt"), torch.device("cpu"))
    cache = open_cache(root / "data" / "processed")
    label = torch.from_numpy(np.asarray(cache.labels[int(cache.split_indices("val")[0])], np.int64))[None]

    def ddim(eta, labels=label, seed=7, k=0, record=None):
        return sampling.generate(net, diff, labels, 3, 5, seed, "ddim", progress=False, subject=2, sample_index=k,
                                 eta=eta, record=record)

    assert torch.equal(ddim(0.0), sampling.generate(net, diff, label, 3, 5, 7, "ddim", progress=False, subject=2))
    rng = torch.get_rng_state()
    record: list = []
    a = ddim(1.0, record=record)
    assert torch.equal(torch.get_rng_state(), rng) and record[0]["eta"] == 1.0
    assert torch.equal(a, ddim(1.0)) and (a - ddim(0.0)).abs().max() > 0.01 and (a - ddim(1.0, seed=8)).abs().max() > 0.1
    both = ddim(1.0, label.expand(2, -1, -1, -1))
    assert torch.equal(both[0], a[0]) and torch.equal(both[1], ddim(1.0, k=1)[0]) and not torch.equal(both[0], both[1])
    for bad in (-0.1, 1.5):
        with pytest.raises(VoxdiffError, match="eta must be in"):
            ddim(bad)


class Oracle(torch.nn.Module):
    """Predicts the exact noise for x0 = a fixed intensity per class (read from the one-hot channels)."""

    def __init__(self, alphas_cumprod, values):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # generate() takes the device from the parameters
        self.alphas, self.values = alphas_cumprod, torch.tensor(values).view(1, -1, 1, 1, 1)

    def forward(self, x, timesteps, context=None):
        noisy, one_hot = x[:, :1], x[:, 1:]
        x0 = (one_hot * self.values).sum(1, keepdim=True)
        a = self.alphas[timesteps.long()].view(-1, 1, 1, 1, 1)
        return (noisy - a.sqrt() * x0) / (1 - a).sqrt()


def test_samplers_recover_the_image_with_a_perfect_denoiser():
    """The wiring (concat order: noisy image first, then the one-hot map; the timesteps the network sees
    match the scheduler's step; clipping) is right if a perfect noise predictor gives back x0."""
    from voxdiff.diffusion import sampling
    from voxdiff.diffusion.model import build_scheduler

    diff = make_params().diffusion
    values = [-1.0, -0.2, 0.6]
    oracle = Oracle(build_scheduler(diff).alphas_cumprod, values)
    labels = torch.zeros(1, 8, 8, 8, dtype=torch.long)
    labels[:, 2:6, 2:6, 2:6], labels[:, 3:5, 3:5, 3:5] = 1, 2
    want = torch.tensor(values)[labels][:, None]
    for sampler, eta in (("ddim", 0.0), ("ancestral", 0.0), ("ddim", 0.5), ("ddim", 1.0)):
        got = sampling.generate(oracle, diff, labels, 3, 7, 0, sampler, progress=False, eta=eta)
        assert torch.allclose(got, want, atol=1e-4), (sampler, eta)


def test_incompatible_checkpoints_are_refused_in_one_line(project):
    from voxdiff.training import checkpoint
    from voxdiff.diffusion import sampling
    from voxdiff.runtime.errors import VoxdiffError

    root, _, _ = project
    state = checkpoint.load(root / "models" / "checkpoint.pt")
    cases = [
        (dict(state, ema={}), {}, "no EMA weights"),
        (state, {"num_classes": 5}, "trained for 3 label classes"),
        (dict(state, num_classes=5), {}, "EMA weights do not fit"),
        (dict(state, params={**state["params"], "model": {**state["params"]["model"], "channels": "x"}}), {},
         "stored training params are invalid (model.channels"),
        (dict(state, params={k: v for k, v in state["params"].items() if k != "diffusion"}), {}, "no params.diffusion"),
    ]
    for bad, kwargs, text in cases:
        with pytest.raises(VoxdiffError) as e:
            sampling.load_ema_network(bad, "cpu", source="models/x.pt", **kwargs)
        assert str(e.value).startswith("models/x.pt: ") and text in str(e.value) and "\n" not in str(e.value)


def test_msssim_fits_small_grids():
    """The configuration fits small grids; with a brain that fills the grid the brain-centred MS-SSIM is
    MONAI's MultiScaleSSIMMetric of the same configuration (same scales, window and weights)."""
    from monai.metrics import MultiScaleSSIMMetric

    from voxdiff.pipeline.evaluate import BrainMSSSIM, msssim_config

    assert msssim_config((32, 32, 32))[:2] == (3, 7) and msssim_config((16, 16, 16))[:2] == (2, 7)
    assert msssim_config((128, 128, 128))[:2] == (5, 7) and sum(msssim_config((32,) * 3)[2]) == pytest.approx(1)
    g = torch.Generator().manual_seed(0)
    a = torch.rand(32, 32, 32, generator=g) * 2 - 1
    b = (a + 0.5 * torch.rand(a.shape, generator=g)).clamp(-1, 1)
    everywhere = np.ones(a.shape, bool)
    metric = BrainMSSSIM((32, 32, 32))
    assert metric(a.numpy(), a.numpy(), everywhere) == pytest.approx(1.0, abs=1e-4)
    ours = metric(a.numpy(), b.numpy(), everywhere)
    _, k, weights = msssim_config((32, 32, 32))
    monai = MultiScaleSSIMMetric(spatial_dims=3, data_range=2.0, kernel_size=k, kernel_sigma=1.5 * k / 11,
                                 weights=weights)
    assert 0 < ours < 0.99 and ours == pytest.approx(float(monai(a[None, None], b[None, None]).mean()), abs=1e-5)


def _ball_subject(shape=(32, 32, 32), radius=12):
    """A head as the cache stores it: a ball of two tissue classes in background, real volume -1 outside."""
    z, y, x = np.mgrid[tuple(slice(0, n) for n in shape)]
    d2 = sum((c - n // 2) ** 2 for c, n in zip((z, y, x), shape))
    label = np.where(d2 < radius ** 2, np.where(x < shape[2] // 2, 1, 2), 0).astype(np.uint8)
    real = np.where(label > 0, 0.3 * np.sin(x / 3.0) + np.where(label == 2, 0.4, -0.2), -1.0).astype(np.float32)
    return label, real


def test_diversity_is_not_flattered_by_the_shared_background(tmp_path):
    """Samples of one label map share its mask. Over the whole grid with a -1 background (the old figure)
    two independent noise samples looked alike from the shared background alone; brain-centred, with the
    background filled, they score as unrelated, while identical samples still score 1."""
    from monai.metrics import MultiScaleSSIMMetric

    from voxdiff.data.cache import open_cache
    from voxdiff.pipeline.evaluate import measure, msssim_config, noise_image

    shape = (32, 32, 32)
    cache = open_cache(write_tiny_cache(tmp_path, shape=shape))
    label, real = _ball_subject(shape)
    brain = label > 0
    noise = [np.where(brain, noise_image(shape, s), -1.0).astype(np.float32) for s in range(4)]

    def diversity(samples, **kw):
        subjects = [{"label": label, "real": real, "samples": samples}]
        return measure(subjects, cache, cache.split_indices("val"), 3, ["label0", "label1", "label2"], shape, **kw)

    same = diversity([real, real.copy()])
    assert same["eval_msssim_samples"] == pytest.approx(1.0, abs=1e-5)

    _, k, weights = msssim_config(shape)
    whole_grid = MultiScaleSSIMMetric(spatial_dims=3, data_range=2.0, kernel_size=k, kernel_sigma=1.5 * k / 11,
                                      weights=weights)
    pairs = [(i, j) for i in range(4) for j in range(i + 1, 4)]
    as_before = np.mean([float(whole_grid(torch.as_tensor(masked(noise[i], brain))[None, None],
                                          torch.as_tensor(masked(noise[j], brain))[None, None]).mean())
                         for i, j in pairs])
    # Negative control: the same noise with nothing around it (a brain filling the grid) is unrelated.
    alone = np.mean([float(whole_grid(torch.as_tensor(noise_image(shape, i))[None, None],
                                      torch.as_tensor(noise_image(shape, j))[None, None]).mean()) for i, j in pairs])
    now = diversity(noise)["eval_msssim_samples"]
    assert alone < 0.1 and as_before > 0.5  # the old figure: half-way to "identical", from the background
    assert now < 0.15 and as_before - now > 0.4
    # A reference goes next to the figure when there is one, and is absent (not made up) when there is none.
    assert "eval_diversity_reference" not in same
    assert diversity([real, real], reference=0.5)["eval_diversity_reference"] == 0.5


@pytest.fixture(scope="module")
def builtin_cache(tmp_path_factory):
    """(params, cache) of the built-in data, small: 2 pseudo-subjects at 4 mm, 24^3 at 8 mm, 1 validation."""
    from voxdiff.data import prepare, preprocess
    from voxdiff.data.cache import open_cache

    root = tmp_path_factory.mktemp("builtin")
    params = make_params({"data.subjects": 2, "data.synth_spacing": 4.0, "data.val_subjects": 1,
                          "preprocess.spacing": [8.0, 8.0, 8.0], "preprocess.shape": [24, 24, 24]}, tiny=False)
    prepare.run_prepare(params, root)
    preprocess.run_preprocess(params, root)
    return params, open_cache(root / "data" / "processed")


def test_diversity_reference_of_the_builtin_data_lies_between_the_extremes(builtin_cache):
    """Two images of one label map in the built-in data (same deformation, bias field and noise drawn
    again) are neither identical (1) nor unrelated (noise): the reference a model's diversity is read against."""
    import dataclasses

    from voxdiff.data.cache import ProcessedCache
    from voxdiff.pipeline.evaluate import (builtin_subject, diversity_reference, BrainMSSSIM, noise_image,
                                             pairwise_msssim)

    params, cache = builtin_cache
    rows = cache.split_indices("val")
    r = int(rows[0])
    index = int(cache.subjects[r]["id"].split("-")[1])
    label, real = np.asarray(cache.labels[r]), np.asarray(cache.images[r])
    # Appearance 0 is the cached subject itself (the pipeline reproduced); appearance 1 keeps its label map
    # and changes its image.
    again, again_label = builtin_subject(params, index, 0)
    assert np.array_equal(again_label, label) and np.allclose(again, real, atol=1e-6)
    other, other_label = builtin_subject(params, index, 1)
    assert np.array_equal(other_label, label) and np.abs(other - real)[label > 0].mean() > 0.01

    shape = real.shape
    metric = BrainMSSSIM(shape)
    brains = [label > 0] * 2
    reference = diversity_reference(params, cache, rows, metric)
    assert reference == pytest.approx(pairwise_msssim([real, other], brains, metric))
    identical = pairwise_msssim([real, real.copy()], brains, metric)
    noise = pairwise_msssim([noise_image(shape, 0), noise_image(shape, 1)], brains, metric)
    assert noise < reference < identical == pytest.approx(1.0)
    assert reference - noise > 0.5 and identical - reference > 1e-3

    # Negative controls: no reference for user data, nor for a cache these params did not make.
    user = dataclasses.replace(params, data=dataclasses.replace(params.data, source="mine"))
    assert diversity_reference(user, cache, rows, metric) is None
    labels = np.array(cache.labels)
    labels[r] = np.roll(labels[r], 1, axis=0)
    stale = ProcessedCache(cache.root, cache.images, labels, cache.manifest)
    with pytest.warns(UserWarning, match="no diversity reference"):
        assert diversity_reference(params, stale, rows, metric) is None


# --- voxdiff sample -----------------------------------------------------------------------------------
def lps_label_map(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """A label map stored LPS at 3 x 3.5 x 4 mm (the checkpoint works at 6 mm RAS): an ellipsoid of
    class 1 in one corner of the volume holding an eccentric blob of class 2, so any flip would show."""
    shape, zooms = np.array([34, 38, 30]), np.array([3.0, 3.5, 4.0])
    ras = np.diag([*zooms, 1.0])
    ras[:3, 3] = [-50.0, -70.0, -60.0]
    world = np.stack(np.meshgrid(*[np.arange(n) for n in shape], indexing="ij"), -1) * zooms + ras[:3, 3]
    centre = ras[:3, 3] + zooms * (shape - 1) / 2 + [22.0, 30.0, 28.0]
    brain = (((world - centre) / [22.0, 28.0, 24.0]) ** 2).sum(-1) <= 1
    labels = brain.astype(np.int16)
    labels[brain & ((((world - centre - [10.0, 12.0, 8.0]) / 10.0) ** 2).sum(-1) <= 1)] = 2
    flip = np.diag([-1.0, -1.0, 1.0, 1.0])  # voxel i -> n-1-i on the first two axes
    flip[:2, 3] = shape[:2] - 1
    lps_data, lps_affine = np.ascontiguousarray(labels[::-1, ::-1]), ras @ flip
    nib.save(nib.Nifti1Image(lps_data, lps_affine), path)
    return lps_data, lps_affine


def run_cli(*args):
    from voxdiff.cli import main

    return CliRunner().invoke(main, [str(a) for a in args])


def test_sample_cli_maps_back_onto_an_lps_label_grid(project, tmp_path):
    root, _, _ = project
    labels, affine = lps_label_map(tmp_path / "label_lps.nii.gz")
    assert nib.aff2axcodes(affine) == ("L", "P", "S")
    ckpt = root / "models" / "checkpoint.pt"
    out = tmp_path / "out" / "gen.nii.gz"
    res = run_cli("sample", "--checkpoint", ckpt, "--label", tmp_path / "label_lps.nii.gz", "--out", out,
                  "--sampler", "ancestral", "--seed", 1, "--params", root / "params.yaml", "--no-progress")
    assert res.exit_code == 0, res.output
    assert "wrote" in res.stderr and "LPS" in res.stderr and "warning" not in res.stderr
    img = nib.load(out)
    assert img.shape == labels.shape and np.allclose(img.affine, affine, atol=1e-5)
    gen = img.get_fdata()
    # The generated brain sits on the label's brain: bright inside, background dark, blob brightest.
    means = [gen[labels == c].mean() for c in (0, 1, 2)]
    assert means[0] < -0.7 and means[1] > means[0] + 0.4 and means[2] > means[1] + 0.3, means
    brain = labels > 0
    assert (gen[brain] > -0.5).mean() > 0.9

    def contrast(mask):
        return gen[mask].mean() - gen[~mask].mean()

    # Misplaced by a flip of any axis, the same brain would not line up with the bright region.
    for axis in range(3):
        assert contrast(np.flip(brain, axis)) < contrast(brain) - 0.3, axis

    # DDIM from the CLI: seeded, so the same seed gives the same file contents.
    outs = [tmp_path / f"d{i}.nii" for i in range(2)]
    for o in outs:
        res = run_cli("sample", "--checkpoint", ckpt, "--label", tmp_path / "label_lps.nii.gz", "--out", o,
                      "--steps", 3, "--seed", 5, "--params", root / "params.yaml")
        assert res.exit_code == 0, res.output
    assert np.array_equal(nib.load(outs[0]).get_fdata(), nib.load(outs[1]).get_fdata())

    # A labelled region larger than the checkpoint's field of view (16 x 6 mm) is cropped, with a warning.
    big = np.zeros((40, 40, 40), np.int16)
    big[2:38, 2:38, 2:38] = 1  # 108 mm at 3 mm
    nib.save(nib.Nifti1Image(big, np.diag([3.0, 3.0, 3.0, 1.0])), tmp_path / "big.nii.gz")
    res = run_cli("sample", "--checkpoint", ckpt, "--label", tmp_path / "big.nii.gz", "--out", tmp_path / "big_out.nii.gz",
                  "--steps", 2, "--params", root / "params.yaml")
    assert res.exit_code == 0 and "% of the labelled voxels lie outside" in res.stderr, res.output


def test_sample_cli_bad_inputs_exit_2_with_one_line(project, tmp_path):
    from voxdiff.training import checkpoint

    root, _, _ = project
    ckpt = root / "models" / "checkpoint.pt"
    good = tmp_path / "good.nii.gz"
    lps_label_map(good)
    vol = np.zeros((12, 12, 12), np.int16)
    vol[3:9, 3:9, 3:9] = 1
    bad_value = tmp_path / "seven.nii.gz"
    nib.save(nib.Nifti1Image(np.where(vol > 0, 7, 0).astype(np.int16), np.eye(4)), bad_value)
    four_d = tmp_path / "four_d.nii.gz"
    nib.save(nib.Nifti1Image(np.stack([vol, vol], -1), np.eye(4)), four_d)
    two_d = tmp_path / "two_d.nii.gz"
    nib.save(nib.Nifti1Image(vol[:, :, 0], np.eye(4)), two_d)
    state = checkpoint.load(ckpt)
    state.pop("format_version")
    wrong = tmp_path / "five_classes.pt"
    checkpoint.save(wrong, {**state, "num_classes": 5, "label_values": [0, 1, 2, 3, 4]})
    foreign = tmp_path / "foreign.pt"
    torch.save({"format_version": 1, "model": {}}, foreign)
    (tmp_path / "afile").write_text("")

    cases = [
        ((ckpt, bad_value, tmp_path / "o.nii.gz"), str(bad_value), "label values 7 are not in"),
        ((ckpt, four_d, tmp_path / "o.nii.gz"), str(four_d), "expected a 3D volume"),
        ((ckpt, two_d, tmp_path / "o.nii.gz"), str(two_d), "expected a 3D volume"),
        ((ckpt, tmp_path / "missing.nii.gz", tmp_path / "o.nii.gz"), "missing.nii.gz", "file not found"),
        ((tmp_path / "none.pt", good, tmp_path / "o.nii.gz"), "none.pt", "checkpoint not found"),
        ((wrong, good, tmp_path / "o.nii.gz"), str(wrong), "EMA weights do not fit"),
        ((foreign, good, tmp_path / "o.nii.gz"), str(foreign), "no EMA weights"),
        ((ckpt, good, tmp_path / "o.png"), "o.png", "must be a NIfTI"),
        ((ckpt, good, tmp_path / "afile" / "o.nii.gz"), "o.nii.gz", "cannot create its folder"),
    ]
    for (c, label, out), where, text in cases:
        res = run_cli("sample", "--checkpoint", c, "--label", label, "--out", out, "--steps", 2,
                      "--params", root / "params.yaml")
        lines = res.stderr.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1, (text, res.output)
        assert lines[0].startswith("error: ") and where in lines[0] and text in lines[0], lines[0]
        assert not (tmp_path / "o.nii.gz").exists()
    res = run_cli("sample", "--checkpoint", ckpt, "--label", good, "--out", tmp_path / "o.nii.gz",
                  "--sampler", "ancestral", "--steps", 10)
    assert res.exit_code == 2 and res.stderr.startswith("error: --steps is for --sampler ddim")


def test_evaluate_bad_inputs_give_one_line_errors(project, tmp_path):
    from voxdiff.pipeline.evaluate import run_evaluate
    from voxdiff.runtime.errors import VoxdiffError

    root, params, _ = project

    def copy(name, classes=3):
        dest = tmp_path / name
        write_tiny_cache(dest, classes=classes)
        shutil.copy(root / "params.yaml", dest / "params.yaml")
        (dest / "models").mkdir()
        shutil.copy(root / "models" / "checkpoint.pt", dest / "models" / "checkpoint.pt")
        return dest

    with pytest.raises(VoxdiffError, match="checkpoint.pt: checkpoint not found"):
        run_evaluate(params, tmp_path / "empty")
    other = copy("four_classes", classes=4)
    with pytest.raises(VoxdiffError, match=r"checkpoint.pt: trained for label values \[0, 1, 2\], but .* holds \[0, 1, 2, 3\]"):
        run_evaluate(params, other)
    unknown = copy("unknown_class")
    labels = np.load(unknown / "data" / "processed" / "labels.npy")
    labels[5, 0, 0, 0] = 9  # a validation subject
    np.save(unknown / "data" / "processed" / "labels.npy", labels)
    with pytest.raises(VoxdiffError, match="labels.npy: subject sub-005 holds class index 9"):
        run_evaluate(params, unknown)
    blocked = copy("blocked")
    (blocked / "plots").write_text("a file where the plots folder goes")
    with pytest.raises(VoxdiffError, match="eval: cannot create its folder"):
        run_evaluate(params, blocked)

    res = run_cli("evaluate", "--root", blocked)  # the same through the CLI: one line, exit 2
    assert res.exit_code == 2 and len(res.stderr.strip().splitlines()) == 1
    assert res.stderr.startswith("error: ") and "plots" in res.stderr
