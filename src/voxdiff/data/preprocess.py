"""Stage `preprocess`: NIfTI pairs -> the training cache (see cache.py for the format).

Per subject: checks, reorientation to RAS, one resampling onto a RAS grid of preprocess.shape voxels at
preprocess.spacing mm centred on the foreground (image linear with anti-aliasing, labels nearest
neighbour, so no new or fractional labels), per-volume intensity scaling to [-1, 1] and label values to
class indices. The processed affine is kept per subject, so a volume can be mapped back onto the
original grid (to_original_grid).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import nibabel as nib
import numpy as np
from scipy import ndimage
from tqdm import tqdm

from voxdiff.data import cache

from voxdiff.data import nifti

from voxdiff.data import sources
from voxdiff.data.parallel import ordered_map
from voxdiff.runtime.errors import DataError, ParamsError
from voxdiff.runtime.fsutil import atomic_path, sha256_file, write_json

PREVIEW_SUBJECTS = 4


# --- one subject --------------------------------------------------------------------------------------
def class_indices(label: np.ndarray, label_values) -> np.ndarray:
    """Label values -> position in data.label_values (values were checked on load)."""
    values = np.asarray(label_values)
    order = np.argsort(values)
    return order[np.searchsorted(values[order], label)].astype(np.uint8)


def bounding_box(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, last) voxel index of the mask per axis, from its projections (a 256^3 head: 0.01 s, against
    1.2 s for np.nonzero)."""
    ends = []
    for axis in range(mask.ndim):
        hit = np.flatnonzero(mask.any(axis=tuple(a for a in range(mask.ndim) if a != axis)))
        ends.append((hit[0], hit[-1]))
    return np.array([e[0] for e in ends], float), np.array([e[1] for e in ends], float)


def target_grid(mask: np.ndarray, affine: np.ndarray, spacing, shape) -> np.ndarray:
    """RAS affine of a ``shape`` grid at ``spacing`` mm centred on the mask's bounding box.

    The origin is snapped to the source voxel lattice: with an integer spacing ratio every target voxel
    then sits on a source voxel centre (no blur, unambiguous nearest neighbour).
    """
    lo, hi = bounding_box(mask)
    centre_vox = (lo + hi) / 2
    centre = affine[:3, :3] @ centre_vox + affine[:3, 3]
    spacing, shape = np.asarray(spacing, float), np.asarray(shape)
    origin = centre - spacing * (shape - 1) / 2
    origin_vox = np.round(np.linalg.solve(affine[:3, :3], origin - affine[:3, 3]))
    out = np.diag([*spacing, 1.0])
    out[:3, 3] = affine[:3, :3] @ origin_vox + affine[:3, 3]
    return out


def resample(volume: np.ndarray, src_affine: np.ndarray, dst_affine: np.ndarray, shape, order: int,
             cval: float = 0.0) -> np.ndarray:
    """Sample ``volume`` (on src_affine's grid) at the voxels of a ``shape`` grid on dst_affine."""
    m = np.linalg.solve(src_affine, dst_affine)  # destination voxel -> source voxel
    return ndimage.affine_transform(volume, m[:3, :3], m[:3, 3], output_shape=tuple(shape), order=order,
                                    cval=cval, mode="constant", prefilter=order > 1)


def antialias(image: np.ndarray, zooms, spacing) -> np.ndarray:
    """Gaussian low-pass before downsampling (sigma in voxels = (ratio - 1) / 2), else aliasing noise."""
    sigma = [max(0.0, (s / z - 1.0) / 2.0) for s, z in zip(spacing, zooms)]
    return ndimage.gaussian_filter(image, sigma) if max(sigma) > 0 else image


def otsu_threshold(image: np.ndarray, bins: int = 256) -> float:
    """Otsu's threshold (maximum between-class variance) of the image's intensity histogram.

    The foreground is the labelled region plus voxels above this threshold. `> 0` (the old rule) takes
    the whole field of view for MRI that is not skull-stripped, whose air background is Rician noise
    above 0. Written here (12 lines) rather than adding scikit-image for threshold_otsu alone.
    """
    values = image[np.isfinite(image)].astype(np.float64)
    if values.size == 0 or values.min() == values.max():
        return float(values.min()) if values.size else 0.0
    counts, edges = np.histogram(values, bins=bins)
    centres = (edges[:-1] + edges[1:]) / 2
    w0 = np.cumsum(counts)[:-1]
    w1 = values.size - w0
    m0 = np.cumsum(counts * centres)[:-1] / np.maximum(w0, 1)
    m1 = (np.sum(counts * centres) - np.cumsum(counts * centres)[:-1]) / np.maximum(w1, 1)
    between = w0 * w1 * (m0 - m1) ** 2
    return float(edges[1:-1][np.argmax(between)])


def normalise(image: np.ndarray, mask: np.ndarray, percentiles, path) -> tuple[np.ndarray, list[float]]:
    """Clip at the foreground percentiles, scale to [-1, 1]; background -1. Per volume, not per slice."""
    lo, hi = np.percentile(image[mask], percentiles)
    if not hi > lo:
        raise DataError(f"{path}: the intensity is constant ({lo:g}) inside the foreground; nothing to learn")
    out = 2.0 * (np.clip(image, lo, hi) - lo) / (hi - lo) - 1.0
    return np.where(mask, out, -1.0).astype(np.float32), [float(lo), float(hi)]


def provenance_of(img: nib.Nifti1Image) -> dict:
    return {"original_shape": [int(n) for n in img.shape[:3]],
            "original_spacing": [round(float(z), 6) for z in img.header.get_zooms()[:3]],
            "original_orientation": nifti.axcodes(img.affine)}


SMALL_FOREGROUND = 0.5  # Placement.small_warning: labels spanning under half the grid on every axis
CROP_WARN_FRACTION = 1e-3  # Placement.crop_warning: cropping 0.1 % of the foreground voxels or more
# (the built-in subjects lose 0.01-0.02 %: one 2 mm row of a 194 mm head in a 192 mm grid; no warning)


def _mm(values) -> str:
    return " x ".join(f"{v:.0f}" for v in values)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a volume's preprocess.shape grid goes (place_grid) and how its foreground fits in it."""

    affine: np.ndarray        # RAS affine of the grid
    extent_mm: np.ndarray     # the foreground's bounding box
    fov_mm: np.ndarray        # preprocess.shape x spacing
    cropped_fraction: float   # foreground voxels outside the grid's field of view: cut

    def crop_warning(self, what: str = "foreground voxels") -> str | None:
        if self.cropped_fraction < CROP_WARN_FRACTION:
            return None
        return (f"{100 * self.cropped_fraction:.1f}% of the {what} lie outside preprocess.shape x spacing "
                f"({_mm(self.fov_mm)} mm; they span {_mm(self.extent_mm)} mm) and are cropped")

    def small_warning(self) -> str | None:
        """For a label map alone (voxdiff sample): training centred its grids on labels and image foreground
        together, so labels far smaller than the grid (tumour labels only) are placed unlike training."""
        if np.any(self.extent_mm >= SMALL_FOREGROUND * self.fov_mm):
            return None
        return (f"the labelled region ({_mm(self.extent_mm)} mm) spans under {SMALL_FOREGROUND:.0%} of the "
                f"checkpoint's field of view ({_mm(self.fov_mm)} mm) on every axis: the grid is centred on the "
                "labels, but training centred it on labels and image foreground together, so a label map that "
                "does not cover the head is placed unlike training and the unlabelled rest can come out wrong")


def place_grid(mask: np.ndarray, affine: np.ndarray, spacing, shape) -> Placement:
    """The one grid rule of training data (preprocess_pair: mask = labels or image foreground) and of a
    label map alone (preprocess_label, for voxdiff sample: mask = the labels, all there is): target_grid
    centred on the mask's bounding box, and the share of the mask outside the grid's field of view."""
    lo, hi = bounding_box(mask)
    zooms = np.sqrt((affine[:3, :3] ** 2).sum(axis=0))
    grid = target_grid(mask, affine, spacing, shape)
    # Held: the nearest grid voxel is in the grid, i.e. within half a grid voxel of its outermost centres
    # (order 0 with "grid-constant" rounds to the nearest voxel before the bounds check; "constant" has
    # no half-voxel margin).
    m = np.linalg.solve(grid, affine)  # source voxel -> grid voxel
    held = ndimage.affine_transform(np.ones(tuple(shape), np.uint8), m[:3, :3], m[:3, 3], output_shape=mask.shape,
                                    order=0, mode="grid-constant", cval=0) > 0
    cropped = np.count_nonzero(mask & ~held) / np.count_nonzero(mask)
    return Placement(grid, (hi - lo + 1) * zooms, np.asarray(spacing, float) * np.asarray(shape), float(cropped))


def preprocess_label(label_path, params) -> tuple[np.ndarray, Placement, dict]:
    """A label map alone (for sampling from a user's label map): (class indices, placement, provenance).

    Same grid rule as training data (place_grid), with the labelled region (class > 0) as the foreground:
    without the image, the labels are all there is to place the grid on (see Placement.small_warning).
    """
    original = nifti.load_volume(label_path, "label", params.data.label_values)
    label = nib.as_closest_canonical(original)
    classes = class_indices(np.asarray(label.dataobj), params.data.label_values)
    if not classes.any():
        raise DataError(f"{label_path}: the label map holds only background ({params.data.label_values[0]})")
    p = params.preprocess
    placement = place_grid(classes > 0, label.affine, p.spacing, p.shape)
    out = resample(classes, label.affine, placement.affine, p.shape, order=0)
    return out, placement, provenance_of(original)


def preprocess_job(job: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """preprocess_pair on (image path, label path, params): one argument, for parallel.ordered_map."""
    return preprocess_pair(*job)


def preprocess_pair(image_path, label_path, params) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
    """(image float32 in [-1, 1], class indices uint8, RAS affine 4x4, provenance) on preprocess's grid.

    provenance: original_shape/spacing/orientation, intensity_clip (original units), cropped_fraction (of
    the foreground voxels, outside the grid) and warning (text or None: Placement.crop_warning).
    """
    original, label = nifti.load_pair(image_path, label_path, params.data.label_values)
    provenance = provenance_of(original)
    image = nib.as_closest_canonical(original)  # RAS voxel axes: spacing and sigma line up per axis
    label = nib.as_closest_canonical(label)
    pixels = np.asarray(image.dataobj)
    classes = class_indices(np.asarray(label.dataobj), params.data.label_values)
    mask = (classes > 0) | (pixels > otsu_threshold(pixels))
    if not mask.any():
        raise DataError(f"{image_path} and {label_path}: no foreground (label > background or image above "
                        "its Otsu threshold)")
    p = params.preprocess
    placement = place_grid(mask, image.affine, p.spacing, p.shape)
    affine = placement.affine
    smooth = antialias(pixels, image.header.get_zooms()[:3], p.spacing)
    out_image = resample(smooth, image.affine, affine, p.shape, order=1)
    out_classes = resample(classes, image.affine, affine, p.shape, order=0)
    out_mask = resample(mask.astype(np.uint8), image.affine, affine, p.shape, order=0) > 0
    if not out_mask.any():
        raise DataError(f"{image_path}: no foreground left after resampling to preprocess.spacing")
    out_image, clip = normalise(out_image, out_mask, p.clip_percentiles, image_path)
    provenance["intensity_clip"] = clip
    provenance["cropped_fraction"] = round(placement.cropped_fraction, 6)
    provenance["warning"] = placement.crop_warning()
    return out_image, out_classes, affine, provenance


def to_original_grid(volume: np.ndarray, processed_affine: np.ndarray, original_img: nib.Nifti1Image,
                     order: int, cval: float = 0.0) -> np.ndarray:
    """Map a processed volume back onto ``original_img``'s voxel grid (order 0 for labels, 1 for images).

    Voxels outside the processed grid get ``cval`` (0 = class 0; pass -1 for normalised images).
    """
    return resample(np.asarray(volume), np.asarray(processed_affine, float), original_img.affine,
                    original_img.shape[:3], order=order, cval=cval)


# --- the stage ----------------------------------------------------------------------------------------
def read_index(params, root: Path) -> list[dict]:
    path = sources.raw_dir(root) / "index.json"
    if not path.is_file():
        raise DataError(f"{path}: not found (run `dvc repro prepare` first)")
    index = json.loads(path.read_text())
    if index.get("source") != params.data.source:
        raise DataError(f"{path}: made for data.source {index.get('source')!r}, but params.yaml says "
                        f"{params.data.source!r}; rerun prepare")
    for s in index["subjects"]:
        for kind in ("image", "label"):
            if sha256_file(root / s[kind]) != s[f"{kind}_sha256"]:
                raise DataError(f"{root / s[kind]}: changed since prepare indexed it; rerun prepare")
    return index["subjects"]


def fingerprint(images: np.ndarray, labels: np.ndarray, records: list[dict]) -> str:
    """The cache's identity (voxdiff.data_fingerprint, the MLflow dataset digest): the volumes and which
    subject each row is and in which split, so that data.seed or data.val_subjects, which change the
    train/val split but not one voxel, change it too."""
    h = hashlib.sha256()
    for array in (images, labels):
        for row in array:  # row by row: the same bytes as the whole array, without a copy of it
            h.update(np.ascontiguousarray(row).tobytes())
    h.update(json.dumps([[r["id"], r["split"]] for r in records]).encode())
    return h.hexdigest()[:16]


def run_preprocess(params, root: str | Path) -> dict:
    """Write <root>/data/processed (replacing it whole); returns its manifest."""
    root = Path(root)
    if params.data.num_classes > 256:
        raise ParamsError(f"params.yaml: data.label_values has {params.data.num_classes} values; "
                          "at most 256 fit the uint8 label cache")
    subjects = read_index(params, root)
    split = sources.split_subjects([s["id"] for s in subjects], params.data.val_subjects, params.data.seed)
    shape = (len(subjects), *params.preprocess.shape)
    with atomic_path(root / "data" / "processed") as tmp:
        tmp.mkdir()
        images = np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.float32, shape=shape)
        labels = np.lib.format.open_memmap(tmp / "labels.npy", mode="w+", dtype=np.uint8, shape=shape)
        records = []
        jobs = [(root / s["image"], root / s["label"], params) for s in subjects]
        for i, (s, done) in enumerate(zip(subjects, ordered_map(preprocess_job, jobs, "preprocess"))):
            images[i], labels[i], affine, prov = done
            warning = prov.pop("warning")
            if warning:
                tqdm.write(f"warning: {root / s['image']}: {warning}")
            records.append({"id": s["id"], "index": i, "split": split[s["id"]], "image": s["image"],
                            "label": s["label"], "image_sha256": s["image_sha256"],
                            "label_sha256": s["label_sha256"], **prov, "affine": affine.tolist()})
        images.flush()
        labels.flush()
        manifest = {"version": cache.FORMAT_VERSION, "source": params.data.source,
                    "shape": list(params.preprocess.shape), "spacing": list(params.preprocess.spacing),
                    "label_values": list(params.data.label_values), "fingerprint": fingerprint(images, labels, records),
                    "subjects": records}
        write_json(tmp / "manifest.json", manifest)
        write_preview(tmp / "preview.png", images, labels, records, class_names(params))
        del images, labels  # close the memmaps before the directory is renamed
    return manifest


# --- preview ----------------------------------------------------------------------------------------
def class_names(params) -> list[str]:
    if params.data.builtin:
        return ["background", "CSF", "GM", "WM"]
    return [f"label {v}" for v in params.data.label_values]


def mid_slices(volume: np.ndarray) -> list[np.ndarray]:
    """Axial, coronal, sagittal mid-slices of a RAS volume, transposed for imshow(origin="lower")."""
    x, y, z = (n // 2 for n in volume.shape)
    return [volume[:, :, z].T, volume[:, y, :].T, volume[x, :, :].T]


def write_preview(path: Path, images: np.ndarray, labels: np.ndarray, records: list[dict],
                  class_names: list[str]) -> None:
    """Mid-slices of the first few subjects: image in grey, classes > 0 as a translucent overlay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    rows = min(PREVIEW_SUBJECTS, len(records))
    palette = [plt.get_cmap("tab10").colors[k % 10] for k in range(len(class_names))]
    colours = ListedColormap(palette[1:] or palette)  # class k keeps colour k in every row
    fig, axes = plt.subplots(rows, 3, figsize=(9, 3 * rows + 0.4), squeeze=False)
    for r in range(rows):
        views = zip(mid_slices(np.asarray(images[r])), mid_slices(np.asarray(labels[r])),
                    ("axial", "coronal", "sagittal"))
        for c, (img, lab, view) in enumerate(views):
            ax = axes[r][c]
            ax.imshow(img, cmap="gray", vmin=-1, vmax=1, origin="lower")
            ax.imshow(np.ma.masked_equal(lab, 0), cmap=colours, vmin=0.5, vmax=max(len(class_names), 2) - 0.5,
                      alpha=0.3, origin="lower", interpolation="nearest")
            ax.set_title(f"{records[r]['id']} ({records[r]['split']}) {view}", fontsize=8)
            ax.axis("off")
    handles = [Patch(color=palette[k], alpha=0.5, label=class_names[k]) for k in range(1, len(class_names))]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 8), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.4 / (3 * rows + 0.4), 1, 1))
    fig.savefig(path, dpi=80)
    plt.close(fig)
