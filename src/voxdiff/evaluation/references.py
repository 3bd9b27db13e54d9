"""The reference predictors every evaluation figure is read against: the tissue-mean image (each voxel = its
class's mean intensity over the training subjects) and clamped Gaussian noise. evaluate scores them with SSIM,
PSNR and MAE (its floors), segmenter.py with Dice (trivially segmentable, and the floor)."""

from __future__ import annotations

import numpy as np
import torch

from voxdiff.data.cache import ProcessedCache
from voxdiff.diffusion import objective


def tissue_means(cache: ProcessedCache) -> np.ndarray:
    """The lookup table of the tissue-mean predictor: each class's mean intensity over the training
    subjects (-1, the background value, for a class they never show)."""
    rows = cache.split_indices("train")
    table = np.zeros(cache.num_classes, np.float32)
    for c in range(cache.num_classes):
        total, count = 0.0, 0
        for r in rows:
            sel = np.asarray(cache.labels[r]) == c
            total += float(np.asarray(cache.images[r], np.float64)[sel].sum())
            count += int(sel.sum())
        table[c] = total / count if count else -1.0
    return table


def tissue_mean_image(table: np.ndarray, label: np.ndarray) -> np.ndarray:
    """The lookup-table predictor: each voxel = its class's entry of `tissue_means`."""
    return table[label.astype(np.int64)]


def noise_image(shape, seed: int) -> np.ndarray:
    """The no-model predictor: standard Gaussian noise clamped to [-1, 1], as a sampler's output is."""
    g = torch.Generator().manual_seed(objective.stream_seed(seed, 0xF100))
    return torch.randn(tuple(shape), generator=g).clamp(-1, 1).numpy()
