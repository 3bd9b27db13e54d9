"""Safe NIfTI loading: every problem with a user's file becomes a one-line DataError naming it.

Checks happen in the order that keeps a bad file cheap: the header (format, dimensionality, size)
before any voxel is decoded, then the voxels (finite, declared label values).
"""

from __future__ import annotations

import gzip
import struct
import zlib
from pathlib import Path
from typing import Sequence

import nibabel as nib
import numpy as np

from voxdiff.runtime.errors import DataError

MAX_VOXELS = 512**3  # a header claiming more is corrupt or not a brain scan; refuse before allocating
MAX_DIM = 2048
AFFINE_ATOL = 1e-3  # mm; image and label grids must agree to this

# What nibabel, gzip and numpy raise on a file that is not NIfTI, truncated or corrupt.
_READ_ERRORS = (nib.filebasedimages.ImageFileError, OSError, EOFError, ValueError, zlib.error,
                gzip.BadGzipFile, struct.error, nib.spatialimages.HeaderDataError)


def open_header(path: str | Path) -> nib.Nifti1Image:
    """Open a NIfTI file lazily and check its header; no voxel data is read yet."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    try:
        img = nib.load(path)
    except _READ_ERRORS as e:
        raise DataError(f"{path}: not a readable NIfTI file ({_first_line(e, path)})") from None
    if not isinstance(img, (nib.Nifti1Image, nib.Nifti2Image)):
        raise DataError(f"{path}: not a NIfTI file (nibabel reads it as {type(img).__name__})")
    _check_shape(path, tuple(int(n) for n in img.header.get_data_shape()))
    if not np.all(np.isfinite(img.affine)) or abs(np.linalg.det(img.affine[:3, :3])) < 1e-6:
        raise DataError(f"{path}: the header's voxel-to-world affine is degenerate: {img.affine.round(4).tolist()}")
    return img


def _check_shape(path: Path, shape: tuple[int, ...]) -> None:
    if len(shape) < 3:
        raise DataError(f"{path}: expected a 3D volume, the header says shape {shape}")
    if len(shape) > 3 and any(n != 1 for n in shape[3:]):
        raise DataError(f"{path}: expected a 3D volume, got a {len(shape)}D image of shape {shape} "
                        "(split it into one 3D file per volume)")
    if min(shape[:3]) < 1 or max(shape[:3]) > MAX_DIM or int(np.prod(shape[:3], dtype=np.int64)) > MAX_VOXELS:
        raise DataError(f"{path}: the header claims an implausible size {shape[:3]} "
                        f"(limit {MAX_DIM} per axis, {MAX_VOXELS} voxels); the file is corrupt")


def load_volume(path: str | Path, kind: str, label_values: Sequence[int] | None = None) -> nib.Nifti1Image:
    """Load and check a 3D NIfTI; returns an in-memory image (float32 for "image", int32 for "label").

    kind="label" needs ``label_values``: every voxel must hold one of them.
    """
    if kind not in ("image", "label"):
        raise ValueError(f"kind must be 'image' or 'label', not {kind!r}")
    path = Path(path)
    img = open_header(path)
    data = _read_voxels(path, img)
    if not np.all(np.isfinite(data)):
        bad = int(np.size(data) - np.count_nonzero(np.isfinite(data)))
        raise DataError(f"{path}: {bad} voxels are NaN or infinite")
    if kind == "label":
        if label_values is None:
            raise ValueError("load_volume(kind='label') needs label_values")
        data = _as_labels(path, data, label_values)
    else:
        data = data.astype(np.float32, copy=False)
    # A plain in-memory image: the checked voxels and the affine are all later steps need.
    return nib.Nifti1Image(data, img.affine)


def _read_voxels(path: Path, img) -> np.ndarray:
    try:
        data = np.asanyarray(img.dataobj)  # applies scl_slope/inter; keeps integer labels integer
    except _READ_ERRORS as e:
        raise DataError(f"{path}: truncated or corrupt voxel data ({_first_line(e, path)})") from None
    data = np.asarray(data)
    return data.reshape(data.shape[:3])  # drops a trailing singleton 4th dimension


def _as_labels(path: Path, data: np.ndarray, label_values: Sequence[int]) -> np.ndarray:
    values = np.unique(data)
    allowed = np.asarray(sorted(label_values))
    bad = values[~np.isin(values, allowed)]  # fractional values are never in the list either
    if bad.size:
        shown = ", ".join(f"{v:g}" for v in bad[:10]) + (f" ... ({bad.size} in all)" if bad.size > 10 else "")
        raise DataError(f"{path}: label values {shown} are not in data.label_values {list(label_values)}")
    return data.astype(np.int32, copy=False)


def check_pair(image: nib.Nifti1Image, label: nib.Nifti1Image, image_path: str | Path,
               label_path: str | Path) -> None:
    """Image and label must share one voxel grid, or voxel i of the label would describe another place."""
    if image.shape[:3] != label.shape[:3]:
        raise DataError(f"{image_path} and {label_path}: shapes differ ({image.shape[:3]} vs {label.shape[:3]})")
    if not np.allclose(image.affine, label.affine, atol=AFFINE_ATOL):
        worst = float(np.max(np.abs(image.affine - label.affine)))
        raise DataError(f"{image_path} and {label_path}: voxel-to-world affines differ (by up to {worst:.4g} mm)")


def load_pair(image_path: str | Path, label_path: str | Path,
              label_values: Sequence[int]) -> tuple[nib.Nifti1Image, nib.Nifti1Image]:
    """Both headers first (cheap, catches mismatches early), then the voxels."""
    check_pair(open_header(image_path), open_header(label_path), image_path, label_path)
    image = load_volume(image_path, "image")
    label = load_volume(label_path, "label", label_values)
    return image, label


def axcodes(affine: np.ndarray) -> str:
    """Orientation as a 3-letter code, e.g. "RAS" or "LPS"."""
    return "".join(c or "?" for c in nib.aff2axcodes(affine))


def _first_line(e: BaseException, path: Path) -> str:
    """The library's own message, first line, without repeating the file name we already lead with."""
    text = str(e).replace(f'"{path}"', "it").replace(str(path), "it").strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
