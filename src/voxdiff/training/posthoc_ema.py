"""Post-hoc EMA (Karras et al. 2024, EDM2): a few power-function EMA profiles are tracked during
training and snapshotted now and then; afterwards an EMA of any length is reconstructed from the
snapshots, so runs can be compared at their best EMA length, not only at the one fixed in advance
(the best length moves with the training budget and the batch).

ema-pytorch (MIT) does the maths: KarrasEMA tracks each profile (beta_t = (1 - 1/t)^(gamma + 1)) and
PostHocEMA.synthesize_ema_model solves EDM2's least-squares problem (Algorithm 3). This module adds
what a resumable run needs: snapshots written atomically (ema-pytorch's own `checkpoint` is not),
profile state kept in the training checkpoint, and snapshots from an abandoned run removed.

Lengths are EDM2's sigma_rel, the EMA profile's standard deviation relative to the training time at
which it is read: scale-free, so the same sigma_rel means the same share of the run at every
accumulate_every (the profile's time counts optimizer steps, proportional to samples seen).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch

from voxdiff.fsutil import atomic_path

# Above 1/sqrt(12) the power function's exponent gamma would be negative (EDM2, eq. 3).
MAX_SIGMA_REL = 0.28


def metric_name(sigma_rel: float) -> str:
    """`phema_val_loss_sr070` for sigma_rel 0.070: the val loss of the EMA of that length."""
    return f"phema_val_loss_sr{round(sigma_rel * 1000):03d}"


def classic_ema_sigma_rel(halflife_samples: float, total_samples: int) -> float:
    """sigma_rel of a classic EMA with this half-life, read at `total_samples`: an exponential
    profile's standard deviation is its mean life, halflife / ln 2 (where the fixed EMA sits on the
    post-hoc curve)."""
    return halflife_samples / math.log(2) / max(total_samples, 1)


class ProfileTracker:
    """The tracked profiles of one run and their snapshots in `folder` (`<profile>.<step>.pt`)."""

    def __init__(self, net: torch.nn.Module, make_copy: Callable[[], torch.nn.Module],
                 sigma_rels: tuple[float, ...], folder: Path):
        from ema_pytorch import PostHocEMA

        self.folder = Path(folder)
        missing = [d for d in (self.folder, *self.folder.parents) if not d.exists()]  # deepest first
        # make_copy: a plain copy of the network; deep-copying `net` itself would also copy any
        # forward patched for activation checkpointing, which still points at `net`'s blocks.
        self.phema = PostHocEMA(net, ema_model=make_copy, sigma_rels=tuple(sigma_rels),
                                checkpoint_every_num_steps="manual", checkpoint_folder=str(self.folder),
                                checkpoint_dtype=torch.float32, update_every=1)
        # PostHocEMA creates its folder at once; nothing may appear on disk before training starts
        # (a run that fails its checks leaves no outputs), so undo that: snapshot() creates it.
        for d in missing:
            d.rmdir()

    @property
    def step(self) -> int:
        """Profile updates so far (optimizer steps that were taken)."""
        return int(self.phema.step.item())

    def update(self) -> None:
        self.phema.update()

    def snapshot(self) -> None:
        """Write every profile's weights at the current step (float32: reconstruction is a linear
        combination of snapshots, and fp16 rounding would dominate its error)."""
        for i, ema in enumerate(self.phema.ema_models):
            with atomic_path(self.folder / f"{i}.{self.step}.pt") as tmp:
                torch.save({k: v.detach().to("cpu", torch.float32, copy=True) for k, v in ema.state_dict().items()},
                           tmp)

    def snapshots(self) -> list[Path]:
        return sorted(self.folder.glob("*.pt"))

    def drop_snapshots_after(self, step: int) -> None:
        """Remove snapshots newer than `step`: those of an interrupted run past its checkpoint, or
        (step 0) of an earlier configuration, which the reconstruction would otherwise mix in."""
        for path in self.snapshots():
            if int(path.stem.split(".")[1]) > step:
                path.unlink()

    def state_dict(self) -> dict:
        return self.phema.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.phema.load_state_dict(state)

    @torch.no_grad()
    def reconstruct(self, sigma_rel: float) -> torch.nn.Module:
        """A copy of the network holding the EMA of length `sigma_rel` at the last snapshot."""
        if not self.snapshots():
            raise FileNotFoundError(f"{self.folder}: no post-hoc EMA snapshots")
        return self.phema.synthesize_ema_model(sigma_rel=sigma_rel).ema_model
