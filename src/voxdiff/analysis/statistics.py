"""Statistics of the study's comparisons: Welch's test between two groups of seeds, the ratio of settings paired
by seed, Holm's correction, and the minimum detectable difference next to every "no difference" (noncentral t).
Numbers in, numbers out: no run records here (report/groups.py groups the runs)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

ALPHA = 0.05  # family-wise error rate of the "clearly different" verdicts in one comparison


def compare_means(a: list[float], b: list[float]) -> tuple[str, float, float | None]:
    """('tested' | 'unreplicated', mean(a) - mean(b), Welch's two-sided p-value).

    Welch's t-test (scipy, unequal variances): with 3 seeds a side (df ~ 4) the old "2 x pooled SE"
    rule was far too eager (its false-positive rate is ~12 %, not 5 %). Seeds that agree exactly (zero
    variance on both sides) give p = 0 for any difference and 1 for none."""
    from scipy.stats import ttest_ind

    diff = float(np.mean(a) - np.mean(b))
    if min(len(a), len(b)) < 2:
        return "unreplicated", diff, None
    if np.var(a) == 0 and np.var(b) == 0:
        return "tested", diff, 0.0 if diff != 0 else 1.0
    return "tested", diff, float(ttest_ind(a, b, equal_var=False).pvalue)


class PairedRatio(NamedTuple):
    """k against a reference, paired by seed, on the log scale: r_s = ln(x_s / ref_s)."""
    n: int
    ratio: float          # exp(mean r): the geometric-mean ratio (1.05 = 5 % higher)
    lo: float             # its 95 % t interval
    hi: float
    p: float | None       # paired t test of mean r = 0 (None below 2 pairs)
    mde: float | None     # minimum detectable difference, as a ratio - 1 (0.05 = 5 %), 80 % power, alpha 0.05


def minimum_detectable_difference(sd: float, n: int, alpha: float = 0.05, power: float = 0.8) -> float | None:
    """The smallest true mean difference (in sd's units) that a two-sided one-sample / paired t test on n values
    with this sd detects with the given power: solved exactly on the noncentral t distribution (the usual
    (t_{1-a/2} + t_{power}) sd / sqrt(n) is its approximation and is a few % low at n = 5). None below 2 values."""
    if n < 2 or not sd > 0:
        return None if n < 2 else 0.0
    return _t_test_mde(sd / math.sqrt(n), n - 1, alpha, power)


def _t_test_mde(se: float, df: float, alpha: float, power: float) -> float:
    """The true difference a two-sided t test with this standard error and df rejects with the given power
    (noncentral t, ncp = difference / se), growing the bracket from `se`. The far tail P(T < -crit) is read as
    P(T' > crit) with T' = -T, noncentral t with ncp -d/se: the same number, but scipy's nct.cdf returns NaN
    for it at ncp above ~7.5 (scipy 1.17), where MDEs of few runs lie, and its sf does not. Should the noncentral
    t still fail, the textbook approximation (t_{1-a/2} + t_{power}) x se stands in."""
    from scipy.optimize import brentq
    from scipy.stats import nct, t

    crit = t.ppf(1 - alpha / 2, df)

    def shortfall(d: float) -> float:
        return nct.sf(crit, df, d / se) + nct.sf(crit, df, -d / se) - power

    hi = se
    for _ in range(40):
        value = shortfall(hi)
        if not math.isfinite(value):
            return float((crit + t.ppf(power, df)) * se)
        if value >= 0:
            return float(brentq(shortfall, 1e-12 * se, hi))
        hi *= 2
    return math.inf


def paired_ratio(values: dict[str, float], reference: dict[str, float]) -> PairedRatio | None:
    """x against the reference over the seeds both have (positive values: levels, samples, steps). The
    per-sample draws depend only on the seed and the global sample index, so two settings of one seed
    share their data order: pairing removes the between-seed spread that a Welch test carries."""
    from scipy.stats import t, ttest_1samp

    seeds = sorted(set(values) & set(reference))
    r = np.array([math.log(values[s] / reference[s]) for s in seeds
                  if values[s] > 0 and reference[s] > 0 and math.isfinite(values[s] / reference[s])])
    if len(r) == 0:
        return None
    mean = float(r.mean())
    if len(r) < 2:
        return PairedRatio(1, math.exp(mean), math.nan, math.nan, None, None)
    sd = float(r.std(ddof=1))
    half = float(t.ppf(0.975, len(r) - 1)) * sd / math.sqrt(len(r))
    p = float(ttest_1samp(r, 0.0).pvalue) if sd > 0 else (0.0 if mean != 0 else 1.0)
    mde = minimum_detectable_difference(sd, len(r))
    return PairedRatio(len(r), math.exp(mean), math.exp(mean - half), math.exp(mean + half), p,
                       None if mde is None else math.exp(mde) - 1)


def welch_mde(a: list[float], b: list[float], alpha: float = 0.05, power: float = 0.8) -> float | None:
    """Minimum detectable difference of Welch's test between two groups of these sizes and spreads, relative to
    b's mean: what an unpaired "no difference" can rule out (Welch-Satterthwaite df, noncentral t)."""
    if min(len(a), len(b)) < 2:
        return None
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        return 0.0
    df = (va + vb) ** 2 / (va ** 2 / (len(a) - 1) + vb ** 2 / (len(b) - 1))
    return _t_test_mde(se, df, alpha, power) / abs(float(np.mean(b)))


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm-Bonferroni adjusted p-values (None stays None): the verdicts of one report section are a
    family of tests against the same best setting, so each is corrected for the others."""
    idx = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    m, out, running = len(idx), list(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out
