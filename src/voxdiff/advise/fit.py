"""The arithmetic of `voxdiff advise` (numpy only): steps-to-target from training branches, the local
critical batch with its interval, the table of candidate settings and the recommendation.

McCandlish et al. (2018): to make a given progress, S(B) = S_min + E_min / B optimizer steps and
E(B) = S_min B + E_min samples at effective batch B, with B_crit = E_min / S_min. Only ratios between
settings are used (`Law`), so the scale of S_min and E_min does not matter, and the two limits of an
unresolved fit stay finite: B_crit -> 0 (steps do not fall with B: samples grow as B) and B_crit -> inf
(perfect scaling: samples do not depend on B).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from voxdiff.analysis.convergence import bootstrap_critical_batch, fit_critical_batch

TARGET_FRACTION = 0.8   # the target gain: this share of the largest batch's mean gain over its whole branch
CHECK_FRACTIONS = (0.5, 0.65)  # the same fit at shallower targets (every branch passed them): a robustness check
DISAGREEMENT = 2.0      # branches and noise scale disagree when their ratio is beyond this (either way)
WIDE = 10.0             # a branch interval wider than this ratio (hi / lo) does not resolve B_crit
MIN_FIT_BATCHES = 3     # a batch below the largest sets the target only with this many - 1 batches below it
DEVICE_TIME_SLACK = 2.0  # the recommendation may spend at most this times the least device-time
BOOTSTRAP = 2000


# --- the trade-off law ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Law:
    """Steps S(B) = s_min + e_min / B and samples E(B) = s_min B + e_min to the same progress."""
    s_min: float
    e_min: float
    source: str = "branches"   # "branches" | "noise scale"

    @property
    def b_crit(self) -> float:
        return math.inf if self.s_min == 0 else self.e_min / self.s_min

    def steps(self, batch: float) -> float:
        return self.s_min + self.e_min / batch

    def samples(self, batch: float) -> float:
        return self.s_min * batch + self.e_min

    @classmethod
    def from_b_crit(cls, b_crit: float, source: str) -> "Law":
        if b_crit == math.inf:
            return cls(0.0, 1.0, source)
        return cls(1.0, float(b_crit), source)


# --- branches -> steps to target -> B_crit ----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BranchCurve:
    """One training branch from the checkpoint: the val loss of the weights validated (the EMA) at each
    validation, placed at their mean sample position counted from the branch's start (an EMA's weights
    average iterates of the last ~half-life/ln 2 samples, some from before the branch: the first
    positions are negative). Those positions are the same function of samples seen at every batch."""
    batch: int
    seed: int
    micro: int
    positions: tuple[float, ...]
    losses: tuple[float, ...]
    seconds: float = 0.0   # training time (validations excluded)
    samples: int = 0       # samples it trained (a smaller batch stops once past the target)
    trained: tuple[int, ...] = ()  # samples trained at each validation (0 first); () = the positions


def samples_to_target(positions: Sequence[float], losses: Sequence[float], target: float) -> float | None:
    """Position at the first crossing of `target` (linear between validations), None if never reached."""
    for i in range(1, len(losses)):
        if losses[i] <= target:
            lo, hi = losses[i - 1], losses[i]
            frac = 1.0 if lo == hi else (lo - target) / (lo - hi)
            return positions[i - 1] + min(max(frac, 0.0), 1.0) * (positions[i] - positions[i - 1])
    return None


def firm_bound(b_crit: float | None, hi: float | None) -> bool:
    """B_crit 0 with the interval's upper end at 0: below the smallest batch in at least (1 + level) / 2 of
    the bootstrap replicates, a bound rather than a wide interval. (Not mirrored at inf: jitter_bootstrap
    counts a replicate that fits nothing as inf, so a lower end at inf may be failures, not a bound.)"""
    return b_crit == 0 and hi == 0


@dataclasses.dataclass(frozen=True)
class BranchFit:
    """The local B_crit read from the branches. b_crit None: nothing fitted (`status` and note say why)."""
    b_crit: float | None
    lo: float | None
    hi: float | None
    level: float
    law: Law | None
    start_loss: float        # the checkpoint's EMA on the branches' validation draws
    target_loss: float | None
    mean_gain: dict          # batch -> mean val-loss gain from its first usable validation to its end level
    gain_spread: dict        # batch -> std of that gain over seeds (nan with one seed)
    steps: dict              # batch -> steps to the target, one per seed that reached it
    dropped: list            # "B=8 seed 1" for branches that never reached the target
    checks: dict             # target fraction -> B_crit at that target (robustness)
    early: list = dataclasses.field(default_factory=list)  # branches that crossed while the EMA still held the checkpoint
    note: str = ""
    seed_interval: tuple = (None, None)  # convergence.bootstrap_critical_batch over seeds alone
    jitter: float | None = None          # std of the target batch's validations around their trend
    no_progress: tuple = ()              # larger batches without measurable progress: reported, not fitted
    plateau: bool = False                # no batch made measurable progress: nothing fitted

    @property
    def fitted_batches(self) -> list:
        """The batches the fit ran over (every batch measured but those that made no progress; at a plateau,
        the batches that would have been fitted)."""
        return sorted(b for b in self.mean_gain if b not in self.no_progress)

    @property
    def resolved(self) -> bool:
        return self.b_crit is not None and 0.0 < self.b_crit < math.inf

    @property
    def status(self) -> str:
        """'measured' (a value), 'bound' (below the smallest or above the largest batch fitted), 'plateau'
        (no batch made progress the validations can tell from their jitter), 'no fit' (a target, but fewer
        than two batch sizes to fit) or 'no target' (no branches)."""
        if self.plateau:
            return "plateau"
        if self.b_crit is None:
            return "no target" if self.target_loss is None else "no fit"
        return "measured" if self.resolved else "bound"

    @property
    def firm_bound(self) -> bool:
        """`firm_bound` of this fit: a bound, not a wide interval."""
        return firm_bound(self.b_crit, self.hi)

    @property
    def reliable(self) -> bool:
        """Resolved, with a bounded interval at most WIDE x wide."""
        return (self.resolved and self.lo is not None and self.hi is not None and 0 < self.lo
                and self.hi < math.inf and self.hi / self.lo <= WIDE)


def end_level(c: BranchCurve) -> float:
    """A branch's val loss at its end: the mean of its last quarter of validations (at least one): a
    single last or best value would carry that validation's jitter (the best one, biased low)."""
    return float(np.mean(c.losses[-max(1, (len(c.losses) - 1) // 4):]))


def trend(c: BranchCurve) -> tuple[np.ndarray, float]:
    """A smooth fit of the curve after its first point (a quadratic in position with 5 points or more, a
    line with 3-4) and the residuals' std: the jitter of the validated weights from one validation to the
    next. The first point (the checkpoint's EMA, common to every branch) is kept as it is."""
    x, y = np.asarray(c.positions[1:], float), np.asarray(c.losses[1:], float)
    fitted = np.asarray(c.losses, float).copy()
    degree = 2 if len(x) >= 5 else 1 if len(x) >= 3 else None
    if degree is None:
        return fitted, 0.0
    coef = np.polyfit(x, y, degree)
    fitted[1:] = np.polyval(coef, x)
    resid = y - fitted[1:]
    return fitted, float(np.sqrt(np.sum(resid ** 2) / max(len(x) - degree - 1, 1)))


def _trained(c: BranchCurve) -> tuple:
    return c.trained or c.positions


def _usable(c: BranchCurve, usable_from: float) -> list[int]:
    """Indices of the validations after `usable_from` samples trained (the checkpoint's own, at 0, never)."""
    return [i for i, e in enumerate(_trained(c)) if e >= usable_from and e > 0]


def first_usable(c: BranchCurve, usable_from: float) -> float:
    """The curve's loss at its first validation after `usable_from` samples trained (its last if none): the
    level once its EMA has forgotten the checkpoint's, whose lower noise the branch's shorter EMA cannot keep."""
    use = _usable(c, usable_from)
    return c.losses[use[0]] if use else c.losses[-1]


def branch_target(curves: list[BranchCurve], fraction: float = TARGET_FRACTION,
                  usable_from: float = 0.0) -> float | None:
    """The val-loss target every branch is timed to: `fraction` of the way from the largest batch's first
    usable level (`first_usable`) to its end level, in the mean over its seeds; None without a gain."""
    if not curves:
        return None
    big = [c for c in curves if c.batch == max(c.batch for c in curves)]
    ref = float(np.mean([first_usable(c, usable_from) for c in big]))
    gain = ref - float(np.mean([end_level(c) for c in big]))
    return ref - fraction * gain if gain > 0 else None


def crossing(c: BranchCurve, target: float, usable_from: float = 0.0) -> tuple[float | None, bool]:
    """(samples of branch c's own steps to `target`, early).

    Read on the curve's smooth trend (a quadratic in position through its validations after `usable_from`
    samples trained, a line through 2-4 of them) at the EMA's mean positions: the validations jitter from
    step to step (Adam's momentum swings over a few steps, which an EMA counted in samples averages at small
    batches but not at large ones), and a first crossing of the raw points would time the jitter. When the
    target is passed before `usable_from` (the EMA still held much of the checkpoint's weights, whose
    positions mix two trajectories), it is read at the samples trained, an upper bound that leaves the EMA's
    lag in, and `early` is True."""
    trained = _trained(c)
    use = _usable(c, usable_from)
    if len(use) >= 2:
        x = np.asarray([c.positions[i] for i in use], float)
        y = np.asarray([c.losses[i] for i in use], float)
        coef = np.polyfit(x, y, 2 if len(use) >= 5 else 1)
        grid = np.linspace(x[0], x[-1], 512)
        below = np.flatnonzero(np.polyval(coef, grid) <= target)
        if len(below) and below[0] > 0:
            return (float(grid[below[0]]) if grid[below[0]] > 0 else None), False
        if not len(below):
            return None, False
    e = samples_to_target(trained, c.losses, target)  # passed before the EMA forgot the checkpoint's weights
    return (e if e is not None and e > 0 else None), e is not None


def _steps_at(curves: list[BranchCurve], target: float, usable_from: float = 0.0) -> tuple[dict, list]:
    steps, dropped = {}, []
    for c in curves:
        e, _ = crossing(c, target, usable_from)
        if e is None:
            dropped.append(f"B={c.batch} seed {c.seed}")
            continue
        steps.setdefault(c.batch, []).append(e / c.batch)
    return dict(sorted(steps.items())), dropped


def _fit_steps(steps: dict):
    if len(steps) < 2:
        return None
    return fit_critical_batch([b for b, v in steps.items() for _ in v], [s for v in steps.values() for s in v])


def jitter_bootstrap(curves: list[BranchCurve], n_boot: int, level: float, seed: int = 0,
                     usable_from: float = 0.0) -> tuple[float, float]:
    """Percentile interval of B_crit over replicates that resample the seeds within each batch (as
    convergence.bootstrap_critical_batch does) and each curve's validations: its trend plus residuals drawn
    with replacement, so the interval also holds the jitter between validations, which seeds alone (two,
    drawn on the same samples) understate. Target, crossings and fit are redone in every replicate."""
    rng = np.random.default_rng(seed)
    smooth = {id(c): trend(c) for c in curves}
    resid = {id(c): np.asarray(c.losses[1:], float) - smooth[id(c)][0][1:] for c in curves}
    by_batch: dict = {}
    for c in curves:
        by_batch.setdefault(c.batch, []).append(c)
    values = []
    for _ in range(n_boot):
        replicate = []
        for cs in by_batch.values():
            for c in (cs[i] for i in rng.integers(0, len(cs), len(cs))):
                fitted, r = smooth[id(c)][0], resid[id(c)]
                losses = fitted.copy()
                if len(r):
                    losses[1:] += rng.choice(r, size=len(r), replace=True)
                replicate.append(dataclasses.replace(c, losses=tuple(losses)))
        target = branch_target(replicate, usable_from=usable_from)
        fit = _fit_steps(_steps_at(replicate, target, usable_from)[0]) if target is not None else None
        values.append(math.inf if fit is None else fit.b_crit)  # no fit: as uninformative as it gets
    alpha = 1.0 - level
    lo, hi = np.quantile(np.asarray(values), [alpha / 2, 1 - alpha / 2], method="inverted_cdf")
    return float(lo), float(hi)


def gain(c: BranchCurve, usable_from: float = 0.0) -> float:
    """A branch's val-loss gain from its first usable validation to its end level (> 0: it made progress)."""
    return first_usable(c, usable_from) - end_level(c)


def may_set_target(batch: int, batches) -> bool:
    """The largest batch always; a smaller one only with at least MIN_FIT_BATCHES - 1 batches below it, so that
    a fit over the batches timed to its target keeps at least MIN_FIT_BATCHES (of four, one may fall back; of
    three or fewer, none). measure.time_batches runs a batch only while this holds."""
    return batch == max(batches) or sum(b < batch for b in batches) >= MIN_FIT_BATCHES - 1


@dataclasses.dataclass(frozen=True)
class BatchProgress:
    """How far one batch's branches lowered the val loss, and whether the validations' jitter could have."""
    drop: float              # fall of the fitted line over the branch (> 0: the loss went down)
    resolution: float        # z(level) x the fall's standard error: a fall below it is no measurable progress
    jitter: float | None     # the validations' std around the line (None: too few validations to tell)

    @property
    def measurable(self) -> bool:
        return self.drop > self.resolution


def batch_progress(curves: list[BranchCurve], level: float, usable_from: float = 0.0) -> BatchProgress:
    """A line through one batch's validations after `usable_from` samples trained, at their EMA positions
    (least squares, one slope and an intercept per seed): its fall from each seed's first such validation to
    its last, and z(level) x the fall's standard error. Why a line and not the end points (the first usable
    validation minus the last quarter's mean, `gain`): the end points carry a single validation's jitter,
    and after the demo's warm-up of 256 samples (jitter +-0.01, a fall of ~0.014 over the branch) they could
    not tell progress from noise where every validation together can. The error assumes the jitter
    independent between validations (the branches' EMA is a few samples long). With fewer validations than
    the line's parameters + 2: the mean gain, resolution 0 and no jitter (nothing to test against)."""
    from statistics import NormalDist

    xs, ys, seed_of, spans = [], [], [], []
    for i, c in enumerate(curves):
        use = _usable(c, usable_from)
        xs += [c.positions[j] for j in use]
        ys += [c.losses[j] for j in use]
        seed_of += [i] * len(use)
        if len(use) >= 2:
            spans.append(c.positions[use[-1]] - c.positions[use[0]])
    n, p = len(ys), 1 + len(curves)
    if n < p + 2 or not spans:
        return BatchProgress(float(np.mean([gain(c, usable_from) for c in curves])) if curves else 0.0, 0.0, None)
    design = np.zeros((n, p))
    design[:, 0] = xs
    design[np.arange(n), 1 + np.asarray(seed_of)] = 1.0
    y = np.asarray(ys, float)
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    resid = y - design @ coef
    s2 = float(resid @ resid) / (n - p)
    se_slope = math.sqrt(max(s2 * float(np.linalg.pinv(design.T @ design)[0, 0]), 0.0))
    span = float(np.mean(spans))
    return BatchProgress(-float(coef[0]) * span, NormalDist().inv_cdf(0.5 + level / 2) * se_slope * span, math.sqrt(s2))


@dataclasses.dataclass(frozen=True)
class ProgressVerdict:
    target: float | None                  # the val loss every branch is timed to; None: none made progress
    stalled: tuple[int, ...]              # batches, largest first, that set no target (no measurable progress, or no gain)
    progress: dict[int, BatchProgress]    # each batch judged (the stalled ones and the one that set the target)


def target_and_stalled(curves: list[BranchCurve], level: float = 0.9, usable_from: float = 0.0,
                       fraction: float = TARGET_FRACTION, planned: Sequence[int] = ()) -> ProgressVerdict:
    """The one verdict on which batches made progress (measure.time_batches while the branches run, and
    fit_branches after): from the largest batch down, as long as a batch may set the target
    (`may_set_target`), each whose fall does not pass its resolution (`batch_progress`) made no measurable
    progress; the first that does sets the target (`branch_target`). Target None, every batch tried stalled,
    when none did. `planned`: the batches the branches were planned at (the smaller ones run only once a
    target is set); default: those in `curves`."""
    batches = sorted(set(planned) | {c.batch for c in curves})
    stalled, progress = [], {}
    for b in reversed(batches):
        mine = [c for c in curves if c.batch == b]
        if not mine or not may_set_target(b, batches):
            break
        progress[b] = batch_progress(mine, level, usable_from)
        target = branch_target(mine, fraction, usable_from) if progress[b].measurable else None
        if target is not None:
            return ProgressVerdict(target, tuple(stalled), progress)
        stalled.append(b)
    return ProgressVerdict(None, tuple(stalled), progress)


def fit_branches(curves: list[BranchCurve], level: float = 0.9, usable_from: float = 0.0,
                 n_boot: int = BOOTSTRAP, planned: Sequence[int] = ()) -> BranchFit:
    """Steps each branch took to the same val-loss target (`branch_target`) -> fit S = S_min (1 + B_crit / B)
    (convergence.fit_critical_batch), with an interval from `jitter_bootstrap` (the seed-only interval of
    convergence.bootstrap_critical_batch, narrower, is kept in `seed_interval`). The steps are where the
    branch's EMA crossed the target (`crossing`), read between validations, / B; a crossing within the first
    `usable_from` samples is an upper bound, named in `early`. Larger batches without measurable progress
    (`target_and_stalled`: a line through their validations fell by no more than its standard error allows at
    `level`) keep their gains in the
    report and stay out of the target and the fit: the law describes progress, and they made none. When no
    batch that may set the target (`may_set_target` over `planned`, the batches the branches were planned
    at; default: those in `curves`) made measurable progress, nothing is fitted: a plateau."""
    start = curves[0].losses[0] if curves else math.nan
    gains = {b: [gain(c, usable_from) for c in curves if c.batch == b] for b in sorted({c.batch for c in curves})}
    mean_gain = {b: float(np.mean(g)) for b, g in gains.items()}
    spread = {b: float(np.std(g, ddof=1)) if len(g) > 1 else math.nan for b, g in gains.items()}
    verdict = target_and_stalled(curves, level, usable_from, planned=planned)
    target, stalled, progress = verdict.target, verdict.stalled, verdict.progress
    listed = ", ".join(f"{b} (fall {progress[b].drop:+.2g}, resolution {progress[b].resolution:.2g})" for b in stalled)
    curves = [c for c in curves if c.batch not in stalled]
    batches = sorted({c.batch for c in curves})
    empty = dict(b_crit=None, lo=None, hi=None, level=level, law=None, start_loss=start, target_loss=None,
                 mean_gain=mean_gain, gain_spread=spread, steps={}, dropped=[], checks={}, no_progress=stalled)
    if target is None:
        if not stalled:
            return BranchFit(**empty, note="no branches")
        return BranchFit(**{**empty, "plateau": True, "jitter": progress[stalled[-1]].jitter},
                         note=_plateau_note(listed, level))
    notes = [f"B = {listed} made no measurable progress over {'its branch' if len(stalled) == 1 else 'their branches'}"
             " (at this lr a larger batch can be past what it trains stably at): left out of the target and the "
             f"fit; the target set by B = {max(batches)}"] if stalled else []
    big = max(batches)
    noise = progress[big].jitter
    jitter_text = "an unknown amount" if noise is None else f"±{noise:.2g}"
    if len(batches) < 2:
        return BranchFit(**{**empty, "target_loss": target, "jitter": noise},
                         note="; ".join(notes + [f"only B = {big} {'made progress' if stalled else 'was measured'}: "
                                                 "fewer than two batch sizes to fit"]))
    steps, dropped = _steps_at(curves, target, usable_from)
    fit = _fit_steps(steps)
    checks = {}
    for f in CHECK_FRACTIONS:
        other = _fit_steps(_steps_at(curves, branch_target(curves, f, usable_from), usable_from)[0])
        checks[f] = None if other is None else other.b_crit
    early = [f"B={c.batch} seed {c.seed}" for c in curves if crossing(c, target, usable_from)[1]]
    if fit is None:
        return BranchFit(**{**empty, "target_loss": target, "steps": steps, "dropped": dropped, "checks": checks,
                            "jitter": noise},
                         note="; ".join(notes + ["fewer than two batch sizes reached the target"]))
    lo, hi = jitter_bootstrap(curves, n_boot // 4, level, usable_from=usable_from)
    seeds = bootstrap_critical_batch(steps, n_boot=n_boot, seed=0, level=level)
    law = Law(fit.s_min, fit.e_min) if fit.resolved else Law.from_b_crit(fit.b_crit, "branches")
    if not firm_bound(fit.b_crit, hi) and not (0 < lo and hi < math.inf and hi / lo <= WIDE):
        notes.append(f"not resolved at this budget: the interval spans {lo:.3g}-{hi:.3g}; the val loss moves by "
                     f"{jitter_text} between validations against a gain of {mean_gain[big]:.2g} at B = {big}: more "
                     "--budget-samples or --branch-seeds, or a checkpoint from earlier in training (faster progress)")
    notes += _fit_notes(fit, early, batches)
    return BranchFit(fit.b_crit, lo, hi, level, law, start, target, mean_gain, spread, steps, dropped,
                     checks, early, "; ".join(notes), (seeds.lo, seeds.hi), noise, stalled)


def _plateau_note(listed: str, level: float) -> str:
    return (f"no measurable progress at B = {listed}, the batches that may set the target (the fall of a line "
            "through a batch's validations over its branch; the resolution: the least fall the validations' jitter "
            f"does not make, at {level:.0%}): the checkpoint is at a plateau at this lr, so B_crit is not measurable "
            "here (or the branches are too short to show progress: raise --budget-samples); from here "
            "accumulate_every changes the samples per step, not where the loss settles. For the critical batch of a "
            "training run, advise on a checkpoint from earlier in it (or --from-scratch)")


def _fit_notes(fit, early: list[str], batches: list[int]) -> list[str]:
    """What a user must know of a fitted B_crit: crossings timed while the EMA held the checkpoint, and a fit at
    either end of the batches (a bound, not a value)."""
    notes = []
    if early:
        notes.append(f"{', '.join(early)} crossed the target while the EMA still held the checkpoint's weights: "
                     "timed at the samples trained, an upper bound on their steps (a larger --budget-samples sets a "
                     "deeper target)")
    if not fit.resolved:
        notes.append(f"steps did not fall with B over the batches fitted (B_crit below {min(batches)})"
                     if fit.b_crit == 0 else f"steps fell as 1/B over every batch fitted (B_crit above {max(batches)})")
    return notes


# --- the two estimates side by side ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Verdict:
    law: Law | None
    trusted: str            # "branches" | "noise scale" | "none"
    ratio: float | None     # b_noise / b_crit_branch
    sentence: str


def uninformative(branch: BranchFit, verdict: Verdict) -> bool:
    """The table rests on the branches, whose interval runs from 0 to inf: their point estimate says nothing
    about how many devices pay (the study's early phase at advise's defaults: 168, interval 0 to inf)."""
    return (verdict.trusted == "branches" and branch.lo is not None and branch.lo <= 0
            and (branch.hi is None or branch.hi == math.inf))


def reconcile(branch: BranchFit, b_noise: float | None, b_noise_lo: float | None = None) -> Verdict:
    """Which B_crit the table uses, and what to say when the noise scale disagrees by more than 2x.
    The branches measure the trade-off directly and win whenever they set a target; the noise scale is
    the fallback (it is McCandlish's B_crit for SGD at a tuned lr, an approximation under Adam). A branch
    estimate whose interval is wide is still the one used, and the sentence says how wide."""
    v = _reconcile(branch, b_noise, b_noise_lo)
    if v.trusted == "branches" and branch.lo is not None and not branch.reliable and not branch.firm_bound:
        hi = "inf" if branch.hi is None or branch.hi == math.inf else f"{branch.hi:.3g}"
        return dataclasses.replace(v, sentence=v.sentence + f"; but the branches' own interval is wide "
                                   f"({branch.lo:.3g}-{hi}): B_crit is not pinned down at this budget")
    return v


def _reconcile(branch: BranchFit, b_noise: float | None, b_noise_lo: float | None) -> Verdict:
    if branch.law is not None:
        bc = branch.law.b_crit
        if b_noise is None:
            bound = f" (its interval only bounds it below, ≥ {b_noise_lo:.3g})" if b_noise_lo else ""
            return Verdict(branch.law, "branches", None,
                           f"the noise scale is not resolved at this checkpoint{bound}; the branches are used")
        if bc == 0 or bc == math.inf:
            # An unresolved fit is a bound: below the smallest batch tested, or above the largest.
            bound = min(branch.fitted_batches) if bc == 0 else max(branch.fitted_batches)
            side = "below" if bc == 0 else "above"
            agrees = b_noise <= DISAGREEMENT * bound if bc == 0 else b_noise >= bound / DISAGREEMENT
            if agrees:
                return Verdict(branch.law, "branches", None,
                               f"the branches put B_crit {side} the batches fitted ({side} {bound}) and the noise "
                               f"scale ({b_noise:.3g}) agrees within {DISAGREEMENT:g}x")
            return Verdict(branch.law, "branches", None,
                           f"the branches put B_crit {side} the batches fitted ({side} {bound}) but the noise scale "
                           f"reads {b_noise:.3g}: they disagree by more than {DISAGREEMENT:g}x, and advise trusts the "
                           "branches (the noise-scale theory assumes SGD at a tuned lr; Adam, L1 and clipping break it)")
        ratio = b_noise / bc
        if ratio > DISAGREEMENT or ratio < 1 / DISAGREEMENT:
            return Verdict(branch.law, "branches", ratio,
                           f"the noise scale ({b_noise:.3g}) is {max(ratio, 1 / ratio):.1f}x "
                           f"{'above' if ratio > 1 else 'below'} the critical batch the branches measured "
                           f"({bc:.3g}): they disagree by more than {DISAGREEMENT:g}x, and advise trusts the branches "
                           "(the noise-scale theory assumes SGD at a tuned lr; Adam, L1 and clipping break it)")
        return Verdict(branch.law, "branches", ratio,
                       f"the noise scale ({b_noise:.3g}) agrees with the branches ({bc:.3g}) within {DISAGREEMENT:g}x")
    plateau = ("no branch batch made progress the validations can tell from their jitter (the checkpoint is at a "
               "plateau at this lr: B_crit is not measurable here)")
    if branch.plateau:
        if b_noise is None:
            return Verdict(None, "none", None, f"{plateau}, and the noise scale is not resolved: the table shows "
                                               "memory and speed only")
        return Verdict(Law.from_b_crit(b_noise, "noise scale"), "noise scale", None,
                       f"{plateau}; the table uses the noise scale B_noise ≈ {b_noise:.3g}, an approximation under Adam")
    if b_noise is not None:
        return Verdict(Law.from_b_crit(b_noise, "noise scale"), "noise scale", None,
                       f"the branches could not set a target ({branch.note}); the table uses the noise scale "
                       f"B_noise ≈ {b_noise:.3g}, an approximation under Adam")
    return Verdict(None, "none", None, f"neither the branches ({branch.note}) nor the noise scale resolved B_crit: "
                                       "the table shows memory and speed only")


# --- candidate settings ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Setting:
    micro: int
    accumulate: int
    world: int

    @property
    def batch(self) -> int:
        return self.micro * self.accumulate * self.world

    def label(self) -> str:
        return f"{self.micro} x {self.accumulate} x {self.world}"

    def as_json(self) -> dict:
        return {"batch_size": self.micro, "accumulate_every": self.accumulate, "world_size": self.world}


@dataclasses.dataclass(frozen=True)
class SpeedRow:
    """One micro-batch of the memory/speed sweep. samples_per_s None: it did not run (oom or skipped)."""
    micro: int
    samples_per_s: float | None
    peak_memory_mb: float | None
    oom: bool = False
    note: str = ""


@dataclasses.dataclass(frozen=True)
class Candidate:
    setting: Setting
    memory_mb: float | None
    samples_per_s: float | None   # all devices together (ideal scaling across devices: not measured)
    samples_rel: float | None     # samples to the same progress / the least over the table
    steps_rel: float | None       # optimizer steps to the same progress / the least over the table
    minutes: float | None         # wall time to the progress the current setting makes in `horizon` samples
    device_minutes: float | None  # minutes x devices
    current: bool = False

    def as_json(self) -> dict:
        return {**self.setting.as_json(), "effective_batch": self.setting.batch, "memory_mb": self.memory_mb,
                "samples_per_s": self.samples_per_s, "samples_vs_best": self.samples_rel,
                "steps_vs_best": self.steps_rel, "minutes": self.minutes, "device_minutes": self.device_minutes,
                "current": self.current}


def candidates(law: Law | None, speed: list[SpeedRow], world_sizes: Sequence[int], accumulates: Sequence[int],
               current: Setting, horizon_samples: int) -> list[Candidate]:
    """Every micro-batch that ran x accumulate_every on one device, x world size at accumulate 1, and the
    current setting.

    Minutes = the samples this setting needs for the progress the current setting makes in
    `horizon_samples` (E(B) / E(B_current) x horizon) over its samples/s. Accumulation runs at its
    micro-batch's samples/s (its memory too: it adds no activations); N devices at N x one device's."""
    ran = {r.micro: r for r in speed if r.samples_per_s}
    # On one device every accumulate_every; on more, accumulate 1 only (more devices x accumulation is
    # just a larger effective batch, already in the table at fewer devices' cost).
    settings = {Setting(m, k, 1) for m in ran for k in accumulates}
    settings |= {Setting(m, 1, w) for m in ran for w in world_sizes}
    settings.add(current)
    rows = []
    for s in sorted(settings, key=lambda s: (s.world, s.micro, s.accumulate)):
        r = ran.get(s.micro)
        rate = r.samples_per_s * s.world if r else None
        rows.append([s, r.peak_memory_mb if r else None, rate])
    if law is None:
        return [Candidate(s, mem, rate, None, None, None, None, s == current) for s, mem, rate in rows]
    e_min = min(law.samples(s.batch) for s, _, _ in rows)
    s_min = min(law.steps(s.batch) for s, _, _ in rows)
    out = []
    for s, mem, rate in rows:
        need = horizon_samples * law.samples(s.batch) / law.samples(current.batch)
        minutes = need / rate / 60 if rate else None
        out.append(Candidate(s, mem, rate, law.samples(s.batch) / e_min, law.steps(s.batch) / s_min, minutes,
                             minutes * s.world if minutes is not None else None, s == current))
    return out


def _order(c: Candidate):
    return (c.minutes, c.setting.world, c.setting.accumulate, c.setting.micro)


def recommend(table: list[Candidate], world: int | None = None) -> Candidate | None:
    """The fastest setting (least minutes) among those that spend at most DEVICE_TIME_SLACK x the least
    device-time; `world` restricts to that many devices. Without a law: the fastest micro-batch at
    accumulate 1 (accumulation never adds speed on one device)."""
    pool = [c for c in table if (world is None or c.setting.world == world)]
    timed = [c for c in pool if c.minutes is not None]
    if not timed:
        fast = [c for c in pool if c.samples_per_s and c.setting.accumulate == 1]
        return max(fast, key=lambda c: (c.samples_per_s, -c.setting.world)) if fast else None
    least = min(c.device_minutes for c in timed)
    return min((c for c in timed if c.device_minutes <= DEVICE_TIME_SLACK * least * (1 + 1e-9)), key=_order)


def devices_worth_it(table: list[Candidate]) -> int | None:
    """The most devices whose fastest setting still spends at most DEVICE_TIME_SLACK x the least device-time."""
    timed = [c for c in table if c.minutes is not None]
    if not timed:
        return None
    least = min(c.device_minutes for c in timed)
    ok = [c.setting.world for c in timed if c.device_minutes <= DEVICE_TIME_SLACK * least * (1 + 1e-9)]
    return max(ok) if ok else None


@dataclasses.dataclass(frozen=True)
class CurrentCost:
    setting: Setting
    samples_vs_accumulate_1: float | None
    steps_vs_accumulate_1: float | None
    minutes_vs_recommended: float | None
    sentence: str
    samples_vs_accumulate_1_range: tuple = (None, None)  # over the B_crit interval

    def as_json(self) -> dict:
        return {**self.setting.as_json(), "samples_vs_accumulate_1": self.samples_vs_accumulate_1,
                "samples_vs_accumulate_1_range": list(self.samples_vs_accumulate_1_range),
                "steps_vs_accumulate_1": self.steps_vs_accumulate_1,
                "minutes_vs_recommended": self.minutes_vs_recommended, "sentence": self.sentence}


def current_cost(law: Law | None, table: list[Candidate], current: Setting, best: Candidate | None,
                 interval: tuple = (None, None)) -> CurrentCost:
    """What the current accumulate_every costs against accumulate 1 at the same micro-batch and devices, at
    the B_crit used and over its interval (E(kB)/E(B) = (1 + kB/B_crit)/(1 + B/B_crit) lies between 1 and k
    whatever B_crit: on one device accumulation never saves samples)."""
    one = Setting(current.micro, 1, current.world)
    if law is None:
        return CurrentCost(current, None, None, None, "B_crit was not resolved: the samples it costs are unknown "
                           f"(between 1x and {current.accumulate}x, whatever B_crit)")
    e = law.samples(current.batch) / law.samples(one.batch)
    s = law.steps(current.batch) / law.steps(one.batch)
    ends = [Law.from_b_crit(b, law.source) for b in interval if b is not None and b > 0]
    spread = tuple(sorted(x.samples(current.batch) / x.samples(one.batch) for x in ends)) if len(ends) == 2 else (None, None)
    mine = next((c for c in table if c.setting == current), None)
    vs_best = (mine.minutes / best.minutes if mine is not None and best is not None and mine.minutes
               and best.minutes else None)
    if current.accumulate == 1:
        sentence = (f"accumulate_every 1 at micro-batch {current.micro} already takes the fewest samples at this "
                    "micro-batch")
    else:
        within = f" ({spread[0]:.2g}-{spread[1]:.2g}x over its interval)" if spread[0] is not None else ""
        sentence = (f"accumulate_every {current.accumulate} needs ~{e:.2g}x the samples of accumulate_every 1 at "
                    f"micro-batch {current.micro} at this point of training{within}, in {s:.2g}x the optimizer "
                    "steps, and runs no faster per sample on one device")
    return CurrentCost(current, e, s, vs_best, sentence, spread)
