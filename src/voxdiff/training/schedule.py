"""Budget, learning rate and EMA as functions of samples seen (EDM style), so that runs with
different accumulate_every are compared at equal data and an EMA spans the same number of samples."""

from __future__ import annotations

import dataclasses
import math

from voxdiff.params import Train


@dataclasses.dataclass(frozen=True)
class Budget:
    micro_batch: int       # samples per micro-batch per process
    accumulate_every: int  # micro-batches per optimizer step per process
    world_size: int
    total_steps: int       # optimizer steps
    total_samples: int     # samples seen by the end

    @property
    def effective_batch(self) -> int:
        return self.micro_batch * self.accumulate_every * self.world_size

    def window(self, step: int) -> range:
        """Global sample indices of optimizer step `step` (0-based). Every window is full except,
        with a sample budget, the last, which holds what is left."""
        start = step * self.effective_batch
        return range(start, min(start + self.effective_batch, self.total_samples))

    def micro_batches(self, step: int, rank: int) -> list[list[int]]:
        """This process's `accumulate_every` micro-batches of the window (some may be short or empty
        in the last window). The window is cut into micro-batches in index order and dealt out
        round-robin over ranks, so one process with N x accumulation sees the same samples."""
        idx = list(self.window(step))
        b = self.micro_batch
        chunks = [idx[i * b:(i + 1) * b] for i in range(self.accumulate_every * self.world_size)]
        return chunks[rank::self.world_size]


def plan_budget(train: Train, world_size: int) -> Budget:
    eff = train.batch_size * train.accumulate_every * world_size
    if train.max_steps > 0:
        steps, samples = train.max_steps, train.max_steps * eff
    else:
        steps, samples = math.ceil(train.max_samples / eff), train.max_samples
    return Budget(train.batch_size, train.accumulate_every, world_size, steps, samples)


def scaled_lr(train: Train, effective_batch: int) -> float:
    """train.lr rescaled from train.reference_batch to the effective batch (train.lr_scaling)."""
    ratio = effective_batch / train.reference_batch
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio), "sde": math.sqrt(ratio)}[train.lr_scaling]
    return train.lr * factor


@dataclasses.dataclass(frozen=True)
class AdamSettings:
    lr: float
    betas: tuple[float, float]
    eps: float


def adam_settings(train: Train, effective_batch: int) -> AdamSettings:
    """Adam's peak lr, betas and eps for this effective batch.

    lr_scaling none/linear/sqrt rescale the lr only. `sde` is Malladi et al. (NeurIPS 2022)'s square-root
    rule for Adam with kappa = effective_batch / reference_batch: lr x sqrt(kappa), (1 - beta) x kappa
    for both betas, eps / sqrt(kappa). Adam's betas are per step, so without it a kappa x larger batch
    also stretches Adam's memory kappa x in samples. A beta that would drop below 0 is an error.
    """
    lr = scaled_lr(train, effective_batch)
    b1, b2 = train.adam_betas
    if train.lr_scaling != "sde":
        return AdamSettings(lr, (b1, b2), train.adam_eps)
    kappa = effective_batch / train.reference_batch
    betas = (1 - kappa * (1 - b1), 1 - kappa * (1 - b2))
    if min(betas) < 0:
        from voxdiff.runtime.errors import ParamsError

        raise ParamsError(f"params.yaml: train.lr_scaling=sde with effective batch {effective_batch} "
                          f"(kappa {kappa:g} x train.reference_batch) makes Adam's beta negative "
                          f"({betas[0]:.4g}, {betas[1]:.4g}); raise train.reference_batch or train.adam_betas")
    return AdamSettings(lr, betas, train.adam_eps / math.sqrt(kappa))


def lr_at(train: Train, effective_batch: int, samples_seen: int, total_samples: int) -> float:
    """Learning rate for the step that brings the total to `samples_seen`, all counted in samples:
    linear warm-up to the (scaled) peak over train.warmup_samples, then train.lr_schedule: constant, or
    a cosine or linear decay from the peak to train.lr_min at `total_samples` (the budget), so runs of
    every accumulate_every decay over the same data."""
    peak = scaled_lr(train, effective_batch)
    warm = train.warmup_samples
    if warm > 0 and samples_seen < warm:
        return peak * samples_seen / warm
    if train.lr_schedule == "constant":
        return peak
    span = max(total_samples - warm, 1)
    progress = min(1.0, max(0.0, (samples_seen - warm) / span))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if train.lr_schedule == "cosine" else 1 - progress
    return train.lr_min + (peak - train.lr_min) * shape


def ema_halflife(train: Train, samples_seen: int) -> float:
    """EMA half-life in samples in force at `samples_seen`: train.ema_halflife_samples, shortened early
    in training to ema_rampup_ratio x samples seen (EDM's ramp-up), so the ramp-up ends at
    halflife / ratio samples (4 half-lives at ratio 0.25)."""
    halflife = train.ema_halflife_samples
    if train.ema_rampup_ratio > 0:
        halflife = min(halflife, samples_seen * train.ema_rampup_ratio)
    return halflife


def ema_rampup_end(train: Train) -> float:
    """Samples seen when the EMA half-life reaches train.ema_halflife_samples (0 without ramp-up)."""
    return train.ema_halflife_samples / train.ema_rampup_ratio if train.ema_rampup_ratio > 0 else 0.0


def ema_beta(train: Train, window_samples: int, samples_seen: int) -> float:
    """Per-step EMA decay for a window of `window_samples`: the half-life is fixed in samples, so
    the EMA averages over the same data whatever the effective batch (EDM's ema_halflife_kimg)."""
    return 0.5 ** (window_samples / max(ema_halflife(train, samples_seen), 1e-8))


def crosses(before: int, after: int, points) -> bool:
    """True when one of `points` (samples seen) lies in (before, after]: the step that took samples seen from
    `before` to `after` reached it (train.keep_checkpoints_at_samples; the loop and plan.count_events both ask)."""
    return any(before < n <= after for n in points)


def due_in_samples(before: int, after: int, every: int, last: bool) -> bool:
    """True at the last step, or when a multiple of `every` lies in (before, after]; never for every = 0.
    Counted in samples, validation, post-hoc EMA snapshots and probes land at the same samples whatever
    the effective batch (a step-count cadence lands k x later at k x accumulation)."""
    return every > 0 and (last or after // every > before // every)
