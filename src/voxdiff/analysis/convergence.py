"""Convergence diagnostics of validation curves: a plateau criterion, and the critical batch measured
from steps-to-target (McCandlish et al. 2018). Pure numpy: training's summary imports it too.

Plateau
-------
`plateau_change` is the relative change of the val loss over the last quarter of a run's optimizer
steps, read from a least-squares line fitted to the validations inside that window (robust to the
validation noise that makes an end-point difference jump): slope x window length / the line's value at
the window's start. -0.10 means the line fell 10 % over the last quarter. A run has reached its plateau
when that change is above -PLATEAU_THRESHOLD (it fell by less than 2 %: `reached_plateau`); a rising
line counts as a plateau too (the run has stopped improving; `past_its_lowest` names one that rose by
more than the threshold). The threshold is a relative change of the
loss itself, so it compares runs whatever their first quarter did, which the older `val_flattening`
(last quarter's gain / first quarter's) does not: a run that fell fast at first passes that ratio while
still falling 8-12 % per quarter.

Critical batch
--------------
McCandlish et al. (2018): to reach a given loss, S = S_min (1 + B_crit / B) optimizer steps and
E = E_min (1 + B / B_crit) samples at batch B, with B_crit = E_min / S_min. Since E = B S, the two laws
are one: log E - log(E_min (1 + B/B_crit)) = log S - log(S_min (1 + B_crit/B)) for every run. The fit
is least squares in log space, for two reasons: (1) the residuals of the S-law and of the E-law are then
identical, so both give the same B_crit by construction (linear least squares on S = S_min + E_min / B
weights the small batches, on E = E_min + S_min B the large ones, and the two disagree on noisy data);
(2) the seed-to-seed spread of steps-to-target is roughly proportional to its mean (10-15 % in the
study), which log space weights equally. For a given B_crit the best log S_min is the mean residual, so
the fit is a one-dimensional search over log B_crit (a grid refined by a parabola). An optimum at either
end of the search range means the data cannot resolve B_crit: steps falling as 1/B over every batch
tested (perfect scaling: B_crit -> inf) or not falling at all (B_crit -> 0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np

PLATEAU_THRESHOLD = 0.02   # a run at its plateau fell by less than 2 % over the last quarter of its steps
PLATEAU_FRACTION = 0.25    # the window: the last quarter of the run's optimizer steps
MIN_WINDOW_VALIDATIONS = 3


def plateau_window(steps, fraction: float = PLATEAU_FRACTION) -> np.ndarray:
    """Boolean mask of the validations in the last `fraction` of the run (the run ends at its last
    validation, which training runs at the end of its budget; it starts at step 0)."""
    steps = np.asarray(steps, float)
    if not len(steps):
        return np.zeros(0, bool)
    start = (1.0 - fraction) * steps[-1]
    return steps >= start - 1e-9 * max(1.0, abs(steps[-1]))


def plateau_change(steps, losses, fraction: float = PLATEAU_FRACTION) -> float | None:
    """Relative change of the val loss over the last `fraction` of the run's optimizer steps: a
    least-squares line through the validations in that window, slope x window length / the line's value
    at the window's start (-0.1: fell 10 %). None with fewer than 3 validations in the window."""
    steps, losses = np.asarray(steps, float), np.asarray(losses, float)
    if len(steps) != len(losses):
        raise ValueError(f"{len(steps)} steps but {len(losses)} losses")
    inside = plateau_window(steps, fraction)
    x, y = steps[inside], losses[inside]
    if len(x) < MIN_WINDOW_VALIDATIONS or np.ptp(x) == 0:
        return None
    slope, intercept = np.polyfit(x, y, 1)
    start, length = (1.0 - fraction) * steps[-1], fraction * steps[-1]
    at_start = slope * start + intercept
    if at_start <= 0:
        return None
    return float(slope * length / at_start)


def reached_plateau(change: float | None) -> bool | None:
    """True when the last quarter's relative change is above -PLATEAU_THRESHOLD (fell by less than 2 %,
    or rose); None when the change is unknown (too few validations)."""
    if change is None:
        return None
    return bool(change > -PLATEAU_THRESHOLD)


def past_its_lowest(change: float | None) -> bool:
    """A plateau by `reached_plateau` whose last quarter rose by more than PLATEAU_THRESHOLD: the run passed
    its lowest val loss (over-fitting, or a spike), so its final value is not its plateau's level."""
    return change is not None and change > PLATEAU_THRESHOLD


PLATEAU = "plateau"
FALLING = "still falling"
PAST_BEST = "past its best"


def plateau_verdict(steps, losses, fraction: float = PLATEAU_FRACTION) -> str | None:
    """PLATEAU, FALLING or PAST_BEST (None with too few validations): the one reading of a run's end that every
    count and table uses. A run is past its best, never at a plateau, when its last quarter rose by more than
    PLATEAU_THRESHOLD, or when it has settled more than PLATEAU_THRESHOLD above its own best (the lowest
    window of BEST_WINDOW validations, before the end): a run that over-fitted and then flattened passes the
    last-quarter test alone (the eps-long runs sat 20-43 % above their best)."""
    return judge_plateau(plateau_change(steps, losses, fraction), plateau_level(steps, losses, fraction), losses)


def judge_plateau(change: float | None, level: float | None, losses) -> str | None:
    """plateau_verdict from a run's last-quarter change and level, worked out already, and its val losses."""
    if change is None:
        return None
    best = best_point(losses)
    above = best is not None and not best.at_end and level is not None and level > (1 + PLATEAU_THRESHOLD) * best.level
    if past_its_lowest(change) or above:
        return PAST_BEST
    return PLATEAU if reached_plateau(change) else FALLING


def plateau_level(steps, losses, fraction: float = PLATEAU_FRACTION) -> float | None:
    """Mean val loss of the validations in the last `fraction` of the run (the value a run settles at;
    an upper bound of its plateau when it is still falling). None without a validation there."""
    inside = plateau_window(steps, fraction)
    return float(np.mean(np.asarray(losses, float)[inside])) if inside.any() else None


BEST_WINDOW = 5  # consecutive validations averaged where a run reaches its lowest val loss


@dataclasses.dataclass(frozen=True)
class BestPoint:
    """Where a run reached its lowest val loss: a setting at its own convergence, as early stopping would
    keep it."""
    level: float   # the lowest mean of `window` consecutive validations
    index: int     # the validation at that window's centre
    at_end: bool   # the lowest window is the run's last: still falling, the level an upper bound


def best_point(losses, window: int = BEST_WINDOW) -> BestPoint | None:
    """The lowest mean of `window` consecutive validations and where it lies. Why a window and not the
    lowest validation: the minimum of jittery validations is biased low by their jitter (it picks the
    deepest dip), by about one jitter's std for a few dozen validations on a flat curve; the mean of five
    has sqrt(5) less. The window is odd (its centre is a validation). A window holding a non-finite loss
    is never the lowest; None with fewer validations than the window or no finite window."""
    if window < 1 or window % 2 == 0:
        raise ValueError(f"the window must be a positive odd number of validations, not {window}")
    losses = np.asarray(losses, float)
    if len(losses) < window:
        return None
    means = np.convolve(losses, np.ones(window) / window, mode="valid")
    means = np.where(np.isfinite(means), means, np.inf)
    if not np.isfinite(means).any():
        return None
    i = int(np.argmin(means))
    return BestPoint(float(means[i]), i + window // 2, i == len(means) - 1)


# --- the critical batch ----------------------------------------------------------------------------
SEARCH_DECADES = 3     # B_crit is searched from min(B) / 10^3 to max(B) x 10^3
GRID_POINTS_PER_E = 100  # grid points per unit of log B_crit (1 % steps), refined by a parabola


@dataclasses.dataclass(frozen=True)
class CriticalBatchFit:
    """S = s_min (1 + b_crit / B), E = e_min (1 + B / b_crit), e_min = s_min b_crit. b_crit is inf
    (perfect scaling over the batches tested) or 0 (no gain from a larger batch) when unresolved."""
    b_crit: float
    s_min: float
    e_min: float
    rms_log_residual: float = 0.0

    @property
    def resolved(self) -> bool:
        return 0.0 < self.b_crit < math.inf


class CriticalBatchCI(NamedTuple):
    b_crit: float
    lo: float
    hi: float


def _grid(batches: np.ndarray) -> np.ndarray:
    lo = math.log(batches.min()) - SEARCH_DECADES * math.log(10)
    hi = math.log(batches.max()) + SEARCH_DECADES * math.log(10)
    return np.linspace(lo, hi, int((hi - lo) * GRID_POINTS_PER_E) + 1)


def _profile_fit(batches: np.ndarray, log_steps: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each row of log_steps (replicates x runs, one batch per column), the best log B_crit and
    log S_min, and whether the optimum is inside the search range (not at an end)."""
    grid = _grid(batches)
    g = np.log1p(np.exp(grid)[:, None] / batches[None, :])           # (grid, runs): log(1 + B_crit / B)
    n = len(batches)
    y = np.atleast_2d(log_steps)
    # sum_i (y_i - g_i - m)^2 with m = mean(y - g): expanded so that no (replicates, grid, runs) array is made
    sy, sg = y.sum(1), g.sum(1)
    sse = (y ** 2).sum(1)[:, None] - 2 * y @ g.T + (g ** 2).sum(1)[None, :] - (sy[:, None] - sg[None, :]) ** 2 / n
    i = np.argmin(sse, axis=1)
    inside = (i > 0) & (i < len(grid) - 1)
    c = grid[i].copy()
    j = np.clip(i, 1, len(grid) - 2)
    rows = np.arange(len(y))
    left, mid, right = sse[rows, j - 1], sse[rows, j], sse[rows, j + 1]
    curvature = left - 2 * mid + right
    step = grid[1] - grid[0]
    shift = np.where(curvature > 0, 0.5 * (left - right) / np.where(curvature > 0, curvature, 1.0), 0.0)
    c = np.where(inside, grid[j] + np.clip(shift, -1, 1) * step, c)
    log_s_min = (sy - np.log1p(np.exp(c)[:, None] / batches[None, :]).sum(1)) / n
    return c, log_s_min, inside


def _check(batches, steps) -> tuple[np.ndarray, np.ndarray]:
    b, s = np.asarray(batches, float).ravel(), np.asarray(steps, float).ravel()
    if len(b) != len(s):
        raise ValueError(f"{len(b)} batches but {len(s)} steps-to-target")
    if not (np.isfinite(b).all() and np.isfinite(s).all() and (b > 0).all() and (s > 0).all()):
        raise ValueError("batches and steps-to-target must be finite and positive")
    if len(np.unique(b)) < 2:
        raise ValueError("fitting B_crit needs steps-to-target at two batch sizes at least")
    return b, s


def _as_fit(b: np.ndarray, log_s: np.ndarray, c: float, log_s_min: float, inside: bool) -> CriticalBatchFit:
    if inside:
        b_crit, s_min = math.exp(c), math.exp(log_s_min)
        resid = log_s - log_s_min - np.log1p(b_crit / b)
        return CriticalBatchFit(b_crit, s_min, s_min * b_crit, float(np.sqrt(np.mean(resid ** 2))))
    if c > math.log(b.max()):   # perfect scaling: S = E_min / B
        e_min = math.exp(float(np.mean(log_s + np.log(b))))
        resid = log_s + np.log(b) - math.log(e_min)
        return CriticalBatchFit(math.inf, 0.0, e_min, float(np.sqrt(np.mean(resid ** 2))))
    s_min = math.exp(float(np.mean(log_s)))   # no gain from the batch: S = S_min
    return CriticalBatchFit(0.0, s_min, 0.0, float(np.sqrt(np.mean((log_s - math.log(s_min)) ** 2))))


def fit_critical_batch(batches, steps_to_target) -> CriticalBatchFit:
    """Least-squares fit of S = S_min (1 + B_crit / B) in log space to steps-to-target S at batch B
    (one entry per run; repeated batches are seeds). See the module docstring for why log space."""
    b, s = _check(batches, steps_to_target)
    log_s = np.log(s)
    c, log_s_min, inside = _profile_fit(b, log_s)
    return _as_fit(b, log_s, float(c[0]), float(log_s_min[0]), bool(inside[0]))


def bootstrap_critical_batch(per_batch_seed_steps: dict[float, list[float]], n_boot: int = 2000, seed: int = 0,
                             level: float = 0.95, paired: bool = False) -> CriticalBatchCI:
    """B_crit fitted to every run, and a percentile bootstrap interval over seeds: each replicate
    resamples the runs within each batch with replacement and refits. With `paired`, the lists hold the
    same seeds in the same order at every batch (a seed's runs share their draws) and a replicate resamples
    seeds, each drawn seed bringing its run at every batch: the seed-to-seed variation that every batch
    shares then moves all of a replicate's runs together instead of widening the interval. An end of the
    interval at the edge of the search range is reported as 0 or inf (unresolved). With 3 seeds a batch the
    bootstrap sees only 10 distinct resamples per batch and its interval is on the narrow side."""
    batches = sorted(per_batch_seed_steps)
    b = np.concatenate([np.full(len(per_batch_seed_steps[k]), float(k)) for k in batches])
    s = np.concatenate([np.asarray(per_batch_seed_steps[k], float) for k in batches])
    b, s = _check(b, s)
    point = fit_critical_batch(b, s)
    rng = np.random.default_rng(seed)
    log_s = np.log(s)
    sizes = [len(per_batch_seed_steps[k]) for k in batches]
    if paired:
        if len(set(sizes)) != 1:
            raise ValueError(f"a paired bootstrap needs the same seeds at every batch, not {sizes} runs")
        pick = rng.integers(0, sizes[0], size=(n_boot, sizes[0]))
        columns = [i * sizes[0] + pick for i in range(len(batches))]
    else:
        starts = np.cumsum([0, *sizes[:-1]])
        columns = [start + rng.integers(0, n, size=(n_boot, n)) for start, n in zip(starts, sizes)]
    replicates = log_s[np.concatenate(columns, axis=1)]          # (n_boot, runs), batch order kept
    c, _, inside = _profile_fit(b, replicates)
    grid_mid = 0.5 * (math.log(b.min()) + math.log(b.max()))
    values = np.where(inside, np.exp(c), np.where(c > grid_mid, math.inf, 0.0))
    alpha = 1.0 - level
    lo, hi = np.quantile(values, [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    return CriticalBatchCI(point.b_crit, float(lo), float(hi))


def target_levels(highest_start: float, lowest_reached: float, n: int = 3) -> list[float]:
    """n val-loss targets every run reaches after its first validation: geometrically spaced strictly
    between the lowest first-validation loss (highest_start) and the highest best loss (lowest_reached:
    the worst run's best), at the quantiles 1/(n+1) ... n/(n+1) of the log range, highest first. Empty
    when the range is empty (some run never got below another's first validation)."""
    if not (0 < lowest_reached < highest_start):
        return []
    q = np.arange(1, n + 1) / (n + 1)
    return [float(v) for v in highest_start * (lowest_reached / highest_start) ** q]
