"""The preprocessed cache that training reads: memory-mapped arrays, no NIfTI decoding per step.

Layout of data/processed/:
  images.npy     float32 [N, D, H, W], intensities scaled to [-1, 1] (background -1)
  labels.npy     uint8   [N, D, H, W], class indices 0..C-1 (position in data.label_values)
  manifest.json  grid (shape, spacing, affine per subject), label_values, split and provenance per subject
  preview.png    mid-slices of a few subjects with the label overlay
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from voxdiff.runtime.errors import DataError

FORMAT_VERSION = 1


@dataclasses.dataclass
class ProcessedCache:
    root: Path
    images: np.ndarray  # memmap [N, D, H, W] float32
    labels: np.ndarray  # memmap [N, D, H, W] uint8
    manifest: dict

    @property
    def subjects(self) -> list[dict]:
        return self.manifest["subjects"]

    @property
    def label_values(self) -> list[int]:
        return self.manifest["label_values"]

    @property
    def num_classes(self) -> int:
        return len(self.label_values)

    def split_indices(self, split: str) -> np.ndarray:
        """Row indices of the cache in the given split ("train" or "val"), in manifest order."""
        return np.array([s["index"] for s in self.subjects if s["split"] == split], dtype=np.int64)

    def training_rows(self, count: int, seed: int) -> np.ndarray:
        """The first `count` training rows (0 = all) by a seeded rank of their subject ids, in manifest order.

        Nested: the N subjects of a smaller training set are among those of every larger one, and the
        validation split is untouched, so val losses compare across training-set sizes. A seeded rank rather
        than the first N ids: real data is often ordered by site or date."""
        import hashlib

        rows = self.split_indices("train")
        if count == 0 or count >= len(rows):
            if count > len(rows):
                raise DataError(f"{self.root / 'manifest.json'}: data.train_subjects = {count}, but the cache holds "
                                f"{len(rows)} training subjects")
            return rows
        rank = sorted(rows, key=lambda r: hashlib.sha256(f"{seed}:train:{self.subjects[r]['id']}".encode()).hexdigest())
        return np.array(sorted(rank[:count]), dtype=np.int64)

    def pairwise_dice(self, rows) -> dict[int, float | None]:
        """label value -> mean Dice between the label maps of every pair of these rows (background left out):
        how much the anatomy varies between subjects, the between-subject variation a training set holds.
        None for a class absent from all of them or with fewer than two rows."""
        rows = [int(r) for r in rows]
        out: dict[int, float | None] = {}
        for c, value in enumerate(self.label_values):
            if c == 0:
                continue
            if len(rows) < 2:
                out[value] = None
                continue
            masks = np.stack([(np.asarray(self.labels[r]) == c).ravel() for r in rows]).astype(np.float32)
            sizes = masks.sum(1)
            overlap = masks @ masks.T  # |A_i & A_j| for every pair at once
            denominator = sizes[:, None] + sizes[None, :]
            i, j = np.triu_indices(len(rows), k=1)
            valid = denominator[i, j] > 0
            out[value] = float(np.mean(2 * overlap[i, j][valid] / denominator[i, j][valid])) if valid.any() else None
        return out

    def stack(self, rows) -> tuple[np.ndarray, np.ndarray]:
        """Images [B, 1, D, H, W] float32 and class labels [B, D, H, W] of the given cache rows."""
        rows = [int(r) for r in rows]
        return np.stack([self.images[r] for r in rows])[:, None], np.stack([self.labels[r] for r in rows])

    def affine(self, index: int) -> np.ndarray:
        return np.asarray(self.subjects[index]["affine"], dtype=np.float64)

    @property
    def fingerprint(self) -> str:
        return self.manifest["fingerprint"]


def open_cache(root: str | Path) -> ProcessedCache:
    root = Path(root)
    manifest_path = root / "manifest.json"
    if not manifest_path.is_file():
        raise DataError(f"{manifest_path}: preprocessed cache not found (run `dvc repro preprocess`)")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("version") != FORMAT_VERSION:
        raise DataError(f"{manifest_path}: cache format {manifest.get('version')} is not {FORMAT_VERSION}; "
                        "rerun preprocess")
    images = np.load(root / "images.npy", mmap_mode="r")
    labels = np.load(root / "labels.npy", mmap_mode="r")
    if images.shape != labels.shape or images.shape[0] != len(manifest["subjects"]):
        raise DataError(f"{root}: images {images.shape} and labels {labels.shape} disagree with the manifest")
    return ProcessedCache(root, images, labels, manifest)
