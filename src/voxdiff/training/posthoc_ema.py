"""Post-hoc EMA (Karras et al. 2024, EDM2): a few power-function EMA profiles are tracked during
training and snapshotted now and then; afterwards an EMA of any length is reconstructed from the
snapshots, so runs can be compared at their best EMA length, not only at the one fixed in advance
(the best length moves with the training budget and the batch).

ema-pytorch (MIT) does the maths: KarrasEMA tracks each profile (beta_t = (1 - 1/t)^(gamma + 1)) and
`solve_weights` solves EDM2's least-squares problem (Algorithm 3). This module adds what a run at
any scale needs, which ema-pytorch's PostHocEMA does not do:

- a bounded number of snapshots per run (`train.phema_snapshots` per profile, at evenly spaced
  points of the budget), in half precision, each written atomically;
- reconstruction of every requested length from ONE pass over the snapshots (PostHocEMA's
  synthesize_ema_model does one length per call and re-reads every snapshot for each);
- snapshots tied to the run: their names carry the run's fingerprint and the checkpoint lists the
  ones taken, so snapshots of another run (after `dvc exp apply`, a checkout) are never mixed in;
- no disk access when the tracker is built (every DDP rank builds one; only rank 0 writes).

Lengths are EDM2's sigma_rel, the EMA profile's standard deviation relative to the training time at
which it is read: scale-free, so the same sigma_rel means the same share of the run at every
accumulate_every (the profile's time counts optimizer steps, proportional to samples seen).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Callable, Sequence

import torch

from voxdiff.runtime.errors import VoxdiffError
from voxdiff.runtime.fsutil import atomic_path
from voxdiff.training.checkpoint import RESTART_HINT

# Above 1/sqrt(12) the power function's exponent gamma would be negative (EDM2, eq. 3).
MAX_SIGMA_REL = 0.28

# Snapshots are stored in fp16: half the disk and reads of float32. fp16 rather than bf16: 3 more
# mantissa bits, and a reconstruction is a linear combination of snapshots with weights of both
# signs, so the storage rounding is what it amplifies (tests/test_posthoc_ema.py measures both).
# Network weights are far inside fp16's range; a tensor that is not is kept in float32.
SNAPSHOT_DTYPE = torch.float16


def metric_name(sigma_rel: float) -> str:
    """`phema_val_loss_sr070` for sigma_rel 0.070: the val loss of the EMA of that length."""
    return f"phema_val_loss_sr{round(sigma_rel * 1000):03d}"


def classic_ema_sigma_rel(halflife_samples: float, total_samples: int) -> float:
    """sigma_rel of a classic EMA with this half-life, read at `total_samples`: an exponential
    profile's standard deviation is its mean life, halflife / ln 2 (where the fixed EMA sits on the
    post-hoc curve)."""
    return halflife_samples / math.log(2) / max(total_samples, 1)


def snapshot_due(before: int, now: int, total: int, count: int) -> bool:
    """True when samples seen, going from `before` to `now`, crossed one of the `count` evenly spaced
    points k * total / count (k = 1..count) of a `total`-sample budget; the last point is the end, so
    a run takes at most `count` snapshots per profile whatever its size (fewer only when one step
    crosses several points)."""
    return count > 0 and total > 0 and now * count // total > before * count // total


def snapshot_bytes(n_weights: int, n_profiles: int, count: int) -> int:
    """Disk taken by a run's snapshots (tensor data; each file adds a few kB of pickle)."""
    return n_weights * torch.finfo(SNAPSHOT_DTYPE).bits // 8 * n_profiles * count


def _to_snapshot(t: torch.Tensor) -> torch.Tensor:
    half = t.detach().to("cpu", SNAPSHOT_DTYPE, copy=True)
    if not torch.isfinite(half).all() and torch.isfinite(t).all():  # out of fp16's range
        return t.detach().to("cpu", torch.float32, copy=True)
    return half


class ProfileTracker:
    """The tracked profiles of one run and their snapshots in `folder`, named
    `<profile>.<step>.<fingerprint>.pt` (fingerprint: the run's, Trainer.fingerprint())."""

    def __init__(self, net: torch.nn.Module, make_copy: Callable[[], torch.nn.Module],
                 sigma_rels: tuple[float, ...], folder: Path, fingerprint: str):
        # KarrasEMA directly, not PostHocEMA: PostHocEMA creates its checkpoint folder when built,
        # which raced when every DDP rank built one on a first run (and would make an output appear
        # before training starts). Building the tracker touches no disk; snapshot() creates the folder.
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        # make_copy: a plain copy of the network; deep-copying `net` itself would also copy any
        # forward patched for activation checkpointing, which still points at `net`'s blocks.
        self.make_copy = make_copy
        self.net = net
        self._track(sigma_rels)
        self.taken: list[int] = []  # profile steps with a snapshot; in the checkpoint (state_dict)

    def _track(self, sigma_rels: Sequence[float]) -> None:
        from ema_pytorch import KarrasEMA
        from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma

        self.sigma_rels = tuple(float(s) for s in sigma_rels)
        self.gammas = tuple(sigma_rel_to_gamma(s) for s in self.sigma_rels)
        if len(set(self.gammas)) != len(self.gammas) or len(self.gammas) < 2:
            raise ValueError(f"post-hoc EMA needs at least 2 distinct profiles, got sigma_rels {sigma_rels}")
        self.profiles = torch.nn.ModuleList(KarrasEMA(self.net, gamma=g, ema_model=self.make_copy, update_every=1)
                                            for g in self.gammas)

    @property
    def step(self) -> int:
        """Profile updates so far (optimizer steps that were taken)."""
        return int(self.profiles[0].step.item())

    def update(self) -> None:
        for profile in self.profiles:
            profile.update()

    def _name(self, profile: int, step: int) -> str:
        return f"{profile}.{step}.{self.fingerprint}.pt"

    def snapshot(self) -> None:
        """Write every profile's weights at the current step (SNAPSHOT_DTYPE). Only rank 0 calls it."""
        step = self.step
        if step == 0:
            return  # no update yet (t = 0 has no EMA profile; EDM2's solve divides by t)
        self.folder.mkdir(parents=True, exist_ok=True)  # exist_ok: safe if another process made it
        for i, profile in enumerate(self.profiles):
            weights = {k: _to_snapshot(v) for k, v in profile.ema_model.state_dict().items() if v.is_floating_point()}
            with atomic_path(self.folder / self._name(i, step)) as tmp:
                torch.save(weights, tmp)
        if step not in self.taken:
            self.taken.append(step)

    def snapshots(self) -> list[Path]:
        """This run's snapshots, as the checkpoint lists them."""
        return [self.folder / self._name(i, s) for s in self.taken for i in range(len(self.profiles))]

    def claim(self, checkpoint: Path | str = "the checkpoint", finished: bool = False) -> str:
        """Make `folder` hold exactly the snapshots this run's state lists (call after restoring the
        checkpoint, rank 0 only). Other files are removed: another run's (another fingerprint, e.g.
        after `dvc exp apply` or a change of params), and this run's past the checkpoint (an
        interrupted run). A listed snapshot that is missing is refused for a run that goes on:
        reconstructing without it, or from another run's, would be silently wrong. A finished run
        (e.g. a fresh clone after `dvc pull`: models/phema is not in the DVC cache) keeps its model
        and only loses the post-hoc EMA figures: returns the sentence that says so ("" otherwise)."""
        mine = {p.name for p in self.snapshots()}
        present = {p.name for p in self.folder.glob("*.pt")} if self.folder.is_dir() else set()
        missing = mine - present
        if missing and finished:
            for name in present - mine:
                (self.folder / name).unlink()
            self.taken = []
            return (f"{self.folder}: {len(missing)} of the {len(mine)} post-hoc EMA snapshots of {checkpoint} "
                    "are missing (not in the DVC cache): the finished model stands, the phema_* figures are not "
                    "recomputed")
        if missing:
            others = sorted({n.split(".")[2] for n in present - mine if n.count(".") == 3} - {self.fingerprint})
            held = f" (the folder holds another run's: {', '.join(others)})" if others else ""
            raise VoxdiffError(
                f"{self.folder}: {len(missing)} of the {len(mine)} post-hoc EMA snapshots of {checkpoint} "
                f"(run {self.fingerprint}) are missing{held}; {RESTART_HINT}")
        for name in present - mine:
            (self.folder / name).unlink()
        for tmp in self.folder.glob(".*.tmp") if self.folder.is_dir() else ():
            shutil.rmtree(tmp, ignore_errors=True)  # an atomic write cut short by a kill
        return ""

    def state_dict(self) -> dict:
        """Profiles, the steps snapshotted and the run the snapshot names carry (checkpoint's phema)."""
        return {"profiles": self.profiles.state_dict(), "snapshots": list(self.taken), "run": self.fingerprint,
                "sigma_rels": list(self.sigma_rels)}

    def load_state_dict(self, state: dict) -> None:
        # The profiles the run started with, whatever train.phema_sigma_rels says now: EDM2's reconstruction
        # takes snapshot i as the power-function average over [0, t_i], so a profile started mid-run (or a
        # snapshot of one) would be solved for as if it spanned the run. A changed list applies to a run from
        # scratch; the run goes on (the key is measurement-only) and the change is recorded.
        if tuple(state.get("sigma_rels", self.sigma_rels)) != self.sigma_rels:
            self._track(state["sigma_rels"])
        self.profiles.load_state_dict(state["profiles"])
        self.taken = [int(s) for s in state["snapshots"]]
        self.fingerprint = state["run"]  # the snapshots are named after the run that took them

    @torch.no_grad()
    def reconstruct(self, sigma_rels: Sequence[float]) -> list[torch.nn.Module]:
        """Copies of the network holding the EMA of each length in `sigma_rels` at the last snapshot,
        each snapshot read once for all of them.

        ema-pytorch's synthesize_ema_model does one length per call, loading every snapshot each
        time (lengths x snapshots reads: ~230 GB for 7 lengths at params-gpu.yaml's size with the
        old every-2000-samples cadence). Its solver takes several target profiles at once, though:
        the least-squares weights for all lengths come from one solve_weights call (snapshots x
        lengths), then the snapshots are streamed once, each added into every output model."""
        from ema_pytorch.post_hoc_ema import sigma_rel_to_gamma, solve_weights

        files = [(i, s) for s in self.taken for i in range(len(self.profiles))]
        if not files:
            raise FileNotFoundError(f"{self.folder}: no post-hoc EMA snapshots")
        t_i = torch.tensor([s for _, s in files], dtype=torch.float64)
        gamma_i = torch.tensor([self.gammas[i] for i, _ in files], dtype=torch.float64)
        t_r = torch.full((len(sigma_rels),), float(max(self.taken)), dtype=torch.float64)
        gamma_r = torch.tensor([sigma_rel_to_gamma(s) for s in sigma_rels], dtype=torch.float64)
        weights = solve_weights(t_i, gamma_i, t_r, gamma_r).tolist()  # [snapshot][length]

        outs = [self.make_copy() for _ in sigma_rels]
        targets = [{k: v for k, v in out.state_dict().items() if v.is_floating_point()} for out in outs]
        for target in targets:
            for v in target.values():
                v.zero_()
        for row, (i, s) in zip(weights, files):
            path = self.folder / self._name(i, s)
            snap = torch.load(path, map_location="cpu", weights_only=True)
            if snap.keys() != targets[0].keys():
                raise VoxdiffError(f"{path}: a post-hoc EMA snapshot of another network (its tensors "
                                   "differ from the model's)")
            for k, v in snap.items():
                v = v.to(targets[0][k].device, torch.float32)
                for target, w in zip(targets, row):
                    target[k].add_(v, alpha=w)
        return outs
