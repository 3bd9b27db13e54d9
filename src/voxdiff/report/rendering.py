"""The comparison report: figures, tables and the plain-language reading, as Markdown."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from voxdiff.analysis.convergence import (BEST_WINDOW, PLATEAU_THRESHOLD, bootstrap_critical_batch, fit_critical_batch,
                                 FALLING, PAST_BEST, PLATEAU, target_levels)
from voxdiff.runtime.fsutil import atomic_path
from voxdiff.report.loading import RunData, as_float
from voxdiff.analysis.statistics import ALPHA, compare_means, holm, paired_ratio, welch_mde
from voxdiff.report.groups import GroupSummary, confounders, most_common_int
from voxdiff.training.gns import balanced_accumulate_every, critical_batch_tradeoff, not_measurable_reason



def noise_scale_section(groups: list[GroupSummary], runs: list[RunData], group_by: str):
    """Markdown lines, the pooled B_noise and the balanced accumulate_every (None when not measured)."""
    lines = ["## Gradient noise scale", "",
             "| setting | runs measured | B_noise (mean of last values) | range |", "|---|---|---|---|"]
    for g in groups:
        reason = _not_measurable(g)
        cell = (f"{len(g.gns)} | {np.mean(g.gns):.3g} | {min(g.gns):.3g}–{max(g.gns):.3g}" if g.gns
                else f"0 | {reason or 'not logged'} | —")
        lines.append(f"| {group_by}={g.key} | {cell} |")
    values = [v for g in groups for v in g.gns if v > 0]
    if not values:
        lines += ["", "No run measured the noise scale: it needs accumulate_every × world size > 1."]
        return lines, None, None
    b_noise = float(np.mean(values))
    micro, world = most_common_int(runs, "train.batch_size"), most_common_int(runs, "world_size") or 1
    lines += ["", f"Critical batch B_crit ≈ B_noise ≈ **{b_noise:.3g}** (mean of the last measured values of "
              f"{len(values)} run(s), range {min(values):.3g}–{max(values):.3g}; McCandlish et al. 2018)."]
    if micro is None:
        lines += ["", "The runs log no train.batch_size: cannot convert B_crit into accumulate_every."]
        return lines, b_noise, None
    k_star = balanced_accumulate_every(b_noise, micro, world)
    lines += [f"At micro-batch {micro} × world size {world}, the accumulate_every that balances steps against "
              f"samples is k* ≈ {b_noise:.3g} / {micro * world} = {b_noise / (micro * world):.3g} → "
              f"**{k_star}** (nearest power of two ≥ 1).", "",
              "Steps and samples to reach a given loss, relative to their minimum (S = S_min(1 + B_crit/B), "
              "E = E_min(1 + B/B_crit)):", "",
              "| accumulate_every | effective batch | steps / S_min | samples / E_min |", "|---|---|---|---|"]
    ks = sorted({k for g in groups if (k := as_float(g.setting["accumulate_every"])) == k} | {k_star})
    for k, t in zip(ks, critical_batch_tradeoff(b_noise, [k * micro * world for k in ks])):
        mark = " (k*)" if k == k_star else ""
        lines.append(f"| {k:g}{mark} | {t.batch:g} | {t.steps_over_min:.2f} | {t.samples_over_min:.2f} |")
    lines += ["", "B_noise grows as the loss falls, so this describes the end of these runs; the estimate is "
              "noisy (see the range). Treat k* as an order of magnitude: below it, more accumulation costs "
              "few extra samples and saves optimizer steps; above it, steps barely fall while samples grow."]
    return lines, b_noise, k_star


CRITICAL_TARGETS = 3       # val-loss levels at which B_crit is fitted
CRITICAL_BOOTSTRAP = 2000  # bootstrap resamples (runs within each effective batch) per target


# Reasonable ways to read steps-to-target off jittery validations: the validations themselves and causal rolling
# means of 3 and 5 (issue 34: at one target they gave B_crit 1.16, 2.8 and, on another grid, 0.32). The report's
# second interval is their range: how much B_crit depends on the method, which the bootstrap does not show.
CROSSING_METHODS = (1, 3, 5)


def critical_batch_section(runs: list[RunData], b_noise: float | None = None, smooth: int = 1) -> list[str]:
    """B_crit measured from steps-to-target (McCandlish et al. 2018), per target level, with a bootstrap
    interval over seeds and the range over CROSSING_METHODS; and each effective batch's plateau value and
    verdict. smooth: the method of the main figure (validations averaged, causally; 1 = none)."""
    by_batch: dict[float, list[RunData]] = {}
    for r in runs:
        b = as_float(r.params.get("effective_batch_size"))
        if r.has_val and b == b and b > 0:
            by_batch.setdefault(b, []).append(r)
    by_batch = dict(sorted(by_batch.items()))
    lines = ["## Critical batch (measured)", ""]
    if len(by_batch) < 2:
        return lines + [f"Runs at {len(by_batch)} effective batch size: fitting S = S_min(1 + B_crit/B) needs 2 "
                        "at least (and 3 to check the law's shape)."]
    every = [r for rs in by_batch.values() for r in rs]
    start, reached = min(float(r.val_loss[0]) for r in every), max(float(r.smoothed(smooth).min()) for r in every)
    targets = target_levels(start, reached, CRITICAL_TARGETS)
    lines += ["Runs grouped by effective batch B. For each target val loss, the optimizer steps S each run took to "
              "reach it (interpolated between validations) are fitted with S = S_min(1 + B_crit/B), the same "
              "law as samples E = E_min(1 + B/B_crit) since E = B·S, by least squares on log S: then the S-law "
              "and the E-law have the same residuals and give one B_crit, and the seeds' spread, roughly "
              "proportional to S, weighs alike at every B (`voxdiff.analysis.convergence`). 95 % interval: percentile "
              f"bootstrap over seeds ({CRITICAL_BOOTSTRAP} resamples of the runs within each B; with 3 seeds a B "
              "it is on the narrow side). The targets are spaced geometrically between the lowest first-validation "
              f"loss ({start:.4g}) and the highest best loss ({reached:.4g}), so every run reaches each of them "
              "after its first validation and before its budget ends; the lr is the one each run used, not tuned "
              "per B (Shallue et al. 2019), so B_crit is that of these lrs.", ""]
    if len(by_batch) == 2:
        lines += [f"**Two effective batches only** ({' and '.join(f'{b:g}' for b in by_batch)}): the law's two "
                  "parameters are determined by them exactly, so B_crit here assumes the law's shape, which these "
                  "runs cannot check (that needs a third batch size): read it as the ratio of steps S(B₁)/S(B₂) "
                  "= (1 + B_crit/B₁)/(1 + B_crit/B₂) solved for B_crit.", ""]
    if not targets:
        return lines + ["Some run never got below another's first validation loss: no target every run reaches "
                        "after its first validation; not fitted."]
    if smooth > 1:
        lines += [f"Steps-to-target read on each run's causal rolling mean of {smooth} validations (the registered "
                  "method): a validation's jitter does not decide where a run crossed.", ""]
    head = ["target val loss", *(f"S at B = {b:g}" for b in by_batch), "B_crit", "95 % interval",
            "across methods", "S_min", "E_min"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    measured = []
    for target in targets:
        steps = {b: [r.crossing(target, r.val_steps, smooth) for r in rs] for b, rs in by_batch.items()}
        fit = fit_critical_batch([b for b, v in steps.items() for _ in v], [s for v in steps.values() for s in v])
        ci = bootstrap_critical_batch(steps, n_boot=CRITICAL_BOOTSTRAP, seed=0)
        measured.append((target, steps, fit, ci))
        if fit.resolved:
            b_cell, s_cell, e_cell = f"**{fit.b_crit:.3g}**", f"{fit.s_min:.3g}", f"{fit.e_min:.3g}"
            if not min(by_batch) <= fit.b_crit <= max(by_batch):
                b_cell += " (outside the B tested: extrapolated)"
        elif fit.b_crit == math.inf:
            b_cell, s_cell, e_cell = "unresolved: ∞ (steps fall as 1/B)", "—", f"{fit.e_min:.3g}"
        else:
            b_cell, s_cell, e_cell = "unresolved: 0 (steps do not fall with B)", f"{fit.s_min:.3g}", "—"
        lines.append(f"| {target:.4g} | " + " | ".join(mean_std(v, ".0f") for v in steps.values())
                     + f" | {b_cell} | {_interval(ci, by_batch)} | {method_range(by_batch, target)} | {s_cell} | "
                     f"{e_cell} |")
    lines += ["", "McCandlish et al. (2018) find B_crit growing as the loss falls (the rows run from the highest "
              "target down). Below B_crit, doubling B nearly halves the steps at little cost in samples; above "
              "it, steps barely fall while samples grow."]
    if b_noise is not None:
        lines.append(f"The noise scale measured during training (section above) predicts B_crit ≈ {b_noise:.3g}.")
    lines += ["", "At the end of the budget, per effective batch: the plateau value (mean val loss of the "
              "validations in the last quarter of each run's steps; an upper bound where the run is still "
              "falling) and the last quarter's change and verdict (see the summary).", "",
              "| effective batch | runs | plateau value | last-quarter change | at plateau |", "|---|---|---|---|---|"]
    levels = {b: [r.plateau_level for r in rs if r.plateau_level is not None] for b, rs in by_batch.items()}
    for b, rs in by_batch.items():
        changes = [r.plateau_change for r in rs if r.plateau_change is not None]
        lines.append(f"| {b:g} | {len(rs)} | {mean_std(levels[b], '.4g', '.2g')} | {percent_cell(changes)} | "
                     f"{plateau_count([r.plateau_verdict for r in rs if r.plateau_change is not None])} |")
    # Each plateau value against the smallest batch's, with what the seeds could detect: a "no difference" there
    # is read with its minimum detectable difference.
    (b_ref, ref_levels), *others = levels.items()
    if ref_levels and any(v for _, v in others):
        lines += ["", f"Plateau values against effective batch {b_ref:g}:",
                  *_verdicts([(f"B = {b:g}", v) for b, v in others if v], f"B = {b_ref:g}", ref_levels,
                             "plateau value")]
    return lines + ["", *measured_vs_predicted(by_batch, measured)]


def method_range(by_batch: dict[float, list[RunData]], target: float) -> str:
    """B_crit's range over CROSSING_METHODS at this target (a method under which some run never reaches it is
    left out and counted)."""
    found = []
    for window in CROSSING_METHODS:
        steps = {b: [r.crossing(target, r.val_steps, window) for r in rs] for b, rs in by_batch.items()}
        if any(s is None for v in steps.values() for s in v):
            continue
        found.append(fit_critical_batch([b for b, v in steps.items() for _ in v],
                                        [s for v in steps.values() for s in v]).b_crit)
    if not found:
        return "—"
    lo, hi = min(found), max(found)
    shown = f"{_bound(lo)}–{_bound(hi)}" if lo != hi else _bound(lo)
    return shown + ("" if len(found) == len(CROSSING_METHODS) else f" ({len(found)}/{len(CROSSING_METHODS)} methods)")


PREDICTION_BAND = 1.2  # a probe counts for a target when the run's val loss there is within this factor of it


def probes_near(runs: list[RunData], level: float, band: float = PREDICTION_BAND,
                probe: str = "marginal_gns") -> list[tuple[float, float, float]]:
    """(B_simple, lo, hi) of the precise probes taken while a run's val loss was within `band` of `level`:
    B_noise belongs to a point of the loss surface, and runs at the same loss are near the same point.
    probe: "marginal_gns" (plain) or "marginal_adam" (in Adam's coordinates)."""
    found = []
    for r in runs:
        steps, value, lo, hi = getattr(r, probe)
        if not len(steps):
            continue
        loss = r.val_loss_at(steps)
        for v, a, b, l in zip(value, lo, hi, loss):
            if l == l and abs(math.log(l / level)) <= math.log(band) and v == v and v > 0:
                found.append((float(v), float(a), float(b)))
    return found


def measured_vs_predicted(by_batch: dict[float, list[RunData]], measured: list) -> list[str]:
    """Per target (early targets first): B_crit measured from steps-to-target beside B_simple predicted by
    the precise probe at the same val loss, their ratio, and where in training the smallest batch reached
    the target; then the probes at the runs' plateau, where steps-to-target cannot measure B_crit."""
    every = [r for rs in by_batch.values() for r in rs]
    if not any(len(r.marginal_gns[0]) for r in every):
        return ["No run here logged the precise noise-scale probe (`gns_marginal`): no prediction to set "
                "against the measured B_crit."]
    small = by_batch[min(by_batch)]
    budget = float(np.mean([r.val_steps[-1] for r in small]))
    adam = any(len(r.marginal_adam[0]) for r in every)
    lines = ["## Critical batch: measured against predicted", "",
             "B_crit measured (table above, 95 % bootstrap interval over seeds) against the noise scale B_simple "
             "= tr(Σ)/|G|² that McCandlish et al. (2018) predict it by, from the precise probe (`gns_marginal`, "
             "marginal over timesteps, its own interval) taken while a run's val loss was within "
             f"{PREDICTION_BAND:g}× of the target: the median of those probes, and the span of their intervals "
             "(the lowest lower bound to the highest upper bound). Phase: where the smallest batch reached the "
             f"target, as a share of its {budget:.0f} steps (early, middle, late: thirds). The prediction holds "
             "when the ratio lies within 2×."
             + (" Adam: the same probe in Adam's whitened coordinates, tr(PΣ)/GᵀPG with P = 1/(√v̂ + ε) from the "
                "optimizer's state (`gns_marginal_adam`; McCandlish et al.'s B_simple assumes plain SGD), from the "
                "runs that logged it." if adam else ""), "",
             "| target val loss | phase (B = " + f"{min(by_batch):g})" + " | B_crit measured [95 %] | probes | "
             "B_simple predicted [span] | measured / predicted | within 2× |"
             + (" Adam: probes | B_simple, Adam [span] | measured / Adam | within 2× |" if adam else ""),
             "|---|---|---|---|---|---|---|" + ("---|---|---|---|" if adam else "")]
    for target, steps, fit, ci in measured:
        at = [s for s in steps[min(by_batch)] if s is not None]
        share = float(np.mean(at)) / budget if at and budget > 0 else math.nan
        phase = f"{phase_of(share, 1.0)} ({100 * share:.0f} %)" if share == share else "—"
        b_cell = (f"{fit.b_crit:.3g} [{_interval(ci, by_batch)}]" if fit.resolved
                  else f"{'∞' if fit.b_crit == math.inf else '0'} (unresolved) [{_interval(ci, by_batch)}]")
        lines.append(f"| {target:.4g} | {phase} | {b_cell} | " + _prediction_cells(every, target, fit)
                     + (" | " + _prediction_cells(every, target, fit, "marginal_adam") if adam else "") + " |")
    plateau = [r.plateau_level for r in small if r.plateau_level is not None]
    if plateau:
        level = float(np.mean(plateau))
        lines.append(f"| plateau of B = {min(by_batch):g} ({level:.4g}) | late | not measurable (the loss no longer "
                     "falls: steps-to-target are the noise's) | " + _prediction_cells(every, level, None)
                     + (" | " + _prediction_cells(every, level, None, "marginal_adam") if adam else "") + " |")
    return lines


def _prediction_cells(runs: list[RunData], level: float, fit, probe: str = "marginal_gns") -> str:
    near = probes_near(runs, level, probe=probe)
    if not near:
        return "0 | no probe at this loss | — | —"
    values = np.array([v for v, _, _ in near])
    lo = [a for _, a, _ in near if a == a]
    hi = [b for _, _, b in near if b == b]
    pred = float(np.median(values))
    span = f"[{min(lo):.3g}–{max(hi):.3g}]" if lo and hi and len(hi) == len(near) else \
        f"[{min(lo) if lo else 0:.3g}–unresolved]"
    if fit is None or not fit.resolved:
        return f"{len(near)} | {pred:.3g} {span} | — | —"
    ratio = fit.b_crit / pred
    verdict = "yes" if 0.5 <= ratio <= 2 else f"no ({ratio:.3g}×)" if ratio > 1 else f"no (1/{1 / ratio:.3g}×)"
    return f"{len(near)} | {pred:.3g} {span} | {ratio:.3g} | {verdict}"


def _bound(v: float) -> str:
    return "∞" if v == math.inf else f"{v:.3g}"


def _interval(ci, by_batch: dict) -> str:
    """The bootstrap interval over seeds, or why there is none: with one run at a batch size every
    resample is that run, and the 'interval' would be the point itself, a precision nobody measured."""
    if min(len(rs) for rs in by_batch.values()) < 2:
        return "none: one run at a B"
    return f"{_bound(ci.lo)}–{_bound(ci.hi)}"


def _not_measurable(g: GroupSummary) -> str | None:
    k, w = as_float(g.setting["accumulate_every"]), as_float(g.setting["world size"])
    return not_measurable_reason(int(k), int(w) if w == w else 1) if k == k else None


def reading_section(groups: list[GroupSummary], runs: list[RunData], group_by: str, target: float | None):
    measured = [g for g in groups if g.n]
    lines = ["## Reading", ""]
    if not measured:
        return lines + ["No group logged a validation loss: nothing to compare."]
    best = min(measured, key=lambda g: np.mean(g.final_val))
    lines.append(f"- Lowest final val loss: **{group_by}={best.key}** ({mean_std(best.final_val, '.4g', '.2g')}, "
                 f"{best.n} seed(s)).")
    lines += _verdicts([(f"{group_by}={g.key}", g.final_val) for g in measured if g is not best],
                       f"{group_by}={best.key}", best.final_val, "final val loss")
    reached = [g for g in measured if g.reached == g.n]
    if target is not None and len(reached) > 1:
        fastest = min(reached, key=lambda g: np.mean(g.samples_to_target))
        lines.append(f"- Fewest samples to reach val loss {target:.4g}: **{group_by}={fastest.key}** "
                     f"({mean_std(fastest.samples_to_target, '.0f')}).")
        lines += _verdicts([(f"{group_by}={g.key}", g.samples_to_target) for g in reached if g is not fastest],
                           f"{group_by}={fastest.key}", fastest.samples_to_target, "samples to target")
    falling = [g for g in measured if g.still_falling]
    if falling:
        lines.append(f"- Still falling at the end of the budget (last quarter down by {100 * PLATEAU_THRESHOLD:g} % "
                     "or more) in " + ", ".join(f"{group_by}={g.key} ({g.still_falling}/{len(g.plateau)} "
                                                f"runs, {percent_cell(g.plateau)})" for g in falling)
                     + ": their final val loss is where the budget stopped them, not where they converge.")
    rising = [g for g in measured if g.past_best]
    if rising:
        lines.append(f"- Past their best at the end of the budget (last quarter up by more than {100 * PLATEAU_THRESHOLD:g} %, "
                     f"or settled more than {100 * PLATEAU_THRESHOLD:g} % above their own best) in "
                     + ", ".join(f"{group_by}={g.key} ({g.past_best}/{len(g.plateau)} "
                                 "runs)" for g in rising)
                     + ": past their lowest val loss (over-fitting or a spike), so their final val loss is above "
                     "their plateau's level; compare them at their own best (the table \"At each setting's own "
                     "best\") and at the best post-hoc EMA.")
    budgets = sorted({r.metrics["total_samples"] for r in runs if r.has_val and "total_samples" in r.metrics})
    if len(budgets) > 1:  # a step budget gives larger effective batches more samples: final losses not comparable
        lines.append(f"- Runs saw different numbers of samples ({budgets[0]:.0f}–{budgets[-1]:.0f}): final val "
                     "losses are not at equal data; prefer the samples-to-target comparison.")
    scaling = sorted({r.params.get("train.lr_scaling", "?") for r in runs})
    if scaling == ["none"]:
        lines.append("- All runs used lr_scaling=none: the lr is the same for every setting, so a larger "
                     "effective batch makes fewer updates of the same size per sample seen. Linear or sqrt "
                     "scaling can change this answer.")
    elif len(scaling) == 1:
        lines.append(f"- All runs used lr_scaling={scaling[0]}: the lr grows with the effective batch.")
    lines += ["", f"\"Clearly\" means Welch's t-test over seeds (scipy, two-sided) rejects equal means at "
              f"{ALPHA:g} after a Holm correction over the comparisons of the same list; samples to target "
              "are interpolated between validations. Results hold for this budget, data and lr."]
    return lines


def _verdicts(items: list[tuple[str, list[float]]], ref: str, ref_values: list[float], what: str) -> list[str]:
    tests = [compare_means(values, ref_values) for _, values in items]
    adjusted = holm([p for _, _, p in tests])
    return ["- " + _verdict(name, ref, values, (kind, diff, p), what, ref_values)
            for (name, values), (kind, diff, _), p in zip(items, tests, adjusted)]


def _verdict(name: str, ref: str, values: list[float], test: tuple[str, float, float | None], what: str,
             ref_values: list[float]) -> str:
    kind, diff, p = test
    word = "higher" if diff > 0 else "lower"
    head = f"{name}: {what} {mean_std(values, '.4g', '.2g')}"
    if kind == "unreplicated":
        return (f"{head}, {abs(diff):.3g} {word} than {ref}, but unreplicated (a single seed on one side): "
                "run more seeds before reading anything into it.")
    if p < ALPHA:
        return f"{head}, clearly {word} than {ref} (difference {abs(diff):.3g}, Welch p = {p:.2g} after Holm)."
    mde = welch_mde(values, ref_values)
    return (f"{head}: within seed noise of {ref} (difference {abs(diff):.3g}, Welch p = {p:.2g} after Holm; "
            + (f"these seeds could not detect a difference below {100 * mde:.0f} % of {ref}'s mean, at 80 % power)."
               if mde is not None else "no minimum detectable difference: one side has a single run)."))


def mean_band(curves: list[tuple[np.ndarray, np.ndarray]]):
    """Mean, min and max over runs on the x range all runs cover (union of their x values); None if none."""
    lo, hi = max(x[0] for x, _ in curves), min(x[-1] for x, _ in curves)
    if lo > hi:
        return None
    grid = np.unique(np.concatenate([x[(x >= lo) & (x <= hi)] for x, _ in curves]))
    ys = np.array([np.interp(grid, x, y) for x, y in curves])
    return grid, ys.mean(0), ys.min(0), ys.max(0)


def plot_curves(groups: dict[str, list[RunData]], group_by: str, x_of, y_of, xlabel: str, ylabel: str,
                path: Path) -> Path | None:
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas for savefig

    fig = Figure(figsize=(7.5, 4.5), dpi=120, layout="constrained")
    ax = fig.subplots()
    drawn, positive = False, True
    for key, runs in groups.items():
        curves = [(x_of(r), y_of(r)) for r in runs]
        curves = [(x, y) for x, y in curves if len(x) and not np.isnan(x).any()]
        if not curves:
            continue
        label = f"{group_by}={key} (n={len(curves)})"
        band = mean_band(curves)
        if band is None:  # no common x range (e.g. wall times far apart): draw each run
            color = ax.plot(*curves[0], label=label + ", no overlap")[0].get_color()
            for x, y in curves[1:]:
                ax.plot(x, y, color=color)
            lo = np.concatenate([y for _, y in curves])
        else:
            x, mean, lo, hi = band
            line, = ax.plot(x, mean, marker="." if len(x) < 30 else None, label=label)
            if len(curves) > 1:
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
        drawn, positive = True, positive and bool((lo > 0).all())
    if not drawn:
        return None
    low, high = ax.dataLim.y0, ax.dataLim.y1
    if positive and high > 3 * low:  # log only when the curves span a wide range: readable ticks otherwise
        ax.set_yscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel, title=f"{ylabel} vs {xlabel} (mean over seeds, band = min–max)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path


def make_figures(groups: dict[str, list[RunData]], group_by: str, out_path: Path) -> list[Path]:
    stem = out_path.with_suffix("")
    specs = [
        ("val_loss_vs_steps", lambda r: r.val_steps, lambda r: r.val_loss, "optimizer steps", "val loss"),
        ("val_loss_vs_samples", lambda r: r.val_samples, lambda r: r.val_loss, "samples seen", "val loss"),
        ("val_loss_vs_wall_time", lambda r: r.val_wall, lambda r: r.val_loss, "wall time (s)", "val loss"),
        ("gns_vs_samples", lambda r: r.gns_samples, lambda r: r.gns, "samples seen", "gradient noise scale"),
    ]
    paths = [plot_curves(groups, group_by, x_of, y_of, xlabel, ylabel, Path(f"{stem}_{name}.png"))
             for name, x_of, y_of, xlabel, ylabel in specs]
    paths.append(plot_bucket_gns(groups, group_by, Path(f"{stem}_gns_buckets_vs_samples.png")))
    return [p for p in paths if p is not None]


def percent_cell(changes: list[float]) -> str:
    """Relative changes as 'mean ± std %' over runs ('—' for none)."""
    cell = mean_std([100 * c for c in changes], "+.1f", ".1f")
    return cell if cell == "—" else f"{cell} %"


def plateau_count(verdicts: list[str]) -> str:
    """'k/n': runs at their plateau (convergence.plateau_verdict: one past its best is not) out of those whose
    last quarter could be measured."""
    return f"{verdicts.count(PLATEAU)}/{len(verdicts)}" if verdicts else "—"


def summary_table(groups: list[GroupSummary], group_by: str) -> list[str]:
    head = ("| setting | micro-batch | accumulate_every | effective batch | lr | seeds | final val loss | steps "
            "to target | samples to target | time to target (s) | total wall time (s) | peak memory (MB) | "
            "val flattening | last-quarter change | at plateau |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for g in groups:
        s = g.setting
        stats = (f"{mean_std(g.final_val, '.4g', '.2g')} | {reached_cell(g.steps_to_target, g, '.0f')} | "
                 f"{reached_cell(g.samples_to_target, g, '.0f')} | {reached_cell(g.time_to_target, g, '.1f')} | "
                 f"{mean_std(g.total_wall_time, '.1f')} | {mean_std(g.peak_memory_mb, '.0f')} | "
                 f"{mean_std(g.flattening, '.2f')} | {percent_cell(g.plateau)} | {plateau_count(g.verdicts)}"
                 if g.n else "no val_loss | — | — | — | — | — | — | — | —")
        lines.append(f"| {group_by}={g.key} | {s['micro-batch']} | {s['accumulate_every']} | "
                     f"{s['effective batch']} | {s['lr']} | {g.n} | {stats} |")
    return lines


# Sample quality a reader compares across settings, in this order; the rest (per-tissue means,
# Wasserstein distances, timings) stays in each run's metrics/eval_detail.json and MLflow run.
EVAL_COLUMNS = (("eval_ssim", "SSIM"), ("eval_ssim_floor_tissue_mean", "SSIM floor: tissue mean"),
                ("eval_ssim_floor_noise", "SSIM floor: noise"), ("eval_psnr", "PSNR (dB)"),
                ("eval_psnr_floor_tissue_mean", "PSNR floor: tissue mean"), ("eval_mae", "MAE"),
                ("eval_mae_floor_tissue_mean", "MAE floor: tissue mean"), ("eval_msssim_samples",
                "MS-SSIM between samples (1 = identical)"), ("eval_contrast_ratio", "contrast ratio"),
                ("eval_beats_floors", "runs beating both floors"),
                ("eval_dice_fidelity_mean", "Dice: label fidelity"),
                ("eval_dice_fidelity_mean_ceiling", "Dice: real volumes"),
                ("eval_dice_tstr_ratio", "Dice: trained on synthetic / on real"))


def eval_cell(key: str, values: list[float]) -> str:
    """'k/n' runs for the beats-the-floors flag; one value where every run has the same (a floor that
    depends on the data only would otherwise read '0.192 ± 3.4e-17'); mean ± std otherwise."""
    if key == "eval_beats_floors" and values:
        return f"{sum(v >= 0.5 for v in values)}/{len(values)}"
    if len(values) > 1 and np.ptp(values) <= 1e-9 * max(1.0, abs(float(np.mean(values)))):
        return format(float(values[0]), ".4g")
    return mean_std(values, ".4g", ".2g")


def eval_table(groups: list[GroupSummary], group_by: str) -> list[str]:
    present = {k for g in groups for k in g.eval}
    columns = [(k, name) for k, name in EVAL_COLUMNS if k in present]
    if not columns:
        return []
    lines = ["## Sample quality", "",
             "Evaluation of each run's EMA model (DDIM samples for the validation label maps) against the real "
             "volumes, inside the brain, next to the two floors every model should beat: the tissue-mean "
             "image (each class's mean intensity) and noise. Mean ± std over seeds; a value without ± is the "
             "same in every run (the tissue-mean floor depends on the data only). Dice (evaluation/segmenter.py): segmenters "
             "trained on the real volumes segment the samples, scored against the label maps they were generated from, "
             "beside the same segmenters on the real volumes; and a segmenter trained on synthetic volumes against one "
             "trained on real ones, both tested on the real validation volumes.", "",
             "| setting | " + " | ".join(name for _, name in columns) + " |", "|---|" + "---|" * len(columns)]
    for g in groups:
        cells = (eval_cell(k, g.eval.get(k, [])) for k, _ in columns)
        lines.append(f"| {group_by}={g.key} | " + " | ".join(cells) + " |")
    return lines + [""]


def posthoc_table(groups: list[GroupSummary], group_by: str) -> list[str]:
    """Val loss at each reconstructed EMA length (post-hoc EMA, EDM2) and at the best one, per setting,
    next to the fixed EMA's: whether a setting's rank depends on the EMA length chosen in advance."""
    with_phema = [g for g in groups if g.posthoc.get("phema_best_val_loss")]
    if not with_phema:
        return []
    lengths = sorted({k for g in with_phema for k in g.posthoc if k.startswith("phema_val_loss_sr")})
    head = ["setting", "runs", "fixed EMA: final val loss", "fixed EMA's sigma_rel", "best post-hoc val loss",
            "best sigma_rel", *(f"sigma_rel {int(k[-3:]) / 1000:g}" for k in lengths)]
    lines = ["## Post-hoc EMA", "",
             "Val loss of the EMA reconstructed after training at several lengths (sigma_rel: the EMA "
             "profile's std relative to the run's length; Karras et al. 2024) from the power-function "
             "profiles tracked during the run. Only runs that tracked them are counted here.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in with_phema:
        p = g.posthoc
        lines.append(" | ".join([
            f"| {group_by}={g.key}", str(len(p["phema_best_val_loss"])), mean_std(p["fixed_ema_final_val_loss"], ".4g", ".2g"),
            mean_std(p.get("ema_sigma_rel", []), ".3f"), mean_std(p["phema_best_val_loss"], ".4g", ".2g"),
            mean_std(p.get("phema_best_sigma_rel", []), ".3f"),
            *(mean_std(p.get(k, []), ".4g", ".2g") for k in lengths)]) + " |")
    best = min(with_phema, key=lambda g: np.mean(g.posthoc["phema_best_val_loss"]))
    lines += ["", f"- Lowest val loss at the best post-hoc EMA: **{group_by}={best.key}** "
              f"({mean_std(best.posthoc['phema_best_val_loss'], '.4g', '.2g')})."]
    lines += _verdicts([(f"{group_by}={g.key}", g.posthoc["phema_best_val_loss"]) for g in with_phema
                        if g is not best], f"{group_by}={best.key}", best.posthoc["phema_best_val_loss"],
                       "best post-hoc val loss")
    return lines + [""]


def best_table(groups: list[GroupSummary], group_by: str) -> list[str]:
    """Each setting at its own convergence: every run's lowest val loss (convergence.best_point) and the
    steps, samples and wall time it took to get there, as early stopping would keep it; the settings'
    levels compared by Welch over seeds, except a setting whose level is only a bound (a run still at its
    lowest at its end could have gone lower)."""
    with_best = [g for g in groups if g.best]
    if not with_best:
        return []
    lines = ["## At each setting's own best (early stopping)", "",
             f"Each run's lowest val loss, read as the lowest mean of {BEST_WINDOW} consecutive validations (the "
             "single lowest validation is biased low by the jitter: it picks the deepest dip), and the optimizer "
             "steps, samples and wall time at that window's centre: the settings compared at their own "
             "convergence, as a user who stops each at its best would. Lowest before the end: runs whose lowest "
             "window came before their last one (k/n; on a flat, jittery plateau that is chance, not a rise: the "
             "runs table's verdict says which rose); in the others the loss was lowest at the end, so their level "
             f"is an upper bound and their cost a lower bound. Runs with fewer than {BEST_WINDOW} validations are "
             "left out (runs: k/n).", "",
             "| setting | runs | lowest val loss | steps at it | samples at it | wall time at it (s) | lowest before the end |",
             "|---|---|---|---|---|---|---|"]

    def cell(values: list[float], spec: str, n: int) -> str:  # k/n when some runs lack the value
        finite = [v for v in values if not math.isnan(v)]
        return mean_std(finite, spec) + ("" if len(finite) == n else f" ({len(finite)}/{n})")

    for g in with_best:
        n = len(g.best)
        runs = str(n) if n == g.n else f"{n}/{g.n}"
        lines.append(f"| {group_by}={g.key} | {runs} | {mean_std([b.level for b in g.best], '.4g', '.2g')} | "
                     f"{cell([b.steps for b in g.best], '.0f', n)} | {cell([b.samples for b in g.best], '.0f', n)} | "
                     f"{cell([b.wall for b in g.best], '.0f', n)} | {sum(not b.at_end for b in g.best)}/{n} |")
    levels = {g.key: [b.level for b in g.best] for g in with_best}
    lowest = min(with_best, key=lambda g: np.mean(levels[g.key]))
    lines += ["", f"- Lowest val loss at its own best: **{group_by}={lowest.key}** "
              f"({mean_std(levels[lowest.key], '.4g', '.2g')})."]
    bounded = [g for g in with_best if g is not lowest and any(b.at_end for b in g.best)]
    lines += _verdicts([(f"{group_by}={g.key}", levels[g.key]) for g in with_best
                        if g is not lowest and g not in bounded],
                       f"{group_by}={lowest.key}", levels[lowest.key], "lowest val loss")
    lines += [f"- {group_by}={g.key}: lowest val loss {mean_std(levels[g.key], '.4g', '.2g')}, but "
              f"{sum(b.at_end for b in g.best)}/{len(g.best)} of its runs were still at their lowest at the end: "
              "an upper bound on its best, not compared." for g in bounded]
    return lines + paired_lines(with_best, group_by) + [""]


def paired_lines(groups: list[GroupSummary], group_by: str) -> list[str]:
    """Each setting against the first, paired by seed (statistics.paired_ratio): the draws depend only on the
    seed and the global sample index, so two settings of one seed saw the same samples and the pair's ratio
    carries no between-seed spread. Level, samples and steps at the own best; the minimum detectable
    difference beside the level's verdict."""
    ref = groups[0]
    out = []
    for g in groups[1:]:
        level = paired_ratio(g.best_by_seed("level"), ref.best_by_seed("level"))
        if level is None or level.n < 2:
            continue
        samples = paired_ratio(g.best_by_seed("samples"), ref.best_by_seed("samples"))
        steps = paired_ratio(g.best_by_seed("steps"), ref.best_by_seed("steps"))
        verdict = (f"clearly {'higher' if level.ratio > 1 else 'lower'} (paired t p = {level.p:.2g})"
                   if level.p is not None and level.p < ALPHA else
                   f"no difference detected (paired t p = {level.p:.2g}; the smallest these {level.n} pairs could "
                   f"detect: {100 * level.mde:.1f} % at 80 % power, alpha 0.05)")
        out.append(f"- Paired by seed, {group_by}={g.key} against {group_by}={ref.key} ({level.n} seeds ran both): "
                   f"lowest val loss x{level.ratio:.3f} [{level.lo:.3f}, {level.hi:.3f}], {verdict}; samples to it "
                   f"x{samples.ratio:.2f} [{samples.lo:.2f}, {samples.hi:.2f}], optimizer steps x{steps.ratio:.2f} "
                   f"[{steps.lo:.2f}, {steps.hi:.2f}] (geometric means, 95 % t intervals).")
    return out


def runs_table(groups: dict[str, list[RunData]], group_by: str) -> list[str]:
    lines = ["## Runs", "", "| setting | run id | seed | DVC experiment | final val loss | last-quarter change "
             "| at plateau |", "|---|---|---|---|---|---|---|"]
    for key, runs in groups.items():
        for r in runs:
            final = f"{r.final_val_loss:.4g}" if r.has_val else "no val_loss"
            change = r.plateau_change
            verdict = {None: "—", PLATEAU: "yes", FALLING: "no: still falling",
                       PAST_BEST: "no: past its best"}[r.plateau_verdict]
            lines.append(f"| {group_by}={key} | {r.run_id} | {r.params.get('seed', '?')} | "
                         f"{r.tags.get('voxdiff.dvc_exp_name', '')} | {final} | "
                         f"{'—' if change is None else f'{100 * change:+.1f} %'} | {verdict} |")
    return lines


def short_filter(filter_string: str) -> str:
    """The filter as a reader wants it: a long run-id list shown by its count."""
    import re

    def count(m):
        n = len(re.findall(r"'[^']*'", m.group(1)))
        return m.group(0) if n <= 3 else f"{m.group(0)[:m.group(0).index('(')]}({n} run ids)"
    return re.sub(r"attributes\.run_id\s+in\s*\(([^)]*)\)", count, filter_string, flags=re.I)


def render_report(*, experiment: str, source: str, group_by: str, filter_string: str | None,
                  groups: list[GroupSummary], by_key: dict[str, list[RunData]], runs: list[RunData],
                  target: float | None, target_given: bool, figures: list[Path], messages: list[str],
                  noise_lines: list[str], reading_lines: list[str], critical_lines: list[str] = ()) -> str:
    where = f", filter `{short_filter(filter_string)}`" if filter_string else ""
    lines = [f"# How `{group_by}` changes convergence", "",
             f"Experiment `{experiment}`{where}: {len(runs)} finished training run(s) in {len(groups)} group(s).",
             "", f"Source: {source}.", ""]
    if messages:
        lines += ["**Warnings**", "", *(f"- {m}" for m in messages), ""]
    lines += ["## Validation loss", ""] + [f"![{p.stem}]({p.name})" for p in figures if "val_loss" in p.name]
    lines += ["", "Curves: mean over seeds; shaded band: min–max over seeds.", "", "## Summary per setting", ""]
    if target is None:
        lines.append("No validation loss logged: no target level.")
    else:
        how = ("given by the user" if target_given
               else "the highest of the runs' best val losses, a level every run reached")
        lines.append(f"Target val loss **{target:.4g}** ({how}). Steps/samples/time to target: where the val "
                     "curve first reaches it, interpolated between validations, mean ± std over the runs that "
                     "reached it (k/n when not all did). Last-quarter change: the relative change of a "
                     "least-squares line through the validations in the last quarter of the run's optimizer steps "
                     "(slope × window / the line's value at its start; mean ± std over seeds); a run is **at "
                     f"plateau** when that line fell by less than {100 * PLATEAU_THRESHOLD:g} % (k/n runs). Val "
                     "flattening, the older criterion (the last quarter's val-loss gain over the first quarter's), "
                     "is kept for reference: it can pass runs that still fall 10 % per quarter.")
    lines += ["", *summary_table(groups, group_by), "", *best_table(groups, group_by), *eval_table(groups, group_by),
              *posthoc_table(groups, group_by), *noise_lines]
    lines += ["", *(f"![{p.stem}]({p.name})" for p in figures if "gns" in p.name)]
    if critical_lines:
        lines += ["", *critical_lines]
    lines += ["", *reading_lines, "", *runs_table(by_key, group_by), ""]
    return "\n".join(lines)


def messages_for(groups: list[GroupSummary], runs: list[RunData], group_by: str, unfinished: str | None,
                 reruns: str | None = None) -> list[str]:
    msgs = [m for m in (unfinished, reruns) if m]
    for g in groups:
        if g.missing_val:
            which = "its" if len(g.missing_val) == len(g.run_ids) else f"{len(g.missing_val)} of its"
            msgs.append(f"{group_by}={g.key}: no val_loss logged in {which} {len(g.run_ids)} run(s) "
                        f"({', '.join(i[:8] for i in g.missing_val)}); left out of curves and statistics")
    for k, vals in confounders(runs, group_by).items():
        msgs.append(f"runs also differ in {k} ({', '.join(vals)}): differences may not be due to {group_by} alone")
    return msgs


def mean_std(values: list[float], spec: str, std_spec: str | None = None) -> str:
    """'mean ± std' (sample std over runs), just the value for one run, '—' for none."""
    if not values:
        return "—"
    mean = format(float(np.mean(values)), spec)
    if len(values) == 1:
        return mean
    return f"{mean} ± {format(float(np.std(values, ddof=1)), std_spec or spec)}"


def reached_cell(values: list[float], g: GroupSummary, spec: str) -> str:
    """A to-target statistic, marked k/n when only k of the group's n runs reached the target."""
    if g.n == 0:
        return "—"
    if g.reached == 0:
        return "not reached"
    cell = mean_std(values, spec)
    return cell if g.reached == g.n else f"{cell} ({g.reached}/{g.n})"


# --- noise scale per timestep bucket --------------------------------------------------------------
PHASES = ("early", "middle", "late")


def phase_of(samples: float, total: float) -> str:
    """early / middle / late: the thirds of a run's budget (probes at 1/3, 2/3 and the end fall one in each)."""
    return PHASES[min(2, max(0, math.ceil(3 * samples / total - 1e-9) - 1))] if total > 0 else PHASES[-1]


def run_budget(r: RunData) -> float:
    return float(r.metrics.get("total_samples") or (r.val_samples[-1] if len(r.val_samples) else 0.0))


def bucket_phase_values(runs: list[RunData], bucket: str) -> dict[str, list[float]]:
    """Per phase (third of each run's budget), the runs' B_simple of one bucket: the last probe in that
    third. A probe whose |G|^2 estimate was not positive logged no value, and leaves its phase out."""
    out = {p: [] for p in PHASES}
    for r in runs:
        samples, values = r.bucket_gns.get(bucket, ((), ()))
        total = run_budget(r)
        last: dict[str, float] = {}
        for x, v in zip(samples, values):
            if np.isfinite(v):
                last[phase_of(float(x), total)] = float(v)
        for phase, v in last.items():
            out[phase].append(v)
    return out


def phase_section(by_key: dict[str, list[RunData]], group_by: str) -> list[str]:
    """The noise scale's prediction against the measurement, per phase of training: the k* the
    largest bucket B_simple implies, next to the setting with the lowest val loss at the end of that
    phase (equal samples seen, interpolated between validations)."""
    runs = [r for rs in by_key.values() for r in rs if r.has_val]
    if not runs or not any(r.bucket_gns for r in runs) or len(by_key) < 2:
        return []
    budget = min(run_budget(r) for r in runs)
    micro = most_common_int(runs, "train.batch_size") or 1
    buckets = sorted({b for r in runs for b in r.bucket_gns}, key=lambda b: int(b[5:]))
    lines = ["## Prediction against measurement, per phase", "",
             f"Per third of the budget ({budget:.0f} samples): the largest per-bucket B_simple over all runs here, "
             "whatever their setting (B_noise is a property of the loss surface at that point), and the "
             f"accumulate_every it implies at micro-batch {micro} (k* = B / micro-batch, next power of two), "
             "against the setting with the lowest val loss at the phase's end (mean over seeds). The mean over "
             "runs is the prediction; the median is a robustness check, since one run's noisy probe (a |G|² "
             "estimate near zero) can move the mean by orders of magnitude.", "",
             f"| phase | samples | largest bucket B_simple: mean / median | predicted k*: mean / median | "
             f"best {group_by} measured | val loss per setting |", "|---|---|---|---|---|---|"]
    by_bucket = {b: bucket_phase_values(runs, b) for b in buckets}
    for i, phase in enumerate(PHASES):
        at = budget * (i + 1) / 3
        b_mean, b_median = (max((float(f(v[phase])) for v in by_bucket.values() if v[phase]), default=float("nan"))
                            for f in (np.mean, np.median))
        k_mean, k_median = (balanced_accumulate_every(b, micro, 1) if b > 0 else "—" for b in (b_mean, b_median))
        val = {key: [float(np.interp(at, r.val_samples, r.val_loss)) for r in rs if r.has_val]
               for key, rs in by_key.items()}
        val = {k: v for k, v in val.items() if v}
        best = min(val, key=lambda k: np.mean(val[k]))
        cells = ", ".join(f"{k}: {mean_std(v, '.4g', '.2g')}" for k, v in val.items())
        lines.append(f"| {phase} | {at:.0f} | {b_mean:.3g} / {b_median:.3g} | {k_mean} / {k_median} | {best} | {cells} |")
    return lines + [""]


def bucket_section(by_key: dict[str, list[RunData]], group_by: str) -> list[str]:
    """B_simple per timestep bucket, early / middle / late in training, and the accumulate_every each
    implies at the runs' micro-batch (k* = B / micro-batch, nearest power of two)."""
    buckets = sorted({b for runs in by_key.values() for r in runs for b in r.bucket_gns},
                     key=lambda b: int(b[5:]))
    if not buckets:
        return []
    lines = ["## Noise scale per timestep bucket", "",
             "B_simple from single-sample gradients on fixed probe draws per bucket of the noise schedule "
             "(t0 = least noise), at the last probe in each third of the run (early, middle, late); mean ± std "
             "over seeds (a probe whose |G|² estimate was not positive is left out), "
             "and the accumulate_every it implies at the runs' micro-batch (k*).", "",
             "| setting | bucket | early | middle | late | k* early → late |", "|---|---|---|---|---|---|"]
    for key, runs in by_key.items():
        micro = most_common_int(runs, "train.batch_size") or 1
        for b in buckets:
            phases = bucket_phase_values(runs, b)
            if not any(phases.values()):
                continue
            ks = [balanced_accumulate_every(float(np.mean(v)), micro, 1) if v and np.mean(v) > 0 else None
                  for v in (phases["early"], phases["late"])]
            k_text = " → ".join("—" if k is None else str(k) for k in ks)
            lines.append(f"| {group_by}={key} | {b[4:]} | " + " | ".join(mean_std(phases[p], ".3g") for p in PHASES)
                         + f" | {k_text} |")
    return lines + [""]


def plot_bucket_gns(by_key: dict[str, list[RunData]], group_by: str, path: Path) -> Path | None:
    from matplotlib.figure import Figure

    buckets = sorted({b for runs in by_key.values() for r in runs for b in r.bucket_gns}, key=lambda b: int(b[5:]))
    if not buckets:
        return None
    fig = Figure(figsize=(3.2 * len(buckets), 3.6), dpi=110, layout="constrained")
    axes = fig.subplots(1, len(buckets), squeeze=False)[0]
    for ax, b in zip(axes, buckets):
        for key, runs in by_key.items():
            curves = [r.bucket_gns[b] for r in runs if b in r.bucket_gns and len(r.bucket_gns[b][0])]
            curves = [(x, y) for x, y in curves if np.isfinite(y).all()]
            band = mean_band(curves) if curves else None
            if band is not None:
                x, mean, lo, hi = band
                line, = ax.plot(x, mean, marker=".", label=f"{group_by}={key}")
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.set(title=f"bucket {b[4:]}", xlabel="samples seen")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("B_simple")
    axes[0].legend(fontsize="x-small")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    return path
