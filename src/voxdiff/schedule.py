"""Budget, learning rate and EMA as functions of samples seen (EDM style), so that runs with
different accumulate_every are compared at equal data and an EMA spans the same number of samples."""

from __future__ import annotations

import dataclasses
import math

from .params import Train


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
    factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[train.lr_scaling]
    return train.lr * factor


def lr_at(train: Train, effective_batch: int, samples_seen: int) -> float:
    """Learning rate for the step that brings the total to `samples_seen` (linear warm-up in samples)."""
    peak = scaled_lr(train, effective_batch)
    if train.warmup_samples <= 0:
        return peak
    return peak * min(1.0, samples_seen / train.warmup_samples)


def ema_beta(train: Train, window_samples: int, samples_seen: int) -> float:
    """Per-step EMA decay for a window of `window_samples`: the half-life is fixed in samples, so
    the EMA averages over the same data whatever the effective batch (EDM's ema_halflife_kimg),
    shortened early in training by ema_rampup_ratio."""
    halflife = train.ema_halflife_samples
    if train.ema_rampup_ratio > 0:
        halflife = min(halflife, samples_seen * train.ema_rampup_ratio)
    return 0.5 ** (window_samples / max(halflife, 1e-8))
