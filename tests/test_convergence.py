"""voxdiff.analysis.convergence against problems whose answer is known: the plateau criterion and the measured
critical batch (McCandlish et al. 2018)."""

import math

import numpy as np
import pytest

from voxdiff.analysis.convergence import (BEST_WINDOW, PLATEAU_THRESHOLD, best_point, bootstrap_critical_batch,
                                 fit_critical_batch, past_its_lowest, plateau_change, plateau_level, reached_plateau,
                                 target_levels)

# The study's cadence: 24 validations, the last at the end of the run (7 of them in the last quarter).
STEPS = np.arange(1, 25) * 64.0


def curve(last_quarter_change: float, noise: float = 0.0, rng=None, level: float = 0.05) -> np.ndarray:
    """A val curve that falls fast over the first three quarters (from 4x its level) and then changes by
    exactly `last_quarter_change` (relative, linear in steps) over the last quarter; multiplicative
    validation noise of relative std `noise`."""
    start = 0.75 * STEPS[-1]
    decay = lambda s: np.exp(-s / 150.0)  # noqa: E731
    early = level * (1 + 3 * (decay(STEPS) - decay(start)) / (decay(STEPS[0]) - decay(start)))
    late = level * (1 + last_quarter_change * (STEPS - start) / (STEPS[-1] - start))
    y = np.where(STEPS < start, early, late)
    if noise:
        y = y * np.exp(rng.normal(0.0, noise, len(y)))
    return y


def old_flattening(losses: np.ndarray) -> float:
    """val_flattening, the criterion plateau_change replaces: last quarter's gain / first quarter's."""
    at = lambda s: float(np.interp(s, STEPS, losses))  # noqa: E731
    return (at(0.75 * STEPS[-1]) - losses[-1]) / (losses[0] - at(STEPS[-1] / 4))


def test_plateau_change_reads_a_known_relative_change_exactly():
    for truth in (-0.10, -0.03, 0.0, 0.05):
        assert plateau_change(STEPS, curve(truth)) == pytest.approx(truth, abs=1e-12)
    # the window follows `fraction`: the last half holds the 3/4 point where the slope changes
    assert plateau_change(STEPS, curve(-0.10), fraction=0.5) < -0.10


def test_plateau_flags_a_curve_still_falling_and_passes_a_flat_one_under_validation_noise():
    """1 % validation noise (the study's runs scatter 0.4-2 % around their last-quarter line, typically
    1 %; the change then has a standard error of about 1.1 %): a curve still falling 10 % over its last
    quarter is flagged on every draw, a flat one passes on ~96 % of draws, and the estimate is unbiased.
    The old val_flattening passes the falling curve (its first quarter fell much more), which is why it
    did not discriminate."""
    rng = np.random.default_rng(0)
    falling = [plateau_change(STEPS, curve(-0.10, 0.01, rng)) for _ in range(400)]
    flat = [plateau_change(STEPS, curve(0.0, 0.01, rng)) for _ in range(400)]
    assert np.mean(falling) == pytest.approx(-0.10, abs=0.003)
    assert np.mean(flat) == pytest.approx(0.0, abs=0.003)
    assert sum(reached_plateau(c) is False for c in falling) == 400
    assert sum(reached_plateau(c) is True for c in flat) >= 0.90 * 400
    assert np.std(flat) == pytest.approx(0.011, abs=0.002)
    assert old_flattening(curve(-0.10)) < 0.1  # "plateaued" by the old rule, still falling 10 %
    one = np.random.default_rng(1)
    assert reached_plateau(plateau_change(STEPS, curve(-0.10, 0.01, one))) is False
    assert reached_plateau(plateau_change(STEPS, curve(0.0, 0.01, one))) is True


def test_plateau_threshold_and_none_when_too_short():
    assert PLATEAU_THRESHOLD == 0.02
    assert reached_plateau(-0.019) is True and reached_plateau(-0.021) is False and reached_plateau(0.3) is True
    assert reached_plateau(None) is None
    # a plateau that rose by more than the threshold: past its lowest (the steps-long k = 4 runs, +5-9 %)
    assert past_its_lowest(0.021) and not past_its_lowest(0.019) and not past_its_lowest(-0.3)
    assert not past_its_lowest(None)
    rng = np.random.default_rng(2)
    assert all(past_its_lowest(plateau_change(STEPS, curve(0.10, 0.01, rng))) for _ in range(100))
    assert sum(past_its_lowest(plateau_change(STEPS, curve(0.0, 0.01, rng))) for _ in range(100)) <= 10
    # 2 validations in the last quarter: no line worth fitting
    assert plateau_change([10.0, 20.0, 30.0, 40.0], [4.0, 3.0, 2.0, 1.0]) is None
    assert plateau_change([], []) is None and plateau_change([5.0], [1.0]) is None
    assert plateau_change(np.arange(1, 13.0), np.linspace(1.0, 0.5, 12)) is not None  # 4 in the window
    with pytest.raises(ValueError):
        plateau_change([1.0, 2.0], [1.0])
    assert plateau_level(STEPS, curve(0.0)) == pytest.approx(0.05)
    assert plateau_level([], []) is None


B = np.array([1.0, 2.0, 4.0, 8.0, 16.0])


def test_fit_recovers_a_known_critical_batch_without_noise():
    for b_crit, s_min in ((3.0, 50.0), (0.5, 120.0), (40.0, 10.0), (1.3, 64.0)):
        fit = fit_critical_batch(B, s_min * (1 + b_crit / B))
        assert fit.resolved
        assert fit.b_crit == pytest.approx(b_crit, rel=1e-3) and fit.s_min == pytest.approx(s_min, rel=1e-3)
        assert fit.e_min == pytest.approx(s_min * b_crit, rel=1e-3)
        # the E-law is the same law: steps derived from samples E = E_min (1 + B / B_crit) give the same fit
        e = s_min * b_crit * (1 + B / b_crit)
        assert fit_critical_batch(B, e / B).b_crit == pytest.approx(b_crit, rel=1e-3)


def seed_steps(rng, b_crit=3.0, s_min=50.0, seeds=5, noise=0.05) -> dict[int, list[float]]:
    """Steps-to-target per batch and seed: the law times multiplicative seed noise (lognormal)."""
    return {int(b): list(s_min * (1 + b_crit / b) * np.exp(rng.normal(0, noise, seeds))) for b in B}


def test_fit_recovers_b_crit_under_seed_noise_and_the_bootstrap_interval_covers_it():
    per_batch = seed_steps(np.random.default_rng(7))
    b_crit, lo, hi = bootstrap_critical_batch(per_batch, n_boot=2000, seed=0)
    assert b_crit == pytest.approx(3.0, rel=0.10)
    assert lo < 3.0 < hi and hi / lo < 3
    assert bootstrap_critical_batch(per_batch, n_boot=2000, seed=0) == (b_crit, lo, hi)  # reproducible
    # calibration over independent studies: within 10 % and covered by the 95 % interval most of the time
    rng = np.random.default_rng(11)
    results = [bootstrap_critical_batch(seed_steps(rng), n_boot=500, seed=i) for i in range(40)]
    assert np.mean([abs(r.b_crit / 3.0 - 1) < 0.10 for r in results]) >= 0.85
    assert np.mean([r.lo <= 3.0 <= r.hi for r in results]) >= 0.80


def test_paired_bootstrap_resamples_seeds_across_batches():
    """Seeds that differ by a factor shared across the batches (a seed's runs see the same draws; here ±30 %,
    with 2 % of each run's own): the paired interval resamples whole seeds, so that factor moves S_min, not
    B_crit, and its interval is narrow and covers the truth; resampling within each batch (unpaired) mixes one
    seed's batch-1 run with another's batch-8 run and reads the seed factor as a slope: many times wider (in log)."""
    def shared_seed_steps(rng, seeds=5):
        seed_factor = np.exp(rng.normal(0, 0.3, seeds))
        # batches inserted largest first: the bootstrap must line the seeds up by batch, not by the dict's order
        return {int(b): list(50.0 * (1 + 3.0 / b) * seed_factor * np.exp(rng.normal(0, 0.02, seeds))) for b in B[::-1]}

    per_batch = shared_seed_steps(np.random.default_rng(5))
    paired = bootstrap_critical_batch(per_batch, n_boot=2000, paired=True)
    unpaired = bootstrap_critical_batch(per_batch, n_boot=2000)
    assert paired.b_crit == unpaired.b_crit == pytest.approx(3.0, rel=0.10)  # one fit to all runs either way
    assert paired.lo < 3.0 < paired.hi and paired.hi / paired.lo < 1.5
    assert math.log(unpaired.hi / unpaired.lo) > 5 * math.log(paired.hi / paired.lo)  # here 0.99 against 0.06
    rng = np.random.default_rng(13)
    results = [bootstrap_critical_batch(shared_seed_steps(rng), n_boot=500, seed=i, paired=True) for i in range(40)]
    assert np.mean([r.lo <= 3.0 <= r.hi for r in results]) >= 0.80
    with pytest.raises(ValueError, match="same seeds at every batch"):
        bootstrap_critical_batch({1: [10.0, 11.0], 2: [6.0]}, paired=True)


def test_negative_control_without_batch_dependence_is_unresolved():
    """Samples-to-target that do not depend on B (perfect scaling, S = E / B): B_crit far above every
    batch tested or unresolved (inf), and the interval open upwards. Steps that do not depend on B:
    B_crit below every batch tested (or 0), the interval reaching 0."""
    rng = np.random.default_rng(3)
    for _ in range(20):
        perfect = {int(b): list(1000.0 / b * np.exp(rng.normal(0, 0.1, 3))) for b in B}
        fit = fit_critical_batch(np.repeat(B, 3), np.concatenate(list(perfect.values())))
        assert not fit.resolved or fit.b_crit > 4 * B.max()
        flat = {int(b): list(100.0 * np.exp(rng.normal(0, 0.1, 3))) for b in B}
        fit = fit_critical_batch(np.repeat(B, 3), np.concatenate(list(flat.values())))
        assert not fit.resolved or fit.b_crit < B.min() / 2
    exact = fit_critical_batch(B, 1000.0 / B)
    assert exact.b_crit == math.inf and not exact.resolved and exact.e_min == pytest.approx(1000.0)
    assert fit_critical_batch(B, np.full(len(B), 70.0)).b_crit == 0.0
    _, _, hi = bootstrap_critical_batch({int(b): [1000.0 / b * f for f in (0.9, 1.0, 1.1)] for b in B}, n_boot=500)
    assert hi == math.inf
    _, lo, _ = bootstrap_critical_batch({int(b): [100.0 * f for f in (0.9, 1.0, 1.1)] for b in B}, n_boot=500)
    assert lo == 0.0


def test_fit_rejects_what_it_cannot_fit():
    with pytest.raises(ValueError, match="two batch sizes"):
        fit_critical_batch([4, 4, 4], [10, 11, 12])
    with pytest.raises(ValueError, match="positive"):
        fit_critical_batch([1, 2], [10, 0])
    with pytest.raises(ValueError):
        fit_critical_batch([1, 2, 4], [10, 8])


def test_target_levels_lie_strictly_inside_and_geometrically_spaced():
    levels = target_levels(0.16, 0.01, 3)
    assert levels == pytest.approx([0.08, 0.04, 0.02])
    assert target_levels(0.05, 0.06) == [] and target_levels(0.05, 0.0) == []


def test_best_point_finds_a_known_lowest_and_is_less_biased_than_the_lowest_validation():
    """A U-shaped curve 0.03 + 0.02 ((i - 30) / 30)^2 over 48 validations (lowest at validation 30, the shape
    of a run that over-fits after its best) under 1 % multiplicative jitter: best_point's window centre
    lies within 3 validations of 30 on >= 95 % of 400 draws and never at the end; its level is within 0.3 %
    of 0.03 on average, where the lowest single validation is biased low by ~1.1 % (the deepest dip).
    Negative control: a curve still falling at its end puts the lowest window last (at_end)."""
    rng = np.random.default_rng(0)
    i = np.arange(48)
    truth = 0.03 + 0.02 * ((i - 30) / 30.0) ** 2
    draws = [truth * np.exp(rng.normal(0.0, 0.01, len(i))) for _ in range(400)]
    best = [best_point(d) for d in draws]
    assert sum(abs(b.index - 30) <= 3 for b in best) >= 0.95 * 400
    assert not any(b.at_end for b in best)
    level_bias = np.mean([b.level for b in best]) / 0.03 - 1
    raw_bias = np.mean([d.min() for d in draws]) / 0.03 - 1
    assert abs(level_bias) < 0.003 and raw_bias < -0.008
    # the window's mean, exactly
    d = draws[0]
    b = best_point(d)
    assert b.level == pytest.approx(np.mean(d[b.index - BEST_WINDOW // 2:b.index + BEST_WINDOW // 2 + 1]))
    falling = 0.03 + 0.1 * np.exp(-i / 20.0)
    assert best_point(falling).at_end and best_point(falling).index == len(i) - 1 - BEST_WINDOW // 2
    assert best_point(falling[:BEST_WINDOW - 1]) is None
    holed = truth.copy()
    holed[29] = np.nan  # a window holding a non-finite loss is never the lowest
    assert best_point(holed).index not in range(29 - BEST_WINDOW // 2, 29 + BEST_WINDOW // 2 + 1)
    assert best_point(np.full(10, np.nan)) is None
    with pytest.raises(ValueError, match="odd"):
        best_point(truth, window=4)


def test_training_summary_logs_early_stoppings_point_from_its_validation_history():
    """train's own_best_* figures are best_point of the run's validations, at the step and samples of
    the window's centre; a run still falling at its end reads at_end 1; too few validations: None."""
    from voxdiff.pipeline.train import own_best_figures

    i = np.arange(40)
    u = 0.03 + 0.02 * ((i - 25) / 25.0) ** 2
    history = [{"step": 32 * (n + 1), "samples_seen": 64 * (n + 1), "val_loss": float(v)} for n, v in enumerate(u)]
    got = own_best_figures(history)
    assert got == {"own_best_val_loss": pytest.approx(np.mean(u[23:28])), "own_best_step": 32 * 26,
                   "own_best_samples": 64 * 26, "own_best_at_end": 0}
    falling = [dict(h, val_loss=0.03 + 0.1 * math.exp(-n / 10)) for n, h in enumerate(history)]
    assert own_best_figures(falling)["own_best_at_end"] == 1
    assert own_best_figures(falling)["own_best_step"] == history[-1 - BEST_WINDOW // 2]["step"]
    assert set(own_best_figures(history[:BEST_WINDOW - 1]).values()) == {None}


def test_a_run_past_its_best_is_never_at_a_plateau():
    """The eps-long runs over-fitted, rose 20-43 % above their best and flattened there: the last quarter alone
    (change within 2 %) called them 'at plateau'. The verdict reads the level against the run's own best too."""
    from voxdiff.analysis.convergence import FALLING, PAST_BEST, PLATEAU, plateau_change, plateau_verdict, reached_plateau

    steps = np.arange(1, 41) * 64
    dip = np.r_[np.linspace(1.0, 0.5, 15), np.linspace(0.5, 0.62, 10), np.full(15, 0.62)]  # over-fit, then flat
    assert reached_plateau(plateau_change(steps, dip))  # the old criterion passes it
    assert plateau_verdict(steps, dip) == PAST_BEST
    rising = np.r_[np.linspace(1.0, 0.5, 25), np.linspace(0.5, 0.6, 15)]  # still rising at the end
    assert plateau_verdict(steps, rising) == PAST_BEST
    flat = np.r_[np.linspace(1.0, 0.5, 20), 0.5 + 0.002 * np.sin(np.arange(20))]  # settled within jitter
    assert plateau_verdict(steps, flat) == PLATEAU
    falling = np.linspace(1.0, 0.5, 40)  # lowest at the end: no best before it, and still falling
    assert plateau_verdict(steps, falling) == FALLING
    assert plateau_verdict(steps[:2], falling[:2]) is None
