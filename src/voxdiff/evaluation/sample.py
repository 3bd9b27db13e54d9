"""`voxdiff sample`: generate an MRI volume for your own label map with a trained checkpoint.

The label map goes through training's preprocessing (reorientation to RAS, nearest-neighbour
resampling to the checkpoint's preprocess.spacing, crop/pad to preprocess.shape by training's grid rule,
place_grid, centred on the labelled region: training centred on labels and image foreground together,
and a label map alone has only its labels, so labels much smaller than the grid get a warning; label
values -> class indices with the checkpoint's label_values); the network runs at the training's
precision, as in `evaluate`; the generated volume is mapped back onto the label map's own grid (its
affine and shape) and written as NIfTI.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click

DEFAULT_STEPS = 50


def _nifti_suffix(path: Path) -> bool:
    return path.name.endswith((".nii", ".nii.gz"))


def _settings(params_path: Path | None):
    """(default steps, default seed, device request, precision request, train.tf32, train.deterministic) from
    params.yaml (the checkpoint does not hold the train section): the given file,
    else the project's params.yaml when there is one, else built-in defaults. The network, diffusion
    schedule, preprocessing and label values always come from the checkpoint, and so does the precision
    when it says which one training resolved."""
    from voxdiff.runtime.fsutil import repo_root
    from voxdiff.params import load

    if params_path is None:
        candidate = repo_root() / "params.yaml"
        if not candidate.is_file():
            return DEFAULT_STEPS, 0, "auto", "auto", True, False
        params_path = candidate
    p = load(params_path)
    return p.evaluate.sampling_steps, p.seed, p.train.device, p.train.precision, p.train.tf32, p.train.deterministic


def sample_label_map(checkpoint_path, label_path, out_path, steps: int | None = None, seed: int | None = None,
                     sampler: str = "ddim", params_path=None, progress: bool = True) -> dict:
    """Generate for one label map and write `out_path`; returns a summary (seconds, shapes, steps, warnings).

    Every input (output name, checkpoint, label map, network) is checked before anything is written."""
    import numpy as np
    import torch

    from voxdiff.diffusion import sampling
    from voxdiff.runtime.fsutil import check_writable

    checkpoint_path, label_path, out_path = Path(checkpoint_path), Path(label_path), Path(out_path)
    _check_request(out_path, sampler, steps)
    default_steps, default_seed, device_request, precision_request, tf32, deterministic = _settings(
        Path(params_path) if params_path else None)
    steps = default_steps if steps is None else steps
    seed = default_seed if seed is None else seed
    m = _load_for_label_map(checkpoint_path, label_path, device_request, precision_request, tf32, deterministic)
    check_writable(out_path)  # the inputs are good: now the output, still before the sampling (minutes)

    record: list[dict] = []
    labels = torch.from_numpy(np.asarray(m.classes, np.int64))[None]
    generated = sampling.generate(m.net, m.diffusion, labels, m.num_classes, steps, seed, sampler,
                                  progress=progress, record=record, autocast=m.runtime.autocast)[0, 0].numpy()
    volume = _write_on_label_grid(generated, m.placement, label_path, out_path)
    # The same crop measure as training's (place_grid), and the one thing a label map alone cannot match.
    crop = m.placement.crop_warning("labelled voxels")
    warnings = [w for w in (crop and f"{crop}; they are -1 in the output", m.placement.small_warning()) if w]
    return {"out": str(out_path), "shape": list(volume.shape), "orientation": m.provenance["original_orientation"],
            "sampler": sampler, "steps": record[0]["steps"], "seed": seed, "seconds": record[0]["seconds"],
            "peak_memory_mb": record[0]["peak_memory_mb"], "device": str(m.device), "precision": m.runtime.precision,
            "cropped_fraction": m.placement.cropped_fraction, "warnings": warnings}


def _check_request(out_path: Path, sampler: str, steps: int | None) -> None:
    from voxdiff.runtime.errors import VoxdiffError

    if not _nifti_suffix(out_path):
        raise VoxdiffError(f"{out_path}: the output must be a NIfTI file name ending in .nii or .nii.gz")
    if out_path.is_dir():
        raise VoxdiffError(f"{out_path}: is a directory; give a file name ending in .nii.gz")
    if sampler == "ancestral" and steps is not None:
        raise VoxdiffError("--steps is for --sampler ddim; the ancestral sampler always runs all "
                           "diffusion.timesteps steps of the checkpoint")


def _load_for_label_map(checkpoint_path: Path, label_path: Path, device_request: str, precision_request: str,
                        tf32: bool, deterministic: bool) -> SimpleNamespace:
    """The checkpoint's EMA network on its device and precision, and the label map preprocessed by the
    checkpoint's own preprocess section and label values (not params.yaml's)."""
    from voxdiff.data.preprocess import preprocess_label
    from voxdiff.diffusion import sampling
    from voxdiff.runtime import distributed
    from voxdiff.runtime.errors import VoxdiffError
    from voxdiff.training import checkpoint

    state = checkpoint.load(checkpoint_path)
    label_values = sampling.checkpoint_label_values(state, checkpoint_path)
    prep = sampling.checkpoint_preprocess(state, checkpoint_path)
    if list(state.get("shape", [])) != list(prep.shape):
        raise VoxdiffError(f"{checkpoint_path}: its grid {state.get('shape')} disagrees with its preprocess.shape "
                           f"{list(prep.shape)}; not a usable voxdiff checkpoint")
    view = SimpleNamespace(data=SimpleNamespace(label_values=label_values), preprocess=prep)
    classes, placement, provenance = preprocess_label(label_path, view)
    device = distributed.pick_device(device_request)
    distributed.configure_backends(device, tf32, deterministic)  # CUDA only: TF32 and cuDNN as evaluate sets them
    runtime = sampling.checkpoint_runtime(state, device, precision_request, checkpoint_path)  # evaluate's precision
    net, _, diffusion = sampling.load_ema_network(state, device, source=checkpoint_path, num_classes=len(label_values))
    return SimpleNamespace(net=net, diffusion=diffusion, runtime=runtime, device=device, classes=classes,
                           num_classes=len(label_values), placement=placement, provenance=provenance)


def _write_on_label_grid(generated, placement, label_path: Path, out_path: Path):
    """The generated volume mapped back onto the label map's own grid (affine and shape), written atomically."""
    import nibabel as nib
    import numpy as np

    from voxdiff.data import nifti
    from voxdiff.data.preprocess import to_original_grid
    from voxdiff.runtime.errors import VoxdiffError
    from voxdiff.runtime.fsutil import atomic_path

    original = nifti.open_header(label_path)  # the grid to return to (checked already, header only)
    volume = to_original_grid(generated, placement.affine, original, order=1, cval=-1.0).astype(np.float32)
    img = nib.Nifti1Image(volume, original.affine)
    img.header.set_xyzt_units("mm", "sec")
    try:
        with atomic_path(out_path) as tmp:
            nib.save(img, tmp)
    except OSError as e:
        raise VoxdiffError(f"{out_path}: cannot write ({e.strerror or type(e).__name__})") from None
    return volume


@click.command("sample")
@click.option("--checkpoint", "checkpoint_path", type=click.Path(path_type=Path),
              default=Path("models/checkpoint.pt"), show_default=True, help="Trained checkpoint (its EMA weights are used).")
@click.option("--label", "label_path", type=click.Path(path_type=Path), required=True,
              help="Label map (NIfTI, 3D) with the label values the checkpoint was trained on.")
@click.option("--out", "out_path", type=click.Path(path_type=Path), required=True,
              help="Output NIfTI (.nii.gz): the generated volume on the label map's grid, intensities in [-1, 1].")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="DDIM steps (default: evaluate.sampling_steps of params.yaml, else 50).")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed (default: params.yaml's seed, else 0).")
@click.option("--sampler", type=click.Choice(["ddim", "ancestral"]), default="ddim", show_default=True,
              help="ddim (fast) or the full ancestral DDPM chain (diffusion.timesteps steps); both are seeded.")
@click.option("--params", "params_path", type=click.Path(path_type=Path), default=None,
              help="params.yaml for the defaults above, train.device and train.precision (used when the checkpoint "
                   "does not record the precision training resolved; default: the project's params.yaml, if any).")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: only on a terminal).")
def sample_command(checkpoint_path, label_path, out_path, steps, seed, sampler, params_path, progress):
    """Generate an MRI volume for LABEL with a trained checkpoint and write it to OUT on the label
    map's own grid. The model, noise schedule, preprocessing and label values come from the checkpoint,
    and so does the precision (as in evaluate) when the checkpoint records it."""
    t0 = time.perf_counter()
    interactive = sys.stderr.isatty() if progress is None else progress
    s = sample_label_map(checkpoint_path, label_path, out_path, steps, seed, sampler, params_path, interactive)
    for warning in s["warnings"]:
        click.echo(f"warning: {label_path}: {warning}", err=True)
    click.echo(f"[voxdiff sample] wrote {s['out']} ({'x'.join(map(str, s['shape']))}, {s['orientation']} grid of "
               f"{label_path}); {s['sampler']} {s['steps']} steps, seed {s['seed']}, {s['precision']}, "
               f"{s['seconds']:.1f} s sampling on {s['device']}, {time.perf_counter() - t0:.1f} s in all", err=True)
