"""Simple gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, App. A).

Gradient accumulation gives two batch sizes per optimizer step for free: each micro-batch's own
gradient (B_small) and the accumulated window gradient (B_big). Since E|G_B|^2 = |G|^2 + tr(Sigma)/B,
the pair gives unbiased estimates of |G|^2 and tr(Sigma). Each is smoothed with its own EMA and the
noise scale is the ratio of the EMAs: the mean of per-step ratios is badly biased, because the per-step
|G|^2 estimate is very noisy and often near zero or negative.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence


class GradientNoiseScale:
    """EMA-smoothed estimator, fed once per optimizer step (never per micro-batch)."""

    def __init__(self, beta: float = 0.99):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self._grad_sq_ema = 0.0
        self._trace_ema = 0.0
        self._steps = 0

    def update(self, small_sq_norms: Sequence[float], b_small: float, big_sq_norm: float,
               b_big: float) -> None:
        """One optimizer step: |g_j|^2 of each micro-batch's mean-loss gradient, and |G_big|^2 of the window.

        A window without a small/big pair (b_big <= b_small, e.g. a one-micro-batch tail) is skipped.
        Non-finite inputs are skipped too: one NaN would poison the EMA for the rest of training.
        """
        if b_big <= b_small or not small_sq_norms:
            return
        small_sq = math.fsum(small_sq_norms) / len(small_sq_norms)
        if not (math.isfinite(small_sq) and math.isfinite(big_sq_norm)):
            return
        grad_sq = (b_big * big_sq_norm - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
        self._grad_sq_ema = self.beta * self._grad_sq_ema + (1.0 - self.beta) * grad_sq
        self._trace_ema = self.beta * self._trace_ema + (1.0 - self.beta) * trace
        self._steps += 1

    def _debiased(self, ema: float) -> float | None:
        # Adam-style bias correction: the EMA starts at 0, so early values would be shrunk towards it.
        return ema / (1.0 - self.beta ** self._steps) if self._steps else None

    @property
    def grad_sq(self) -> float | None:
        """Smoothed |G|^2 (None before the first measurable step)."""
        return self._debiased(self._grad_sq_ema)

    @property
    def trace(self) -> float | None:
        """Smoothed tr(Sigma), the per-sample gradient variance summed over parameters."""
        return self._debiased(self._trace_ema)

    @property
    def value(self) -> float | None:
        """B_simple = tr(Sigma)/|G|^2, or None when not measurable (no pair yet, or a non-positive EMA)."""
        g, t = self.grad_sq, self.trace
        if g is None or g <= 0.0 or t <= 0.0:
            return None
        return t / g

    @property
    def steps(self) -> int:
        """Number of measurable updates so far."""
        return self._steps

    def state_dict(self) -> dict:
        # Plain floats/ints only: checkpoints are read with torch.load(weights_only=True).
        return {"beta": self.beta, "grad_sq_ema": float(self._grad_sq_ema),
                "trace_ema": float(self._trace_ema), "steps": int(self._steps)}

    def load_state_dict(self, state: dict) -> None:
        missing = {"beta", "grad_sq_ema", "trace_ema", "steps"} - set(state)
        if missing:
            raise KeyError(f"gradient noise scale state lacks {sorted(missing)}")
        self.beta = float(state["beta"])
        self._grad_sq_ema = float(state["grad_sq_ema"])
        self._trace_ema = float(state["trace_ema"])
        self._steps = int(state["steps"])


def not_measurable_reason(accumulate_every: int, world_size: int) -> str | None:
    """Why the noise scale cannot be measured with this setting, or None when it can."""
    # DDP with accumulate_every 1 is measurable: each rank's local gradient (read before the
    # all-reduce by a comm hook) is the small batch, the all-reduced gradient the big one.
    if accumulate_every * world_size <= 1:
        return (f"accumulate_every x world_size = {accumulate_every * world_size}: no small/big batch "
                "pair, gradient noise scale not measurable")
    return None


@dataclasses.dataclass(frozen=True)
class Tradeoff:
    batch: float
    steps_over_min: float    # S / S_min = 1 + B_crit / B
    samples_over_min: float  # E / E_min = 1 + B / B_crit


def critical_batch_tradeoff(b_noise: float, batch_sizes: Sequence[float]) -> list[Tradeoff]:
    """Steps and samples needed relative to their minimum at each batch size, with B_crit ~ B_noise."""
    if not b_noise > 0:
        raise ValueError(f"noise scale must be positive, got {b_noise}")
    return [Tradeoff(float(b), 1.0 + b_noise / b, 1.0 + b / b_noise) for b in batch_sizes]


def balanced_accumulate_every(b_noise: float, micro_batch: int, world_size: int = 1) -> int:
    """accumulate_every whose effective batch is nearest B_crit ~ B_noise, as a power of two >= 1.

    At B = B_crit both steps and samples are twice their minimum: the knee of the tradeoff.
    """
    if not b_noise > 0:
        raise ValueError(f"noise scale must be positive, got {b_noise}")
    k = b_noise / (micro_batch * world_size)
    return 1 if k <= 1 else 2 ** round(math.log2(k))


# --- noise scale per timestep bucket ---------------------------------------------------------------
def b_simple_from_gram(gram) -> tuple[float, float, float]:
    """(B_simple, tr(Sigma), |G|^2) from the Gram matrix of n single-sample gradients g_i.

    Unbiased: |G|^2 = mean over i != j of <g_i, g_j> (independent samples), tr(Sigma) = mean |g_i|^2 - |G|^2.
    B_simple is NaN when the |G|^2 estimate is not positive (the gradient is lost in the noise).
    """
    import numpy as np

    gram = np.asarray(gram, np.float64)
    n = gram.shape[0]
    if n < 2:
        raise ValueError("need at least 2 gradients")
    diag = float(np.trace(gram)) / n
    off = (float(gram.sum()) - float(np.trace(gram))) / (n * (n - 1))
    trace = diag - off
    return (trace / off if off > 0 else float("nan")), trace, off


def jackknife_se(gram) -> float:
    """Jackknife standard error of B_simple over the n samples (leave one out): the spread that
    comes with each per-bucket value. NaN when any leave-one-out estimate is undefined."""
    import numpy as np

    gram = np.asarray(gram, np.float64)
    n = gram.shape[0]
    if n < 3:
        return float("nan")
    keep = [np.delete(np.arange(n), i) for i in range(n)]
    values = np.array([b_simple_from_gram(gram[np.ix_(k, k)])[0] for k in keep])
    if not np.isfinite(values).all():
        return float("nan")
    return float(np.sqrt((n - 1) / n * np.sum((values - values.mean()) ** 2)))


def bucket_edges(timesteps: int, buckets: int) -> list[tuple[int, int]]:
    """[lo, hi) timestep ranges of equal width; bucket 0 holds the least noisy timesteps."""
    cuts = [round(i * timesteps / buckets) for i in range(buckets + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(buckets)]
