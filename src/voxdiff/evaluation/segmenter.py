"""Segmentation Dice: do the generated volumes serve what they are generated for (issue 35)?

Two ways of scoring a generator with a small 3D segmenter (MONAI's UNet, trained with MONAI's DiceCE
loss, scored with MONAI's DiceMetric), as med-ddpm and MAISI score theirs:

  label fidelity   segmenters trained on the real training volumes segment every generated volume; Dice per
                   tissue (every class but the background) against the label map it was generated from.
                   Beside it: the ceiling (the same segmenters on the real volumes of the same validation
                   subjects), the floor (on pure noise, as evaluate's noise floor draws it) and the tissue-mean
                   image (each voxel = its class's mean intensity: trivially segmentable, so it scores high; it
                   is a reference, not a floor: an image can match its label map perfectly and look nothing
                   like an MRI, which SSIM/PSNR/MAE and diversity say).
  train on synthetic, test on real (med-ddpm's protocol)
                   the same architecture with the same optimizer steps and seeds trained on synthetic volumes
                   generated from the training label maps (evaluate.tstr_samples_per_map per map, DDIM with
                   evaluate.tstr_sampling_steps: 10 steps give the demo's x0 model's 50-step volumes), on the real
                   training volumes, and on both; each tested on the real validation volumes. Dice per tissue,
                   mean and std (ddof 1) over evaluate.segmenter_seeds seeds, and the ratio synthetic / real.

The real-trained segmenters depend on the data only (the cache's fingerprint, which includes the split), the
segmenter settings and the seed: each is trained once and kept in the project's models/segmenter/<key>.pt
(written atomically), so runs of one dataset share them and their ceiling. A queued DVC experiment keeps them
in the project it was queued from (DVC_ROOT), not in its temporary copy, so the experiments of a queued grid
share them too; evaluations at the same moment take a lock per file (<key>.pt.lock): the first trains a missing
one, the others wait and load it. The key also holds this file's hash, the torch and MONAI versions and the
device type. On the CPU a segmenter trains and runs on one thread: the same numbers on any machine's core
count, and on 2 busy cores faster than two threads.

Metrics (class names as evaluate's: csf/gm/wm for the built-in data, label<value> otherwise):
  eval_dice_fidelity_<class>, _mean                 label fidelity (mean over the real-trained segmenters
                                                    and the generated volumes; _mean over the tissues)
  eval_dice_fidelity_<class>_ceiling, _mean_ceiling    ... of the real volumes of the same subjects
  eval_dice_fidelity_<class>_floor_noise, ...          ... of clamped Gaussian noise
  eval_dice_fidelity_<class>_tissue_mean, ...          ... of the tissue-mean image (trivially segmentable)
  eval_dice_tstr_<arm>, _<arm>_std                  train-on-<arm> (synthetic | real | both), tested on the
  eval_dice_tstr_<arm>_<class>, _<arm>_<class>_std  real validation volumes: mean (std) over seeds
  eval_dice_tstr_ratio, _ratio_std                  synthetic / real of the tissue means (std: of the ratios
                                                    seed by seed, each seed's arms starting from the same weights)
  eval_dice_tstr_volumes                            synthetic volumes trained on
  eval_segmenter_seconds                            mean seconds to train one segmenter (those trained here)
  eval_dice_tstr_generate_seconds, eval_dice_seconds   sampling the synthetic volumes; all of the above
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from voxdiff.runtime.errors import DataError, VoxdiffError
from voxdiff.runtime.fsutil import atomic_path, project_root

BATCH = 2          # volumes per optimizer step (at 32^3 on the CPU: the fast convolution path, ~23 ms a step)
LR = 1e-2          # Adam's learning rate
GEN_BATCH = 4      # synthetic volumes per sampler call (DDIM runs a batch in one network call per step)
TSTR_STREAM = 0x74737472  # the sampler's noise stream ("subject") of the synthetic training volumes
ARMS = ("synthetic", "real", "both")
FORMAT = 1
LOCK_WAIT_S = 1800  # the longest a side-by-side evaluation waits for another to train a missing segmenter

# generate(label maps [B, D, H, W] class indices, index of the first volume) -> volumes [B, D, H, W] in [-1, 1]
Generator = Callable[[np.ndarray, int], np.ndarray]


def say(msg: str) -> None:
    print(f"[voxdiff evaluate] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class SegmenterSpec:
    """What a segmenter is: its size and training (everything but the data and the seed)."""
    num_classes: int
    channels: tuple[int, ...]
    steps: int
    batch: int = BATCH
    lr: float = LR


def spec_of(params, num_classes: int) -> SegmenterSpec:
    ev = params.evaluate
    return SegmenterSpec(num_classes, tuple(ev.segmenter_channels), ev.segmenter_steps)


def build_segmenter(spec: SegmenterSpec):
    """MONAI's UNet: one input channel, a logit per class, stride 2 between levels, no residual units
    (num_res_units 1 doubles the step time for no gain in Dice here), instance norm."""
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=spec.num_classes, channels=spec.channels,
                strides=(2,) * (len(spec.channels) - 1), num_res_units=0, norm="instance")


@contextlib.contextmanager
def _one_thread(device):
    """One intra-op thread on the CPU for the block (see the module docstring); nothing on CUDA."""
    import torch

    if device is not None and torch.device(device).type != "cpu":
        yield
        return
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _seed(seed: int, purpose: int) -> int:
    from voxdiff.diffusion.objective import stream_seed

    return stream_seed(seed, 0x5E6, purpose)


def train_segmenter(images: np.ndarray, labels: np.ndarray, spec: SegmenterSpec, seed: int, device=None):
    """A segmenter trained on volumes [N, D, H, W] (in [-1, 1]) and their class maps: spec.steps Adam steps of
    spec.batch volumes each (drawn without replacement within a step), MONAI's DiceCE loss (softmax, one-hot
    targets, background included). Seeded: initial weights and batches by `seed`; the global RNG is left
    as it was. Returns (network in eval mode, seconds)."""
    import torch
    from monai.losses import DiceCELoss

    device = torch.device(device or "cpu")
    t0 = time.perf_counter()
    with _one_thread(device), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(_seed(seed, 0))
        net = build_segmenter(spec).to(device)
        x = torch.from_numpy(np.asarray(images, np.float32)).to(device)[:, None]
        y = torch.from_numpy(np.asarray(labels, np.int64)).to(device)[:, None]
        draws = torch.Generator().manual_seed(_seed(seed, 1))
        opt = torch.optim.Adam(net.parameters(), lr=spec.lr)
        loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
        net.train()
        for _ in range(spec.steps):
            idx = torch.randperm(len(x), generator=draws)[: spec.batch].to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x[idx]), y[idx])
            loss.backward()
            opt.step()
        last = loss.item()
        if not math.isfinite(last):
            raise VoxdiffError(f"the segmenter's loss became {last} (seed {seed}): lower its learning rate")
    return net.eval(), time.perf_counter() - t0


def segment(net, volumes: np.ndarray, batch: int = 4) -> np.ndarray:
    """Class maps [N, D, H, W] (argmax of the logits) of volumes [N, D, H, W]."""
    import torch

    device = next(net.parameters()).device
    out = []
    with _one_thread(device), torch.no_grad():
        for i in range(0, len(volumes), batch):
            x = torch.from_numpy(np.asarray(volumes[i:i + batch], np.float32)).to(device)[:, None]
            out.append(net(x).argmax(1).cpu().numpy().astype(np.uint8))
    return np.concatenate(out)


def dice(pred: np.ndarray, target: np.ndarray, num_classes: int) -> np.ndarray:
    """MONAI's DiceMetric per volume and tissue: [N, num_classes - 1] (background left out); NaN where the
    target map lacks the class (ignore_empty)."""
    import torch
    from monai.metrics import DiceMetric

    metric = DiceMetric(include_background=False, reduction="none", ignore_empty=True, num_classes=num_classes)
    p = torch.from_numpy(np.asarray(pred, np.int64))[:, None]
    t = torch.from_numpy(np.asarray(target, np.int64))[:, None]
    return metric(p, t).double().numpy()


def _nanmean(a: np.ndarray, axis=None):
    """Mean over the finite entries (NaN where there is none), without numpy's empty-slice warning."""
    a = np.asarray(a, np.float64)
    ok = np.isfinite(a)
    n = ok.sum(axis=axis)
    s = np.where(ok, a, 0.0).sum(axis=axis)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, s / np.maximum(n, 1), np.nan)


def scores(nets: list, volumes: np.ndarray, labels: np.ndarray, num_classes: int) -> np.ndarray:
    """Dice per tissue [num_classes - 1]: each segmenter's mean over the volumes, then the mean over segmenters."""
    return _nanmean(np.stack([_nanmean(dice(segment(n, volumes), labels, num_classes), axis=0) for n in nets]),
                    axis=0)


# --- the real-trained segmenters, cached -----------------------------------------------------------------
def cache_key(fingerprint: str, spec: SegmenterSpec, seed: int, device_type: str) -> str:
    import monai
    import torch

    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    ident = {"format": FORMAT, "data": fingerprint, "spec": dataclasses.asdict(spec), "seed": seed,
             "device": device_type, "torch": torch.__version__, "monai": monai.__version__, "code": code}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]


def real_segmenter(folder: Path, fingerprint: str, images: np.ndarray, labels: np.ndarray, spec: SegmenterSpec,
                   seed: int, device=None):
    """The segmenter trained on the real training volumes with `seed`: loaded from folder/<key>.pt, or trained
    and written there (atomically). Returns (network, seconds trained here or None when loaded).

    Queued experiments evaluate side by side into one folder (the project's, segmenter.dice_metrics): a lock per
    file makes the first train it and the others wait and load it, and whoever holds the lock clears the
    temporary folders an evaluation killed while writing that file left behind."""
    import torch
    from filelock import FileLock

    device = torch.device(device or "cpu")
    path = Path(folder) / f"{cache_key(fingerprint, spec, seed, device.type)}.pt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(path) + ".lock")
        lock.acquire(timeout=LOCK_WAIT_S)
    except OSError as e:  # a folder it cannot write, or a holder that hangs (filelock.Timeout is an OSError)
        warnings.warn(f"{path}: no lock ({e.strerror or type(e).__name__}); the segmenter is used without the cache")
        lock = None
    try:
        for stale in path.parent.glob(f".{path.name}.*.tmp") if lock is not None else ():
            shutil.rmtree(stale, ignore_errors=True)
        if path.is_file():  # without the lock too: reading is safe, the file is replaced atomically
            try:
                saved = torch.load(path, map_location=device, weights_only=True)
                net = build_segmenter(spec).to(device)
                net.load_state_dict(saved["state_dict"])
                return net.eval(), None
            except Exception as e:  # a truncated or foreign file: train again and replace it
                warnings.warn(f"{path}: unreadable ({type(e).__name__}); training the segmenter again")
        net, seconds = train_segmenter(images, labels, spec, seed, device)
        if lock is None:  # writing unlocked could race a lock holder clearing temporary folders
            return net, seconds
        meta = {"data_fingerprint": fingerprint, "seed": seed, "spec": dataclasses.asdict(spec), "seconds": seconds}
        try:
            with atomic_path(path) as tmp:
                torch.save({"state_dict": {k: v.cpu() for k, v in net.state_dict().items()}, "meta": meta}, tmp)
        except OSError as e:  # the metrics do not need the cache
            warnings.warn(f"{path}: cannot write the segmenter ({e.strerror or type(e).__name__}); it is trained "
                          "again next time")
    finally:
        if lock is not None:
            lock.release()
    return net, seconds


# --- checks ---------------------------------------------------------------------------------------------
def check_classes(cache, train_rows, maps: list[tuple[str, np.ndarray]]) -> None:
    """One line when a scored label map holds a class that no training label map holds (the segmenter never
    saw it, so its Dice would say nothing) or an index outside the cache's classes."""
    labels_file = cache.root / "labels.npy"
    C = cache.num_classes
    seen = np.zeros(C + 256, bool)
    for r in train_rows:
        seen[np.unique(np.asarray(cache.labels[r]))] = True
    for name, label in maps:
        present = np.unique(np.asarray(label))
        outside = [int(c) for c in present if c >= C]
        if outside:
            raise DataError(f"{labels_file}: {name} holds class index {outside[0]}, but there are {C} classes "
                            f"({list(cache.label_values)}); rerun preprocess")
        unseen = [int(c) for c in present if not seen[c]]
        if unseen:
            c = unseen[0]
            raise DataError(f"{labels_file}: {name} holds label {cache.label_values[c]}, which no training subject "
                            "holds: the segmenter never saw it, so its Dice would mean nothing (put a subject with it "
                            "in the training split, or set evaluate.segmenter_steps: 0 to skip the Dice metrics)")


# --- the metrics ----------------------------------------------------------------------------------------
def _named(prefix: str, values: np.ndarray, keys: list[str], suffix: str = "") -> dict:
    """{prefix_<class>suffix: ..., prefix_meansuffix: mean over the tissues} (keys[0] is the background)."""
    out = {f"{prefix}_{k}{suffix}": float(v) for k, v in zip(keys[1:], values)}
    out[f"{prefix}_mean{suffix}"] = float(_nanmean(values))
    return out


def fidelity_metrics(nets: list, subjects: list[dict], table: np.ndarray, keys: list[str], seed: int,
                     num_classes: int) -> dict:
    """Label fidelity of the generated volumes (subjects' "samples") and its three references."""
    from voxdiff.evaluation.references import noise_image, tissue_mean_image

    gen = np.stack([x for e in subjects for x in e["samples"]])
    gen_labels = np.stack([e["label"] for e in subjects for _ in e["samples"]])
    labels = np.stack([e["label"] for e in subjects])
    shape = labels.shape[1:]
    refs = {"_ceiling": np.stack([e["real"] for e in subjects]),
            "_floor_noise": np.stack([noise_image(shape, seed + s) for s in range(len(subjects))]),  # evaluate's floor
            "_tissue_mean": np.stack([tissue_mean_image(table, e["label"]) for e in subjects])}
    m = _named("eval_dice_fidelity", scores(nets, gen, gen_labels, num_classes), keys)
    for suffix, volumes in refs.items():
        m.update(_named("eval_dice_fidelity", scores(nets, volumes, labels, num_classes), keys, suffix))
    return m


def synthesize(generate: Generator, labels: np.ndarray, per_map: int,
               device=None) -> tuple[np.ndarray, np.ndarray, float]:
    """per_map volumes of each label map (volume j = map j // per_map), GEN_BATCH per call of `generate`, on one
    CPU thread like the segmenters: the same volumes on any core count, and under a load of 8 on 2 cores 1.75 CPU s
    a volume at 10 DDIM steps against 4.9 on two threads: (volumes, their maps, seconds)."""
    maps = np.repeat(np.asarray(labels), per_map, axis=0)
    t0 = time.perf_counter()
    with _one_thread(device):
        out = [np.asarray(generate(maps[i:i + GEN_BATCH], i), np.float32) for i in range(0, len(maps), GEN_BATCH)]
    volumes = np.concatenate(out)
    if volumes.shape != maps.shape:
        raise VoxdiffError(f"the generator returned volumes of shape {volumes.shape[1:]} for {maps.shape[1:]} label maps")
    return volumes, maps, time.perf_counter() - t0


def tstr_metrics(sets: dict[str, tuple[np.ndarray, np.ndarray]], real_nets: list, val: tuple[np.ndarray, np.ndarray],
                 spec: SegmenterSpec, keys: list[str], device, trained_seconds: list[float]) -> dict:
    """Train on each set (the real arm's segmenters are `real_nets`), test on the real validation volumes."""
    per = {}  # arm -> [seeds, tissues]
    for arm in ARMS:
        rows = []
        for i in range(len(real_nets)):
            if arm == "real":
                net = real_nets[i]
            else:
                net, seconds = train_segmenter(*sets[arm], spec, i, device)
                trained_seconds.append(seconds)
            rows.append(scores([net], *val, spec.num_classes))
        per[arm] = np.stack(rows)
    m: dict = {}
    n = len(real_nets)
    for arm, a in per.items():
        seed_means = _nanmean(a, axis=1)
        m[f"eval_dice_tstr_{arm}"] = float(_nanmean(seed_means))
        m[f"eval_dice_tstr_{arm}_std"] = float(np.std(seed_means, ddof=1)) if n > 1 else None
        for c, k in enumerate(keys[1:]):
            m[f"eval_dice_tstr_{arm}_{k}"] = float(_nanmean(a[:, c]))
            m[f"eval_dice_tstr_{arm}_{k}_std"] = float(np.std(a[:, c], ddof=1)) if n > 1 else None
    syn, real = _nanmean(per["synthetic"], axis=1), _nanmean(per["real"], axis=1)
    m["eval_dice_tstr_ratio"] = float(_nanmean(syn) / _nanmean(real)) if _nanmean(real) > 0 else None
    m["eval_dice_tstr_ratio_std"] = float(np.std(syn / real, ddof=1)) if n > 1 and np.all(real > 0) else None
    return m


def dice_metrics(params, root, cache, subjects: list[dict], keys: list[str], device=None,
                 generate: Generator | None = None) -> dict:
    """The module docstring's metrics for the generated volumes of `subjects` (evaluate's entries: "label",
    "real", "samples") and, with evaluate.tstr_samples_per_map, for volumes `generate` makes from the training
    label maps. {} when evaluate.segmenter_steps is 0."""
    from voxdiff.evaluation.references import tissue_means

    ev = params.evaluate
    if ev.segmenter_steps == 0:
        return {}
    t0 = time.perf_counter()
    train_rows, val_rows = cache.split_indices("train"), cache.split_indices("val")
    manifest = cache.root / "manifest.json"
    if len(val_rows) == 0:
        raise VoxdiffError(f"{manifest}: no validation subjects to test the segmenters on")
    if len(train_rows) == 0:
        raise VoxdiffError(f"{manifest}: no training subjects to train the segmenters on")
    C = cache.num_classes
    check_classes(cache, train_rows, [(f"validation subject {cache.subjects[r]['id']}", cache.labels[r])
                                      for r in val_rows]
                  + [(f"evaluated subject {e.get('id', i)}", e["label"]) for i, e in enumerate(subjects)])
    spec = spec_of(params, C)
    images, labels = cache.stack(train_rows)
    images = images[:, 0]
    folder = project_root(root) / "models" / "segmenter"
    trained: list[float] = []
    real_nets = []
    for i in range(ev.segmenter_seeds):
        net, seconds = real_segmenter(folder, cache.fingerprint, images, labels, spec, i, device)
        real_nets.append(net)
        if seconds is not None:
            trained.append(seconds)
    say(f"segmenters on the real training volumes: {len(real_nets) - len(trained)} from {folder}, "
        f"{len(trained)} trained" + (f" ({np.mean(trained):.1f} s each)" if trained else ""))
    m = fidelity_metrics(real_nets, subjects, tissue_means(cache), keys, params.seed, C)
    if ev.tstr_samples_per_map:
        if generate is None:
            raise VoxdiffError("evaluate.tstr_samples_per_map > 0 needs a generator of synthetic volumes")
        syn, syn_labels, gen_s = synthesize(generate, labels, ev.tstr_samples_per_map, device)
        say(f"train on synthetic: {len(syn)} volumes for {len(labels)} training label maps in {gen_s:.0f} s")
        val = cache.stack(val_rows)
        sets = {"synthetic": (syn, syn_labels),
                "both": (np.concatenate([images, syn]), np.concatenate([labels, syn_labels]))}
        m.update(tstr_metrics(sets, real_nets, (val[0][:, 0], val[1]), spec, keys, device, trained))
        m.update(eval_dice_tstr_volumes=len(syn), eval_dice_tstr_generate_seconds=gen_s)
    m["eval_segmenter_seconds"] = float(np.mean(trained)) if trained else None
    m["eval_dice_seconds"] = time.perf_counter() - t0
    m = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in m.items()}
    for line in summary_lines(m):
        say(line)
    return m


def ddim_generator(net, diffusion, num_classes: int, steps: int, seed: int, autocast=None) -> Generator:
    """evaluate's DDIM sampler with the weights being evaluated, as a Generator: synthetic volume j starts
    from the noise of (seed, TSTR_STREAM, j), apart from the validation subjects' streams."""

    def generate(labels: np.ndarray, first: int) -> np.ndarray:
        import torch

        from voxdiff.diffusion import sampling

        out = sampling.generate(net, diffusion, torch.from_numpy(np.asarray(labels, np.int64)), num_classes, steps,
                                seed, "ddim", progress=False, subject=TSTR_STREAM, sample_index=first,
                                autocast=autocast)
        return out[:, 0].numpy()

    return generate


# --- reporting ------------------------------------------------------------------------------------------
def _f(v, digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _pm(m: dict, key: str) -> str:
    std = m.get(f"{key}_std")
    return _f(m.get(key)) + ("" if std is None else f" ± {std:.3f}")


def references(key: str, m: dict) -> str:
    """What `voxdiff metrics` prints after a Dice figure: its references (fidelity) or its spread and arms (TSTR)."""
    if key == "eval_dice_fidelity_mean":
        return (f"   (real volumes {_f(m.get(key + '_ceiling'))}, noise {_f(m.get(key + '_floor_noise'))}; "
                f"tissue-mean image {_f(m.get(key + '_tissue_mean'))}: trivially segmentable)")
    if key == "eval_dice_tstr_ratio":
        std = m.get("eval_dice_tstr_ratio_std")
        return ((f" ± {std:.3f}" if std is not None else "")
                + f"   (synthetic {_pm(m, 'eval_dice_tstr_synthetic')}, real {_pm(m, 'eval_dice_tstr_real')}, "
                  f"both {_pm(m, 'eval_dice_tstr_both')})")
    return ""


def summary_lines(m: dict) -> list[str]:
    """The Dice figures with their references, one line each (evaluate's log and `voxdiff metrics`)."""
    lines = []
    if m.get("eval_dice_fidelity_mean") is not None or m.get("eval_dice_fidelity_mean_ceiling") is not None:
        lines.append(f"label-fidelity Dice {_f(m.get('eval_dice_fidelity_mean'))} (real volumes "
                     f"{_f(m.get('eval_dice_fidelity_mean_ceiling'))}, noise {_f(m.get('eval_dice_fidelity_mean_floor_noise'))}; "
                     f"tissue-mean image, trivially segmentable: {_f(m.get('eval_dice_fidelity_mean_tissue_mean'))})")
    if "eval_dice_tstr_ratio" in m:
        lines.append(f"train-on-synthetic Dice / train-on-real {_pm(m, 'eval_dice_tstr_ratio')} (synthetic "
                     f"{_pm(m, 'eval_dice_tstr_synthetic')}, real {_pm(m, 'eval_dice_tstr_real')}, "
                     f"both {_pm(m, 'eval_dice_tstr_both')})")
    return lines
