"""The baseline: a med-ddpm-style data path and training loop, on voxdiff's network.

Rebuilt from mobaidoctor/med-ddpm (dataset.py NiftiPairImageGenerator, diffusion_model/trainer.py
Trainer.train) with the same network, scheduler and data as voxdiff, so only what med-ddpm does
differently is measured: every access decodes the NIfTI pair and resizes it (no cache), the loss of
each micro-batch is divided by k, and EMA runs every 10 steps. torchio is not installed here, so its
Resize (linear resampling) is stood in for by scipy.ndimage.zoom(order=1): the same kind of work.
"""

from __future__ import annotations

import copy
from pathlib import Path

import nibabel as nib
import numpy as np
import torch
from scipy import ndimage

UPDATE_EMA_EVERY, STEP_START_EMA, EMA_DECAY = 10, 2000, 0.995  # med-ddpm's Trainer defaults


class NiftiPairs(torch.utils.data.Dataset):
    """(image [1, D, H, W] in [-1, 1], one-hot condition [C, D, H, W]) decoded from the NIfTI pair on every access."""

    def __init__(self, pairs: list[tuple[Path, Path]], shape, label_values):
        self.pairs, self.shape, self.label_values = pairs, tuple(shape), list(label_values)

    def __len__(self) -> int:
        return len(self.pairs)

    def resize(self, volume: np.ndarray) -> np.ndarray:
        return ndimage.zoom(volume, [t / s for t, s in zip(self.shape, volume.shape)], order=1)

    def __getitem__(self, i: int):
        image_path, label_path = self.pairs[i]
        image = nib.load(image_path).get_fdata()  # float64, decoded (gunzip) every time
        flat = image.reshape(-1, image.shape[-1])  # MinMaxScaler over reshape(-1, last axis): per slice
        lo, hi = flat.min(0), flat.max(0)
        image = ((flat - lo) / np.where(hi > lo, hi - lo, 1.0)).reshape(image.shape)
        label = nib.load(label_path).get_fdata()
        masks = [(label == v).astype(np.float64) for v in self.label_values]  # label2masks
        # Linear resize of the masks too, as med-ddpm does (fractional labels at the borders).
        cond = np.stack([self.resize(m) for m in masks])
        image = self.resize(image) * 2.0 - 1.0
        return torch.from_numpy(image[None]).float(), torch.from_numpy(cond).float()


def train_pairs(cache, root: Path) -> list[tuple[Path, Path]]:
    return [(root / s["image"], root / s["label"]) for s in cache.subjects if s["split"] == "train"]


def cycle(loader):
    """med-ddpm's endless loader: a new shuffled pass whenever one ends."""
    while True:
        yield from loader


class MedDDPMLoop:
    """med-ddpm's Trainer.train step: k micro-batches from a shuffled DataLoader, (loss / k).backward(),
    loss.item() per micro-batch, Adam step, EMA (a plain copy before step 2000) every 10 steps."""

    def __init__(self, params, rt, dataset: NiftiPairs, compile_: bool = False):
        from voxdiff.diffusion.model import build_inferer, build_network, build_scheduler

        torch.manual_seed(params.seed)
        self.p, self.rt = params, rt
        self.net = build_network(params.model, len(dataset.label_values)).to(rt.device)
        self.model = torch.compile(self.net) if compile_ else self.net
        self.ema = copy.deepcopy(self.net)
        self.scheduler = build_scheduler(params.diffusion)
        self.inferer = build_inferer(self.scheduler)
        self.opt = torch.optim.Adam(self.net.parameters(), lr=params.train.lr)
        # med-ddpm uses num_workers=4; 0 here keeps the decode inside the step (see the report's note).
        loader = torch.utils.data.DataLoader(dataset, batch_size=params.train.batch_size, shuffle=True,
                                             num_workers=0, drop_last=True)
        self.batches = cycle(loader)
        self.step = 0

    def train_step(self) -> None:
        b, k, dev = self.p.train.batch_size, self.p.train.accumulate_every, self.rt.device
        for _ in range(k):
            image, cond = (x.to(dev) for x in next(self.batches))
            noise = torch.randn_like(image)
            t = torch.randint(0, self.p.diffusion.timesteps, (b,), device=dev)
            with self.rt.autocast():
                pred = self.inferer(inputs=image, diffusion_model=self.model, noise=noise, timesteps=t,
                                    condition=cond, mode="concat")
            loss = (noise - pred.float()).abs().mean()
            loss = loss.sum() / b  # med-ddpm's extra 1/B on an already averaged loss (same cost)
            (loss / k).backward()
            loss.item()
        self.opt.step()
        self.opt.zero_grad()
        if self.step % UPDATE_EMA_EVERY == 0:
            if self.step < STEP_START_EMA:
                self.ema.load_state_dict(self.net.state_dict())
            else:
                with torch.no_grad():
                    for e, p in zip(self.ema.parameters(), self.net.parameters()):
                        e.lerp_(p, 1 - EMA_DECAY)
        self.step += 1
