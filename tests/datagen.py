"""Small synthetic NIfTI pairs and test params for the data tests (real files, written with nibabel)."""

from __future__ import annotations

import copy
from pathlib import Path

import nibabel as nib
import numpy as np
import yaml

from voxdiff import params as params_mod

PARAMS_YAML = Path(__file__).resolve().parents[1] / "params.yaml"

# A 2 mm, 24 x 24 x 20 "head": foreground box, class 1 inside it, a cube of class 2 off centre.
SHAPE = (24, 24, 20)
ZOOM = 2.0
ORIGIN = np.array([-24.0, -24.0, -20.0])
HEAD = (slice(4, 20), slice(4, 20), slice(4, 16))
CUBE = (slice(14, 17), slice(6, 9), slice(10, 13))  # voxel centre (15, 7, 11) in the RAS array


def make_params(**overrides):
    """params.yaml with dotted overrides, e.g. make_params(**{"data.source": "x"}), validated."""
    raw = copy.deepcopy(yaml.safe_load(PARAMS_YAML.read_text()))
    for key, value in overrides.items():
        if "." in key:
            section, name = key.split(".")
            raw[section][name] = value
        else:
            raw[key] = value  # a top-level key such as seed
    return params_mod.validate(raw)


def user_params(source, **overrides):
    """Params for a small user dataset: 2 mm grid of 16^3, labels 0/1/2, one validation subject."""
    base = {"data.source": str(source), "data.label_values": [0, 1, 2], "data.val_subjects": 1,
            "preprocess.spacing": [2.0, 2.0, 2.0], "preprocess.shape": [16, 16, 16]}
    base.update(overrides)
    return make_params(**base)


def ras_affine(zoom: float = ZOOM, origin=ORIGIN) -> np.ndarray:
    a = np.diag([zoom, zoom, zoom, 1.0])
    a[:3, 3] = origin
    return a


def phantom(seed: int = 0, shape=SHAPE, head=HEAD, cube=CUBE) -> tuple[np.ndarray, np.ndarray]:
    """(image float32, label uint8) in RAS voxel order; intensity > 0 only in the head."""
    rng = np.random.default_rng(seed)
    image = np.zeros(shape, np.float32)
    label = np.zeros(shape, np.uint8)
    image[head] = 100 + 10 * rng.standard_normal(image[head].shape)
    label[head] = 1
    image[cube] += 80
    label[cube] = 2
    return image, label


def world_of_voxel(affine: np.ndarray, ijk) -> np.ndarray:
    return affine[:3, :3] @ np.asarray(ijk, float) + affine[:3, 3]


def flip_to_lps(data: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The same world content stored in LPS order (first two axes reversed); the affine follows."""
    flip = np.diag([-1.0, -1.0, 1.0, 1.0])
    flip[:2, 3] = np.asarray(data.shape[:2]) - 1
    return np.ascontiguousarray(data[::-1, ::-1]), affine @ flip


def write_nifti(path: Path, data: np.ndarray, affine: np.ndarray) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(np.asarray(data), affine), path)
    return path


def write_pair(image_path: Path, label_path: Path, seed: int = 0, lps: bool = False,
               image: np.ndarray | None = None, label: np.ndarray | None = None) -> tuple[Path, Path]:
    img, lab = phantom(seed)
    img = img if image is None else image
    lab = lab if label is None else label
    affine = ras_affine()
    if lps:
        img, _ = flip_to_lps(img, affine)
        lab, affine = flip_to_lps(lab, affine)
    return write_nifti(image_path, img, affine), write_nifti(label_path, lab, affine)


def write_dataset(src: Path, n: int = 3, image_glob_dir: str = "images", label_glob_dir: str = "labels") -> list[str]:
    """n subjects s0..s{n-1} in images/<id>.nii.gz + labels/<id>.nii.gz (the default globs)."""
    ids = [f"s{i}" for i in range(n)]
    for i, sid in enumerate(ids):
        write_pair(src / image_glob_dir / f"{sid}.nii.gz", src / label_glob_dir / f"{sid}.nii.gz",
                   seed=i, lps=bool(i % 2))
    return ids


def leftovers(data_dir: Path) -> list[str]:
    """Temp dirs an interrupted atomic write would leave behind (names start with a dot)."""
    return sorted(p.name for p in Path(data_dir).glob(".*.tmp")) if Path(data_dir).exists() else []
