"""Stage `evaluate`: sample with the EMA weights for the validation label maps and measure the result.

Outputs (all written whole or not at all):
  samples/<id>_s<k>.nii.gz   generated volumes on the subject's processed grid (DDIM), [-1, 1]
  samples/<id>_a0.nii.gz     with evaluate.ancestral: the full ancestral (DDPM) sampler's volume
  metrics/eval_detail.json   eval_* metrics (the same names are logged into the training's MLflow run)
  metrics/eval.json          the DVC metrics: SSIM, its floor, diversity and its reference (tracking/dvc_metrics.py)
  plots/eval/<id>.png        montage: label map, real volume, each sample x axial/coronal/sagittal

Metrics (volumes in the cache's [-1, 1] scale; "brain" = label > 0):
  eval_val_loss            the EMA model's loss on training's fixed validation draws (train.val_seed,
                           train.val_draws): on the CPU it equals train_detail.json's final_val_loss
  eval_ssim / _psnr / _mae fidelity of each sample against its subject's real volume: PSNR and MAE over
                           the brain; SSIM (MONAI's 3D SSIM map) averaged over windows centred in the brain
  eval_<m>_floor_noise     the same metric for two reference predictors on the same subjects: clamped
  eval_<m>_floor_tissue_mean  Gaussian noise, and the "tissue-mean" image (each voxel = the training
                           subjects' mean intensity of its class); eval_beats_floors = 1 when the
                           samples beat both on SSIM, PSNR and MAE
  eval_msssim_samples      diversity: MS-SSIM between samples of the same label map (needs
                           samples_per_condition >= 2), each scale averaged over windows centred in the
                           brain as SSIM is, the background set to each volume's brain mean rather than a
                           shared -1; 1 = identical samples (no variation, mode collapse), ~0 = unrelated
                           noise (MONAI clips negative contrast-structure terms to 0)
  eval_diversity_reference the same figure for two images of one label map in the data itself: each
                           evaluated built-in subject against its own pseudo-subject with the bias field,
                           gain and noise drawn again (same deformation). Samples with the data's variation
                           score near it; above it (towards 1) they vary less than the data, below it more
                           (or are noise). Built-in data only: absent for your data, which has no second
                           image of one label map to compare
  eval_msssim_real         the same between real volumes of different validation subjects (windows centred
                           in either brain): different anatomy, not a target for the samples
  eval_w1_<class>          Wasserstein-1 between generated and real intensities inside each class
  eval_mean_real_<class>, eval_mean_sample_<class>, eval_contrast_order_ok (1 when the samples' class
                           means keep the real data's order, e.g. CSF < GM < WM on T1, each step with at
                           least a fifth of the real contrast), eval_contrast_ratio (the smallest
                           sample/real contrast ratio between neighbouring classes)
  eval_seconds_per_volume, eval_peak_memory_mb (CUDA: peak allocated per volume; CPU: the process's
                           peak RSS) and, with evaluate.ancestral, the same for one ancestral sample
                           per subject plus eval_ssim_ancestral
  eval_sampler, eval_ddim_eta  which sampler made the evaluated volumes (evaluate.sampler, evaluate.ddim_eta)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

from voxdiff.data.cache import ProcessedCache, open_cache
from voxdiff.diffusion import objective, sampling
from voxdiff.evaluation.references import noise_image, tissue_mean_image, tissue_means  # the floors' predictors
from voxdiff.params import Params
from voxdiff.runtime.errors import VoxdiffError
from voxdiff.runtime.fsutil import atomic_path, check_writable, sha256_file, write_json
from voxdiff.tracking import dvc_metrics
from voxdiff.training import checkpoint

DATA_RANGE = 2.0  # the cache's intensities span [-1, 1]
MAX_MONTAGE_SAMPLES = 6
MAX_REAL_PAIRS = 45  # real-real MS-SSIM pairs (all pairs of 10 subjects)
BUILTIN_NAMES = ("background", "CSF", "GM", "WM")
CONTRAST_MIN_FRACTION = 0.2  # see contrast_order


def paths(root: Path) -> dict[str, Path]:
    return {
        "checkpoint": root / "models" / "checkpoint.pt",
        "cache": root / "data" / "processed",
        "samples": root / "samples",
        "metrics": root / "metrics" / "eval.json",
        "detail": root / "metrics" / "eval_detail.json",
        "plots": root / "plots" / "eval",
    }


def say(msg: str) -> None:
    print(f"[voxdiff evaluate] {msg}", file=sys.stderr, flush=True)


# --- metrics ------------------------------------------------------------------------------------------
def _odd_at_most(n: int, cap: int = 11) -> int:
    k = min(cap, n)
    return k if k % 2 else k - 1


def brain_ssim_and_cs(x: torch.Tensor, y: torch.Tensor, brain: np.ndarray, k: int) -> tuple[float, float]:
    """MONAI's SSIM and contrast-structure maps of [1, 1, D, H, W] volumes (compute_ssim_and_cs: Gaussian
    window of k voxels, sigma 1.5 k / 11, valid convolution), each averaged over the windows centred in
    the brain; (nan, nan) when no window is. The one windowing rule of SSIM and MS-SSIM."""
    from monai.metrics.regression import compute_ssim_and_cs

    smap, cs = compute_ssim_and_cs(x, y, spatial_dims=3, kernel_size=[k] * 3, kernel_sigma=[1.5 * k / 11] * 3,
                                   data_range=DATA_RANGE)
    r = k // 2
    centres = np.asarray(brain, bool)[tuple(slice(r, n - r) for n in brain.shape)]
    if not centres.any():
        return float("nan"), float("nan")
    return _brain_mean(smap, centres), _brain_mean(cs, centres)


@contextlib.contextmanager
def ieee_fp32(device):
    """IEEE fp32 convolutions and matmuls on a CUDA device for the block (MONAI's SSIM runs in float32, and
    its variances are differences of window means, E[x^2] - E[x]^2, which TF32's 10-bit mantissa, on by
    train.tf32 and by PyTorch's default for cuDNN convolutions, would round away in flat regions)."""
    if device is None or torch.device(device).type != "cuda":
        yield
        return
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)  # the switches training sets
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # (distributed.configure_backends)
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _brain_mean(m: torch.Tensor, centres: np.ndarray) -> float:
    """Mean of a [1, 1, D, H, W] map over the windows centred in the brain: with numpy on the CPU (as it
    always was), on the map's device otherwise (CUDA: the mask goes there, not the map to the host)."""
    if m.device.type == "cpu":
        return float(m[0, 0].numpy()[centres].mean())
    return float(m[0, 0][torch.from_numpy(centres).to(m.device)].mean())


class BrainSSIM:
    """3D SSIM averaged over windows centred in the brain only (brain_ssim_and_cs).

    Window 11 voxels, sigma 1.5, shrunk for grids under 11 voxels. Averaging over the whole grid
    (as SSIMMetric does) lets the ~75 % background, identical in both volumes, flatter any sample:
    pure noise scored 0.22-0.42 that way and scores ~0 here.
    """

    def __init__(self, shape, device=None):
        self.k = max(1, _odd_at_most(min(shape)))
        # where the metrics run: None = on the CPU with numpy as ever; evaluate passes its CUDA device
        self.device = torch.device(device) if device is not None else None

    def __call__(self, x: np.ndarray, y: np.ndarray, brain: np.ndarray) -> float:
        with ieee_fp32(self.device):
            return brain_ssim_and_cs(_vol(x, self.device), _vol(y, self.device), brain, self.k)[0]


def msssim_config(shape) -> tuple[int, int, tuple[float, ...]]:
    """(scales, kernel size, weights) of MS-SSIM that fit a small grid.

    The standard configuration (5 scales, 11-voxel window: MONAI's default) needs > 160 voxels per
    axis; the demo grid is 32^3. MONAI's MultiScaleSSIMMetric takes any kernel size and weights, so we
    keep MONAI's metric and choose: the most scales whose coarsest grid still holds a window of at
    least 5 voxels (smaller windows make the local statistics too noisy), the largest odd window up
    to 11 at that depth, sigma scaled with the window (1.5 at 11), and the first weights of the
    standard set, renormalised to sum to 1 so values stay comparable across grid sizes.
    32^3 -> 3 scales, window 7; 16^3 -> 2 scales, window 7; 64^3 -> 4 scales, window 7.
    """
    standard = (0.0448, 0.2856, 0.3001, 0.2363, 0.1333)
    n = min(shape)
    for levels in (5, 4, 3, 2):
        # MONAI's own size check uses (levels - 1)^2; the coarsest grid must also hold the window.
        k = _odd_at_most(min(n // max(1, (levels - 1) ** 2), n // 2 ** (levels - 1)))
        if k >= 5:
            w = standard[:levels]
            return levels, k, tuple(x / sum(w) for x in w)
    raise VoxdiffError(f"a {list(shape)} grid is too small for MS-SSIM (needs at least 10 voxels per axis)")


class BrainMSSSIM:
    """MS-SSIM (MONAI's compute_ms_ssim: contrast-structure at each finer scale, SSIM at the coarsest,
    negative terms clipped to 0, weighted geometric mean; 2x average pooling between scales) with each
    scale's maps averaged over the windows centred in the brain, as BrainSSIM does (brain_ssim_and_cs).
    At a coarser scale a voxel is brain when at least half of the finer voxels it pools are.

    Over the whole grid (MultiScaleSSIMMetric) the background, -1 in both volumes of a pair with one
    mask, scores 1 in every window and inflates the figure; with a brain that fills the grid the two
    are the same number. Scales and window: msssim_config; inputs: brain_filled (pairwise_msssim).
    """

    def __init__(self, shape, device=None):
        self.levels, self.k, self.weights = msssim_config(shape)
        self.device = torch.device(device) if device is not None else None  # as BrainSSIM

    def __call__(self, x: np.ndarray, y: np.ndarray, brain: np.ndarray) -> float:
        with ieee_fp32(self.device):
            return self._score(x, y, brain)

    def _score(self, x: np.ndarray, y: np.ndarray, brain: np.ndarray) -> float:
        import torch.nn.functional as F

        x, y, brain = _vol(x, self.device), _vol(y, self.device), np.asarray(brain, bool)
        terms = []
        for level in range(self.levels):
            if level:
                x, y = F.avg_pool3d(x, 2), F.avg_pool3d(y, 2)
                brain = F.avg_pool3d(_vol(brain), 2)[0, 0].numpy() >= 0.5
            ssim, cs = brain_ssim_and_cs(x, y, brain, self.k)
            terms.append(ssim if level == self.levels - 1 else cs)
        if not all(math.isfinite(t) for t in terms):
            return float("nan")
        return float(np.prod([max(t, 0.0) ** w for t, w in zip(terms, self.weights)]))


def _vol(x: np.ndarray, device=None) -> torch.Tensor:
    v = torch.from_numpy(np.array(x, np.float32))[None, None]  # a copy: cache rows are read-only memmaps
    return v if device is None else v.to(device)


def brain_filled(volume: np.ndarray, brain: np.ndarray) -> np.ndarray:
    """The volume with its background set to its own mean in the brain (the MS-SSIM inputs): a -1
    background drawn into both volumes of a pair puts one step at the brain's edge into both, which every
    window across the edge, and every coarse scale, reads as shared structure."""
    volume = np.asarray(volume, np.float32)
    fill = float(volume[brain].mean()) if brain.any() else -1.0
    return np.where(brain, volume, fill).astype(np.float32)


def fidelity(sample: np.ndarray, real: np.ndarray, brain: np.ndarray, ssim: BrainSSIM) -> dict:
    """SSIM (windows centred in the brain), PSNR and MAE over the brain, of one sample against the real volume.
    With a metric on a device (ssim.device: evaluate's CUDA device) all three are computed there, else with
    numpy on the CPU, as always."""
    if ssim.device is not None:
        mask = torch.from_numpy(np.asarray(brain, bool)).to(ssim.device)
        d = (_vol(sample, ssim.device) - _vol(real, ssim.device))[0, 0][mask].double()
        mse = float(d.square().mean()) if d.numel() else float("nan")
        return {"ssim": ssim(sample, real, brain),
                "psnr": 10 * math.log10(DATA_RANGE ** 2 / mse) if mse > 0 else float("inf"),
                "mae": float(d.abs().mean()) if d.numel() else float("nan")}
    diff = (sample - real)[brain].astype(np.float64)
    mse = float(np.mean(diff ** 2)) if diff.size else float("nan")
    return {
        "ssim": ssim(sample, real, brain),
        "psnr": 10 * math.log10(DATA_RANGE ** 2 / mse) if mse > 0 else float("inf"),
        "mae": float(np.mean(np.abs(diff))) if diff.size else float("nan"),
    }


def fidelity_floors(subjects: list[dict], cache: ProcessedCache, ssim: BrainSSIM, seed: int) -> dict:
    """eval_{ssim,psnr,mae}_floor_{noise,tissue_mean}: the fidelity metrics of the two reference
    predictors on the same validation subjects, so a reader sees whether the model beats them."""
    floors: dict = {}
    table = tissue_means(cache)  # once: it reads every training subject
    for name in ("noise", "tissue_mean"):
        scores = []
        for s, e in enumerate(subjects):
            x = noise_image(e["real"].shape, seed + s) if name == "noise" else tissue_mean_image(table, e["label"])
            scores.append(fidelity(x, e["real"], e["label"] > 0, ssim))
        for k in ("ssim", "psnr", "mae"):
            floors[f"eval_{k}_floor_{name}"] = float(np.mean([f[k] for f in scores]))
    return floors


def pairwise_msssim(volumes: list[np.ndarray], brains: list[np.ndarray], metric: BrainMSSSIM,
                    max_pairs: int | None = None) -> float | None:
    """Mean brain-centred MS-SSIM over pairs of volumes (background filled: brain_filled), each pair over
    the windows centred in either's brain; None for fewer than two volumes."""
    pairs = list(itertools.combinations(range(len(volumes)), 2))[:max_pairs]
    if not pairs:
        return None
    values = [metric(brain_filled(volumes[i], brains[i]), brain_filled(volumes[j], brains[j]), brains[i] | brains[j])
              for i, j in pairs]
    return float(np.mean(values))


def builtin_subject(params: Params, index: int, appearance: int) -> tuple[np.ndarray, np.ndarray]:
    """(image, class indices) of built-in pseudo-subject ``index`` with bias field, gain and noise from
    stream ``appearance`` (0 = the stored subject), through preprocess's own code onto its grid."""
    import tempfile

    from voxdiff.data import builtin, preprocess

    image, label, affine = builtin.synth_subject(index, params.data.seed, params.data.synth_spacing, appearance)
    with tempfile.TemporaryDirectory(prefix="voxdiff-reference-") as tmp:
        paths_ = (Path(tmp) / "image.nii.gz", Path(tmp) / "label.nii.gz")
        builtin.save_nifti(paths_[0], image, affine)
        builtin.save_nifti(paths_[1], label, affine)
        out_image, out_classes, _, _ = preprocess.preprocess_pair(*paths_, params)
    return out_image, out_classes


def diversity_reference(params: Params, cache: ProcessedCache, rows, metric: BrainMSSSIM) -> float | None:
    """eval_diversity_reference: the brain-centred MS-SSIM between two images of one label map in the
    built-in data, averaged over the evaluated subjects: each subject's cached volume and the same
    pseudo-subject (same deformation, so the same label map) with its bias field, gain and noise drawn
    again, preprocessed the same way: the variation of the data's own images given a label map. None (there
    is no such pair) unless the cache was made from the built-in data by these params."""
    if not params.data.builtin or cache.manifest.get("source") != params.data.source:
        return None
    values = []
    for r in rows:
        sid = cache.subjects[r]["id"]
        found = re.fullmatch(r"sub-(\d+)", sid)
        if not found:
            return None
        image, label = builtin_subject(params, int(found.group(1)), appearance=1)
        cached_label = np.asarray(cache.labels[r])
        if image.shape != cached_label.shape or not np.array_equal(label, cached_label):
            warnings.warn(f"{cache.root}: subject {sid} is not built-in pseudo-subject {sid} of params.yaml's "
                          "data and preprocess settings; no diversity reference (rerun prepare and preprocess)")
            return None
        values.append(pairwise_msssim([np.asarray(cache.images[r], np.float32), image], [cached_label > 0] * 2,
                                      metric))
    return float(np.mean(values)) if values else None


def contrast_ratio(real_means: dict[int, float], sample_means: dict[int, float]) -> float | None:
    """Smallest (sample gap / real gap) over neighbouring foreground classes in the real data's order
    (e.g. CSF->GM and GM->WM on T1): 1 = the real contrast, <= 0 = the order is broken."""
    classes = sorted((c for c in real_means if c in sample_means), key=real_means.get)
    ratios = [(sample_means[b] - sample_means[a]) / (real_means[b] - real_means[a])
              for a, b in zip(classes, classes[1:]) if real_means[b] > real_means[a]]
    return min(ratios) if ratios else None


def contrast_order(real_means: dict[int, float], sample_means: dict[int, float]) -> bool:
    """True when the samples' class means keep the real data's order, each step with at least
    CONTRAST_MIN_FRACTION of the real contrast (a noise image keeps some order by chance, with gaps
    near zero; that must not count)."""
    ratio = contrast_ratio(real_means, sample_means)
    return ratio is None or ratio >= CONTRAST_MIN_FRACTION


def class_keys(params: Params, label_values: list[int]) -> tuple[list[str], list[str]]:
    """(display names, metric-key names) of the classes: CSF/GM/WM for the built-in data, else label<value>."""
    if params.data.builtin and len(label_values) == len(BUILTIN_NAMES):
        return list(BUILTIN_NAMES), [n.lower() for n in BUILTIN_NAMES]
    return [f"label {v}" for v in label_values], [f"label{v}" for v in label_values]


# --- the stage ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def _writing(path: Path):
    try:
        yield
    except OSError as e:
        raise VoxdiffError(f"{path}: cannot write ({e.strerror or type(e).__name__})") from None


def check_compatible(state: dict, cache: ProcessedCache, ckpt_path: Path, rows: np.ndarray) -> None:
    values = sampling.checkpoint_label_values(state, ckpt_path)
    if values != list(cache.label_values):
        raise VoxdiffError(f"{ckpt_path}: trained for label values {values}, but {cache.root} holds "
                           f"{list(cache.label_values)}; rerun train")
    shape = list(cache.images.shape[1:])
    if list(state.get("shape", [])) != shape:
        raise VoxdiffError(f"{ckpt_path}: trained on a {state.get('shape')} grid, but {cache.root} holds {shape}; "
                           "rerun train")
    labels_file = cache.root / "labels.npy"
    if cache.labels.ndim != 4:
        raise VoxdiffError(f"{labels_file}: expected [subjects, D, H, W] label maps, got {cache.labels.ndim - 1}D maps")
    for r in rows:
        top = int(np.max(cache.labels[r]))
        if top >= cache.num_classes:
            raise VoxdiffError(f"{labels_file}: subject {cache.subjects[r]['id']} holds class index {top}, "
                               f"but there are {cache.num_classes} classes ({values}); rerun preprocess")


def evaluated_weights(state: dict, which: str) -> tuple[str, dict]:
    """("best" or "final", a checkpoint state whose "ema", "step" and "samples_seen" are those weights'). best:
    the EMA at the run's own best (training/best.py), when the run kept one (five validations or more, and a
    checkpoint written since voxdiff kept it) and passed it; a run still at its lowest at its end is at its best
    there (still_at_best). Else the final weights, and the name says so."""
    best = state.get("best") or {}
    if which == "best" and best.get("ema") is not None and best.get("mark"):
        mark = best["mark"]
        if still_at_best(state):
            say(f"the run was still at its lowest at its end (best window ending at step {state['step']}): its "
                "final weights are its best")
            return "best", state
        return "best", {**state, "ema": best["ema"], "step": int(mark["step"]),
                        "samples_seen": int(mark["samples_seen"])}
    if which == "best":
        say("no best point kept in the checkpoint (fewer than 5 validations, or written before voxdiff kept one): "
            "evaluating the final weights")
    return "final", state


def still_at_best(state: dict) -> bool:
    """The run's lowest window of validations is its last (convergence.best_point, the rule the kept copy
    follows): it never passed its best (still falling, or flat, at its end), so its final weights are at least
    as good and are the ones read."""
    from voxdiff.analysis.convergence import best_point

    best = best_point([h["val_loss"] for h in state.get("history", []) if h.get("val_loss") is not None])
    return best is not None and best.at_end


@dataclasses.dataclass(frozen=True)
class EvalSetting:
    """What every set of weights is evaluated against: the same subjects, draws, device and references."""
    params: Params
    cache: ProcessedCache
    state: dict            # the checkpoint (its training params and resolved precision)
    source: Path           # the checkpoint file, named in errors
    val_rows: np.ndarray   # every validation subject (the val loss)
    rows: np.ndarray       # those sampled (evaluate.subjects)
    device: torch.device
    reference: float | None  # the data's own diversity (diversity_reference)
    interactive: bool


def evaluate_network(net, diff_p, setting: EvalSetting) -> tuple[list[dict], dict]:
    """Validation loss, samples and their figures for one set of weights: (per-subject entries, metrics)."""
    params, cache, state, source = setting.params, setting.cache, setting.state, setting.source
    val_rows, rows, device, reference, interactive = (setting.val_rows, setting.rows, setting.device,
                                                      setting.reference, setting.interactive)
    ev = params.evaluate
    metric_device = device if device.type == "cuda" else None  # SSIM, MS-SSIM, PSNR, MAE: on the GPU there
    C = cache.num_classes
    shape = tuple(cache.images.shape[1:])
    _, keys = class_keys(params, list(cache.label_values))

    # 1. The convergence signal of training, recomputed for the weights being evaluated.
    from voxdiff.diffusion.model import build_inferer, build_scheduler

    # The training's resolved precision (as `voxdiff sample` uses): auto may resolve otherwise here.
    rt = sampling.checkpoint_runtime(state, device, params.train.precision, source)
    draws = objective.val_draws(params.train.val_seed, len(val_rows), params.train.val_draws, diff_p.timesteps,
                                (1, *shape))
    scheduler = build_scheduler(diff_p)
    val_loss = objective.validation_loss(net, build_inferer(scheduler), scheduler, cache, val_rows, draws, diff_p,
                                         device, rt.autocast)

    # 2. Sampling.
    K = ev.samples_per_condition
    total = len(rows) * (K + (1 if ev.ancestral else 0))
    main_sampler = (f"DDIM {min(ev.sampling_steps, diff_p.timesteps)} steps" + (f", eta {ev.ddim_eta:g}" if ev.ddim_eta else "")
                    if ev.sampler == "ddim" else f"ancestral {diff_p.timesteps} steps")
    say(f"{len(rows)} validation subjects x {K} samples, {main_sampler}"
        + (f", + 1 ancestral sample each ({diff_p.timesteps} steps)" if ev.ancestral else "")
        + f" on {device}; EMA val loss {val_loss:.4f}")
    from tqdm.auto import tqdm

    bar = tqdm(total=total, unit="volume", desc="evaluate", dynamic_ncols=True, disable=not interactive)
    records, records_a = [], []
    subjects = []
    try:
        for s, r in enumerate(rows):
            label = np.asarray(cache.labels[r])
            real = np.asarray(cache.images[r], np.float32)
            cond = torch.from_numpy(label.astype(np.int64))[None].expand(K, *shape)
            gen = sampling.generate(net, diff_p, cond, C, ev.sampling_steps, params.seed, ev.sampler,
                                    progress=interactive, subject=s, sample_index=0, record=records,
                                    autocast=rt.autocast, eta=ev.ddim_eta)
            bar.update(K)
            entry = {"row": int(r), "id": cache.subjects[r]["id"], "label": label, "real": real,
                     "samples": [g[0].numpy() for g in gen], "ancestral": None}
            if ev.ancestral:  # starts from the same noise as DDIM sample 0: a paired comparison
                a = sampling.generate(net, diff_p, cond[:1], C, ev.sampling_steps, params.seed, "ancestral",
                                      progress=interactive, subject=s, sample_index=0, record=records_a,
                                      autocast=rt.autocast)
                entry["ancestral"] = a[0, 0].numpy()
                bar.update(1)
            subjects.append(entry)
    finally:
        bar.close()

    metrics = measure(subjects, cache, val_rows, C, keys, shape, reference, metric_device)
    metrics.update(fidelity_floors(subjects, cache, BrainSSIM(shape, metric_device), params.seed))
    metrics["eval_beats_floors"] = int(beats_floors(metrics))
    metrics = {"eval_val_loss": val_loss, **metrics,
               "eval_seconds_per_volume": float(np.mean([x["seconds"] for x in records])),
               "eval_peak_memory_mb": float(max(x["peak_memory_mb"] for x in records)),
               "eval_sampling_steps": records[0]["steps"], "eval_sampler": ev.sampler,
               "eval_ddim_eta": ev.ddim_eta if ev.sampler == "ddim" else None, "eval_subjects": len(rows),
               "eval_samples_per_condition": K}
    if ev.ancestral:
        ssim = BrainSSIM(shape, metric_device)
        metrics["eval_ssim_ancestral"] = float(np.mean([ssim(e["ancestral"], e["real"], e["label"] > 0)
                                                        for e in subjects]))
        metrics["eval_seconds_per_volume_ancestral"] = float(np.mean([x["seconds"] for x in records_a]))
        metrics["eval_peak_memory_mb_ancestral"] = float(max(x["peak_memory_mb"] for x in records_a))
        metrics["eval_ancestral_steps"] = records_a[0]["steps"]
    metrics = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    return subjects, metrics


def run_evaluate(params: Params, root, progress: bool | None = None) -> dict:
    """Sample, measure, write samples/, metrics/eval_detail.json and eval.json, plots/eval/ and log into MLflow;
    returns the metrics (eval_detail.json's)."""
    root = Path(root)
    out = paths(root)
    ev = params.evaluate
    state = checkpoint.load(out["checkpoint"])
    cache = open_cache(out["cache"])
    val_rows = cache.split_indices("val")
    if len(val_rows) == 0:
        raise VoxdiffError(f"{out['cache'] / 'manifest.json'}: no validation subjects to evaluate on")
    rows = val_rows[: ev.subjects] if ev.subjects else val_rows
    check_compatible(state, cache, out["checkpoint"], rows)
    for key in ("samples", "metrics", "plots"):
        check_writable(out[key])

    from voxdiff.runtime.distributed import configure_backends, pick_device

    device = pick_device(params.train.device)
    configure_backends(device, params.train.tf32, params.train.deterministic)  # CUDA only: as training ran
    metric_device = device if device.type == "cuda" else None
    reference = diversity_reference(params, cache, rows, BrainMSSSIM(tuple(cache.images.shape[1:]), metric_device))
    if reference is None and not params.data.builtin:
        say("no diversity reference (eval_diversity_reference): it exists for the built-in data only")
    which, weights = evaluated_weights(state, ev.checkpoint)
    net, _, diff_p = sampling.load_ema_network(weights, device, source=out["checkpoint"], num_classes=cache.num_classes)
    interactive = sys.stderr.isatty() if progress is None else progress
    setting = EvalSetting(params, cache, state, out["checkpoint"], val_rows, rows, device, reference, interactive)
    subjects, metrics = evaluate_network(net, diff_p, setting)
    metrics.update(eval_checkpoint=which, eval_checkpoint_step=weights["step"],
                   eval_checkpoint_samples_seen=weights["samples_seen"])
    if which == "best":  # the final weights beside them (same figures when the best point is the end)
        metrics.update(final_weights_metrics(metrics, diff_p, setting, weights))
    # Segmentation Dice of the evaluated weights' samples: label fidelity and train-on-synthetic (segmenter.py).
    from voxdiff.evaluation import segmenter

    autocast = sampling.checkpoint_runtime(state, device, params.train.precision, out["checkpoint"]).autocast
    metrics.update(segmenter.dice_metrics(
        params, root, cache, subjects, class_keys(params, list(cache.label_values))[1], device,
        segmenter.ddim_generator(net, diff_p, cache.num_classes, ev.tstr_sampling_steps or ev.sampling_steps,
                                 params.seed, autocast)))
    metrics = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in metrics.items()}
    write_evaluation(params, root, out, state, cache, subjects, metrics)
    return metrics


def final_weights_metrics(best: dict, diff_p, setting: EvalSetting, weights: dict) -> dict:
    """eval_final_*: the figures of the run's final weights, evaluated as the best point's were (the best point's
    own figures again when it is the end)."""
    state = setting.state
    if weights["step"] == state["step"]:
        final = {k: v for k, v in best.items() if k.startswith("eval_")}
    else:
        final_net, _, _ = sampling.load_ema_network(state, setting.device, source=setting.source,
                                                    num_classes=setting.cache.num_classes)
        final = evaluate_network(final_net, diff_p, setting)[1]
    skip = ("eval_checkpoint", "eval_checkpoint_step", "eval_checkpoint_samples_seen")
    return {**{f"eval_final_{k[len('eval_'):]}": v for k, v in final.items() if k.startswith("eval_") and k not in skip},
            "eval_final_checkpoint_step": int(state["step"])}


def write_evaluation(params: Params, root: Path, out: dict, state: dict, cache: ProcessedCache, subjects: list[dict],
                     metrics: dict) -> None:
    """The outputs, each written whole (samples/, plots/eval/, metrics/), then the MLflow run, then one line."""
    names, _ = class_keys(params, list(cache.label_values))
    write_samples(out["samples"], subjects, cache)
    write_montages(out["plots"], subjects, names)
    with _writing(out["metrics"]):
        write_json(out["detail"], metrics)
        write_json(out["metrics"], dvc_metrics.eval_figures(metrics))
    log_to_mlflow(params, root, out, state, metrics)
    say(f"SSIM {_fmt(metrics['eval_ssim'], 3)} (floors: noise {_fmt(metrics['eval_ssim_floor_noise'], 3)}, "
        f"tissue-mean {_fmt(metrics['eval_ssim_floor_tissue_mean'], 3)}), PSNR {_fmt(metrics['eval_psnr'], 1)} dB, "
        f"MAE {_fmt(metrics['eval_mae'], 3)}, contrast order {'kept' if metrics['eval_contrast_order_ok'] else 'NOT kept'}, "
        f"diversity MS-SSIM {_fmt(metrics['eval_msssim_samples'], 3)} (the data's own: "
        f"{_fmt(metrics.get('eval_diversity_reference'), 3)}), "
        f"{metrics['eval_seconds_per_volume']:.2f} s/volume -> {out['detail']}")


def beats_floors(m: dict) -> bool:
    """SSIM and PSNR above, MAE below, both reference predictors."""
    return all(m[f"eval_{k}"] is not None and (m[f"eval_{k}"] < m[f"eval_{k}_floor_{f}"] if k == "mae"
                                               else m[f"eval_{k}"] > m[f"eval_{k}_floor_{f}"])
               for k in ("ssim", "psnr", "mae") for f in ("noise", "tissue_mean"))


def _fmt(value, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def measure(subjects: list[dict], cache: ProcessedCache, val_rows, C: int, keys: list[str], shape,
            reference: float | None = None, device=None) -> dict:
    """The sample metrics of the module docstring; ``reference`` (diversity_reference) is stored next to
    the samples' diversity when there is one. SSIM, MS-SSIM, PSNR and MAE run on `device` (None: the CPU)."""
    from scipy.stats import wasserstein_distance

    ssim = BrainSSIM(shape, device)
    fid = [fidelity(x, e["real"], e["label"] > 0, ssim) for e in subjects for x in e["samples"]]
    for e, chunk in zip(subjects, np.array_split(np.arange(len(fid)), len(subjects))):
        e["scores"] = [fid[i] for i in chunk]
    m: dict = {f"eval_{k}": float(np.mean([f[k] for f in fid])) for k in ("ssim", "psnr", "mae")}

    ms = BrainMSSSIM(shape, device)
    within = [pairwise_msssim(e["samples"], [e["label"] > 0] * len(e["samples"]), ms) for e in subjects]
    within = [w for w in within if w is not None]
    m["eval_msssim_samples"] = float(np.mean(within)) if within else None
    if reference is not None:
        m["eval_diversity_reference"] = reference
    reals = [np.asarray(cache.images[r], np.float32) for r in val_rows]
    m["eval_msssim_real"] = pairwise_msssim(reals, [np.asarray(cache.labels[r]) > 0 for r in val_rows], ms,
                                            MAX_REAL_PAIRS)

    # Tissue realism: intensity distributions and mean contrast per class, pooled over subjects.
    real_means, sample_means = {}, {}
    per_sample_ok = []
    for c in range(C):
        real_v = np.concatenate([e["real"][e["label"] == c] for e in subjects])
        gen_v = np.concatenate([x[e["label"] == c] for e in subjects for x in e["samples"]])
        if real_v.size == 0 or gen_v.size == 0:
            continue
        m[f"eval_w1_{keys[c]}"] = float(wasserstein_distance(real_v, gen_v))
        if c > 0:
            real_means[c], sample_means[c] = float(real_v.mean()), float(gen_v.mean())
    for c in real_means:
        m[f"eval_mean_real_{keys[c]}"] = real_means[c]
        m[f"eval_mean_sample_{keys[c]}"] = sample_means[c]
    m["eval_contrast_order_ok"] = int(contrast_order(real_means, sample_means))
    m["eval_contrast_ratio"] = contrast_ratio(real_means, sample_means)
    for e in subjects:
        present = [c for c in real_means if (e["label"] == c).any()]
        rm = {c: float(e["real"][e["label"] == c].mean()) for c in present}
        for x in e["samples"]:
            per_sample_ok.append(contrast_order(rm, {c: float(x[e["label"] == c].mean()) for c in present}))
    m["eval_contrast_order_fraction"] = float(np.mean(per_sample_ok)) if per_sample_ok else None
    return m


def write_samples(path: Path, subjects: list[dict], cache: ProcessedCache) -> None:
    import nibabel as nib

    with _writing(path), atomic_path(path) as tmp:
        tmp.mkdir()
        for e in subjects:
            affine = cache.affine(e["row"])
            for k, x in enumerate(e["samples"]):
                nib.save(nib.Nifti1Image(x.astype(np.float32), affine), tmp / f"{e['id']}_s{k}.nii.gz")
            if e["ancestral"] is not None:
                nib.save(nib.Nifti1Image(e["ancestral"].astype(np.float32), affine), tmp / f"{e['id']}_a0.nii.gz")


def write_montages(path: Path, subjects: list[dict], class_names: list[str]) -> None:
    with _writing(path), atomic_path(path) as tmp:
        tmp.mkdir()
        for e in subjects:
            montage(tmp / f"{e['id']}.png", e, class_names)


def montage(path: Path, e: dict, class_names: list[str]) -> None:
    """Rows: label map, real volume, samples (DDIM, then ancestral); columns: axial, coronal, sagittal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    from voxdiff.data.preprocess import mid_slices

    rows = [("label map", e["label"]), ("real", e["real"])]
    for k, x in enumerate(e["samples"][:MAX_MONTAGE_SAMPLES]):
        sc = e["scores"][k]
        rows.append((f"sample {k}  SSIM {sc['ssim']:.2f}  MAE {sc['mae']:.2f}", x))
    if e["ancestral"] is not None:
        rows.append(("ancestral sample", e["ancestral"]))
    C = len(class_names)
    palette = ["black"] + [plt.get_cmap("tab10").colors[(k - 1) % 10] for k in range(1, C)]
    cmap = ListedColormap(palette)
    fig, axes = plt.subplots(len(rows), 3, figsize=(7.5, 2.5 * len(rows) + 0.5), squeeze=False)
    for i, (title, vol) in enumerate(rows):
        is_label = i == 0
        for j, (sl, view) in enumerate(zip(mid_slices(np.asarray(vol)), ("axial", "coronal", "sagittal"))):
            ax = axes[i][j]
            if is_label:
                ax.imshow(sl, cmap=cmap, vmin=-0.5, vmax=C - 0.5, origin="lower", interpolation="nearest")
            else:
                ax.imshow(sl, cmap="gray", vmin=-1, vmax=1, origin="lower")
            ax.set_xticks([])
            ax.set_yticks([])
            if i == 0:
                ax.set_title(view, fontsize=9)
            if j == 0:
                ax.set_ylabel(title, fontsize=8)
    handles = [Patch(color=palette[k], label=class_names[k]) for k in range(1, C)]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.suptitle(f"{e['id']} (validation)", fontsize=10)
    fig.tight_layout(rect=(0, 0.5 / (2.5 * len(rows) + 0.5), 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def log_to_mlflow(params: Params, root: Path, out: dict, state: dict, metrics: dict) -> None:
    """Into the training's run (id from the checkpoint, else metrics/train_detail.json); problems only warn."""
    from voxdiff.tracking.runs import open_existing

    run_id = state.get("mlflow_run_id") or ""
    if not run_id:
        try:
            run_id = dvc_metrics.read(root, "train").get("mlflow_run_id", "")
        except (OSError, ValueError, AttributeError):
            pass
    if not run_id:
        warnings.warn("no MLflow run id in the checkpoint or metrics/train_detail.json; evaluation is not logged to MLflow")
        return
    tracker = open_existing(params, root, run_id)
    if tracker is None:
        return
    values = {k: v for k, v in metrics.items() if v is not None}
    tracker.log_summary(values, artifacts=[out["detail"]],
                        tags={"voxdiff.eval_checkpoint_sha256": sha256_file(out["checkpoint"])})
    try:
        tracker.client.log_artifacts(run_id, str(out["plots"]), artifact_path="eval")
    except Exception as e:  # an artifact store problem must not fail the stage: eval.json is complete
        warnings.warn(f"MLflow: could not log the evaluation montages ({type(e).__name__}: {str(e)[:200]})")
