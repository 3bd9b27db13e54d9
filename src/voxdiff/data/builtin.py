"""Built-in data: pseudo-subjects synthesised from the MNI152 2009a template shipped with nilearn.

Each subject is the template warped by a seeded smooth elastic deformation and a small affine, with a
smooth bias field and noise. Labels (0 background, 1 CSF, 2 GM, 3 WM) come from the warped tissue
probability maps, so image and label always agree. Odd subjects are stored in LPS orientation, as
much real data is, so that preprocessing's reorientation is exercised.
"""

from __future__ import annotations

import functools
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage
from voxdiff.data import sources
from voxdiff.data.parallel import ordered_map
from voxdiff.runtime.fsutil import atomic_path, write_json

LABEL_VALUES = (0, 1, 2, 3)  # background, CSF, GM, WM
BRAIN_THRESHOLD = 0.2  # T1/255 above this is brain (anchors.md)

# Random variation per subject (a few mm and degrees: different people, same anatomy).
ELASTIC_MM = 2.5  # std of the smooth displacement, per axis
ELASTIC_SMOOTH_MM = 20.0  # correlation length of the displacement
ROTATION_DEG = 6.0
SCALE = 0.05
TRANSLATION_MM = 4.0
BIAS = 0.10  # multiplicative intensity bias field amplitude
NOISE = 0.02  # Gaussian noise std, relative to the white-matter intensity
GAIN = (600.0, 1000.0)  # global intensity scale: the scanner units differ between subjects


@functools.lru_cache(maxsize=1)  # ~100 MB; kept for repeated calls in one process (tests)
def template(spacing: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(t1, gm, wm, affine) of the 1 mm template in [0, 1], anti-aliased for sampling at ``spacing`` mm."""
    from nilearn.datasets import struct

    maps, affine = [], None
    for path in (struct.MNI152_FILE_PATH, struct.GM_MNI152_FILE_PATH, struct.WM_MNI152_FILE_PATH):
        img = nib.load(path)
        affine = img.affine
        volume = np.asarray(img.dataobj, dtype=np.float32) / 255.0
        sigma = max(0.0, (spacing / 1.0 - 1.0) / 2.0)  # skimage's rule for downsampling by spacing/1 mm
        maps.append(ndimage.gaussian_filter(volume, sigma) if sigma > 0 else volume)
    return maps[0], maps[1], maps[2], affine


def output_grid(template_shape: tuple[int, ...], template_affine: np.ndarray,
                spacing: float) -> tuple[tuple[int, int, int], np.ndarray]:
    """The template's field of view at ``spacing`` mm, RAS."""
    extent = np.asarray(template_shape[:3]) * np.abs(np.diag(template_affine)[:3])
    shape = tuple(int(np.ceil(e / spacing)) for e in extent)
    affine = np.diag([spacing, spacing, spacing, 1.0])
    affine[:3, 3] = template_affine[:3, 3]
    return shape, affine


def smooth_field(rng: np.random.Generator, shape: tuple[int, ...], spacing: float, corr_mm: float,
                 channels: int) -> np.ndarray:
    """Random smooth fields with unit std: noise on a grid 4x coarser, Gaussian-smoothed, upsampled
    linearly (cheap, and smooth enough at this scale)."""
    coarse = tuple(int(np.ceil(n / 4)) + 1 for n in shape)
    noise = rng.standard_normal((channels, *coarse))
    sigma = corr_mm / (4 * spacing)
    fields = []
    for c in range(channels):
        f = ndimage.gaussian_filter(noise[c], sigma, mode="wrap")
        f = (f - f.mean()) / (f.std() + 1e-12)
        zoom = [(n - 1) / (m - 1) for n, m in zip(shape, coarse)]
        f = ndimage.zoom(f, zoom, order=1, grid_mode=False)[tuple(slice(0, n) for n in shape)]
        fields.append(f.astype(np.float32))
    return np.stack(fields)


def random_affine(rng: np.random.Generator, centre: np.ndarray) -> np.ndarray:
    """4x4 world->world: rotation, per-axis scale and translation about ``centre``."""
    ax, ay, az = np.deg2rad(rng.uniform(-ROTATION_DEG, ROTATION_DEG, 3))
    rx = np.array([[1, 0, 0], [0, np.cos(ax), -np.sin(ax)], [0, np.sin(ax), np.cos(ax)]])
    ry = np.array([[np.cos(ay), 0, np.sin(ay)], [0, 1, 0], [-np.sin(ay), 0, np.cos(ay)]])
    rz = np.array([[np.cos(az), -np.sin(az), 0], [np.sin(az), np.cos(az), 0], [0, 0, 1]])
    linear = rz @ ry @ rx @ np.diag(1 + rng.uniform(-SCALE, SCALE, 3))
    out = np.eye(4)
    out[:3, :3] = linear
    out[:3, 3] = centre - linear @ centre + rng.uniform(-TRANSLATION_MM, TRANSLATION_MM, 3)
    return out


def warp_coordinates(rng: np.random.Generator, shape: tuple[int, int, int], out_affine: np.ndarray,
                     tpl_affine: np.ndarray, centre: np.ndarray, spacing: float) -> np.ndarray:
    """Template voxel coordinates [3, *shape] to sample for each output voxel."""
    to_template = np.linalg.inv(tpl_affine) @ random_affine(rng, centre) @ out_affine
    grid = np.indices(shape, dtype=np.float32).reshape(3, -1)
    coords = to_template[:3, :3].astype(np.float32) @ grid + to_template[:3, 3:].astype(np.float32)
    displacement_mm = ELASTIC_MM * smooth_field(rng, shape, spacing, ELASTIC_SMOOTH_MM, 3).reshape(3, -1)
    coords += np.linalg.inv(tpl_affine[:3, :3]).astype(np.float32) @ displacement_mm
    return coords.reshape(3, *shape)


def tissue_labels(t1: np.ndarray, gm: np.ndarray, wm: np.ndarray) -> np.ndarray:
    """0 outside the brain, else 1 + argmax(CSF, GM, WM) with CSF = 1 - GM - WM (anchors.md)."""
    brain = t1 > BRAIN_THRESHOLD
    csf = np.clip(1.0 - gm - wm, 0.0, 1.0)
    label = 1 + np.argmax(np.stack([csf, gm, wm]), axis=0)
    return np.where(brain, label, 0).astype(np.uint8)


def synth_subject(index: int, seed: int, spacing: float,
                  appearance: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(image float32, label uint8, affine) of pseudo-subject ``index``, RAS.

    ``appearance`` 0 is the stored subject; k > 0 keeps its deformation (so its label map) and draws the
    bias field, gain and noise from stream k: the same label map, another image (evaluate's diversity
    reference).
    """
    rng = np.random.default_rng([seed, index])
    t1, gm, wm, tpl_affine = template(spacing)
    shape, affine = output_grid(t1.shape, tpl_affine, spacing)
    centre = tpl_affine[:3, :3] @ (np.asarray(t1.shape) - 1) / 2 + tpl_affine[:3, 3]
    coords = warp_coordinates(rng, shape, affine, tpl_affine, centre, spacing)
    t1_w, gm_w, wm_w = (ndimage.map_coordinates(m, coords, order=1, cval=0.0, prefilter=False)
                        for m in (t1, gm, wm))
    label = tissue_labels(t1_w, gm_w, wm_w)
    if appearance:
        rng = np.random.default_rng([seed, index, appearance])
    bias = 1.0 + BIAS * np.tanh(smooth_field(rng, shape, spacing, 60.0, 1)[0] / 2)
    gain = rng.uniform(*GAIN)
    image = gain * (t1_w * bias + NOISE * rng.standard_normal(shape, dtype=np.float32))
    image = np.where(label > 0, image, 0.0).astype(np.float32)  # background stays exactly 0
    return image, label, affine


def to_lps(data: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flip the first two axes of a RAS volume; the affine changes so world coordinates do not."""
    flip = np.diag([-1.0, -1.0, 1.0, 1.0])
    flip[:2, 3] = np.asarray(data.shape[:2]) - 1  # new index i maps to old index n-1-i
    return np.ascontiguousarray(data[::-1, ::-1, :]), affine @ flip


def save_nifti(path: Path, data: np.ndarray, affine: np.ndarray) -> None:
    """nibabel's gzip writer is deterministic (mtime 0, no file name): same data -> same bytes."""
    img = nib.Nifti1Image(data, affine)
    img.set_qform(affine, code=1)
    img.set_sform(affine, code=1)
    img.header.set_xyzt_units("mm")
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(img, path)


def write_subject(job: tuple[int, int, float, Path]) -> None:
    """Synthesise pseudo-subject `index` and write its image and label (odd ones in LPS) into `folder`."""
    index, seed, spacing, folder = job
    image, label, affine = synth_subject(index, seed, spacing)
    if index % 2:
        image, _ = to_lps(image, affine)
        label, affine = to_lps(label, affine)
    save_nifti(folder / "images" / f"sub-{index:03d}.nii.gz", image, affine)
    save_nifti(folder / "labels" / f"sub-{index:03d}.nii.gz", label, affine)


def synthesize(params, raw: Path, root: Path) -> list[dict]:
    """Write data.subjects pseudo-subjects and index.json into ``raw`` atomically; returns the index."""
    d = params.data
    with atomic_path(raw) as tmp:
        tmp.mkdir()
        jobs = [(i, d.seed, d.synth_spacing, tmp) for i in range(d.subjects)]
        for _ in ordered_map(write_subject, jobs, "prepare: synthesising MNI152 subjects"):
            pass
        pairs = sources.pair_by_glob(tmp, sources.BUILTIN_IMAGE_GLOB, sources.BUILTIN_LABEL_GLOB)
        subjects = sources.describe(pairs, root, moved=(tmp, raw))
        write_json(tmp / "index.json", {"source": d.source, "subjects": subjects})
    return subjects
