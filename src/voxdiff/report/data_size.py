"""The data-size arm's answer (docs/study/data-size-protocol.md): per training-set size N, accumulate_every k against
1 paired by seed at each run's own best, and the critical batch against N, read by the registered method.

    python -m voxdiff.report.data_size docs/study/runs docs/study/report_data_size.md

Everything here was fixed before the runs: the targets (1.20x, 1.10x and 1.05x the mean own-best level of k 1 at
that N), steps-to-target on the causal rolling mean of 3 validations (every run validates on one grid in samples),
a bootstrap over seeds resampled as pairs (a seed's k runs share their draws), and the method range as a second
interval.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from voxdiff.analysis.convergence import bootstrap_critical_batch, fit_critical_batch
from voxdiff.report.loading import RunData, as_float, read_archive
from voxdiff.report.rendering import CROSSING_METHODS, mean_std
from voxdiff.analysis.statistics import paired_ratio
from voxdiff.report.groups import run_best

TARGET_FACTORS = (1.20, 1.10, 1.05)
SMOOTH = 3
BOOTSTRAP = 2000
# The registered sample-size rule (data-size-protocol.md, amended before any N = 160 run): the largest N's k 2 / k 1
# comparison starts with PAIRS_FIRST pairs (seeds 0..4); while the MDE from their own sd(r) exceeds MDE_GOAL, one
# more pair (the next seed) is added, up to PAIRS_MAX. It reads sd(r) only, never the ratio or its p value.
MDE_GOAL, PAIRS_FIRST, PAIRS_MAX, PAIRS_RULE_N, PAIRS_RULE_K = 0.05, 5, 8, 160, 2


def pairs_wanted(level_k: dict, level_1: dict) -> int:
    """How many pairs (seeds 0..n-1, as ints) the rule asks for, given the own-best levels archived so far (seed ->
    level, for k and for 1). Pairs are counted from seed 0 up to the first seed that lacks one of its two runs."""
    n = 0
    while n in level_k and n in level_1:
        n += 1
    if n < PAIRS_FIRST:
        return PAIRS_FIRST
    if n >= PAIRS_MAX:
        return n
    mde = paired_ratio({s: level_k[s] for s in range(n)}, {s: level_1[s] for s in range(n)}).mde
    return n + 1 if mde is not None and mde > MDE_GOAL else n


def sample_size_line(level, wanted: int) -> str:
    """Where the registered rule stands: more pairs asked for, the goal met, or missed at the rule's most pairs."""
    mde = f"MDE {100 * level.mde:.1f} % at {level.n} pairs"
    # (a pair missing below the highest seed: the rule counts pairs from seed 0 up to it and asks for that seed)
    if wanted > level.n or (level.mde > MDE_GOAL and level.n < PAIRS_MAX):
        return (f"  - Sample size (registered rule): {mde}, goal {100 * MDE_GOAL:.0f} %; the rule asks for "
                f"{wanted} pairs, seeds 0-{wanted - 1} (`make study` queues what is missing).")
    if level.mde <= MDE_GOAL:
        return f"  - Sample size (registered rule): {mde}: the goal of {100 * MDE_GOAL:.0f} % is met."
    return (f"  - Sample size (registered rule): {mde}: the goal of {100 * MDE_GOAL:.0f} % is missed at the rule's "
            f"most pairs ({PAIRS_MAX}).")


def levels_by_seed(seeds: dict[str, RunData]) -> dict[int, float]:
    """seed (int) -> the run's own-best level (run_best), for the runs that have one."""
    return {int(s): b.level for s, r in seeds.items() if s.isdigit() and (b := run_best(r)) is not None}


def is_data_size_run(r: RunData) -> bool:
    """A run of the data-size arm: a training subset of the 336-subject set, epsilon-prediction, stopped by the
    protocol's early stopping. The LR pilot (ds-lr: the same data, a fixed 8192-sample budget, no early stopping) is
    not one: it would stand in for a seed's k 1 run."""
    return (r.params.get("data.train_subjects", "0") not in ("0", "?") and r.params.get("data.subjects") == "336"
            and r.params.get("diffusion.prediction") == "epsilon"
            and r.params.get("train.early_stop_patience_samples", "0") not in ("0", "?"))


def by_size(runs: list[RunData]) -> dict[int, dict[int, dict[str, RunData]]]:
    """N -> k -> seed -> run."""
    out: dict[int, dict[int, dict[str, RunData]]] = {}
    for r in runs:
        n, k = int(as_float(r.params["data.train_subjects"])), int(as_float(r.params.get("train.accumulate_every", "1")))
        out.setdefault(n, {}).setdefault(k, {}).setdefault(r.params.get("seed", "?"), r)
    return {n: dict(sorted(ks.items())) for n, ks in sorted(out.items())}


def paired_bcrit(by_k: dict[int, dict[str, RunData]], target: float, smooth: int = SMOOTH,
                 n_boot: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float, float] | None:
    """B_crit at `target` from steps-to-target on the runs' smoothed curves, and a bootstrap interval over seeds
    resampled as pairs (the seeds every k ran). None when a run never reaches the target (censored)."""
    seeds = sorted(set.intersection(*(set(v) for v in by_k.values())))
    if len(by_k) < 2 or not seeds:
        return None
    steps = {k: [by_k[k][s].crossing(target, by_k[k][s].val_steps, smooth) for s in seeds] for k in by_k}
    if any(v is None for vs in steps.values() for v in vs):
        return None
    if len(seeds) < 2 or n_boot == 0:
        return fit_critical_batch([k for k in steps for _ in seeds], [v for vs in steps.values() for v in vs]).b_crit, \
            math.nan, math.nan
    return tuple(bootstrap_critical_batch(steps, n_boot=n_boot, seed=seed, paired=True))


def method_spread(by_k: dict[int, dict[str, RunData]], target: float) -> tuple[float, float] | None:
    found = [r[0] for w in CROSSING_METHODS if (r := paired_bcrit(by_k, target, w, n_boot=0)) is not None]
    return (min(found), max(found)) if found else None


def _fmt(v: float) -> str:
    return "∞" if v == math.inf else ("—" if v != v else f"{v:.3g}")


def interval(fit: tuple[float, float, float] | None) -> str:
    """The bootstrap interval, or why there is none (one seed a side: nothing to resample)."""
    if not fit:
        return "—"
    return "none (one seed)" if fit[1] != fit[1] else f"{_fmt(fit[1])}–{_fmt(fit[2])}"


def report(runs: list[RunData]) -> tuple[list[str], dict[int, list[tuple[float, float, float, float]]]]:
    """The report's lines, and N -> [(target, B_crit, lo, hi)] for the figure."""
    sizes = by_size([r for r in runs if is_data_size_run(r)])
    lines = ["# Data size: accumulate_every against training-set size (med-ddpm's regime)", "",
             "Protocol, registered before the runs: [data-size-protocol.md](data-size-protocol.md). Own best = the "
             "lowest centred mean of 5 validations; a run still at its lowest at its end (at cap) gives a bound.", ""]
    if not sizes:
        return lines + ["No data-size runs archived yet."], {}
    lines += ["## Each setting at its own best", "",
              "| N | k | runs | lowest val loss | samples at it | steps at it | lowest before the end | SSIM (best) "
              "| label-map Dice GM / WM (between training subjects) |", "|---|---|---|---|---|---|---|---|---|"]
    for n, ks in sizes.items():
        for k, seeds in ks.items():
            best = [b for r in seeds.values() if (b := run_best(r)) is not None]
            ssim = [r.metrics["eval_ssim"] for r in seeds.values() if "eval_ssim" in r.metrics]
            dice = [(r.metrics.get("data_pairwise_dice_label2"), r.metrics.get("data_pairwise_dice_label3"))
                    for r in seeds.values()]
            gm, wm = ([d[i] for d in dice if d[i] is not None] for i in (0, 1))
            lines.append(f"| {n} | {k} | {len(seeds)} | {mean_std([b.level for b in best], '.4g', '.2g')} | "
                         f"{mean_std([b.samples for b in best], '.0f')} | {mean_std([b.steps for b in best], '.0f')} | "
                         f"{sum(not b.at_end for b in best)}/{len(best)} | {mean_std(ssim, '.3f')} | "
                         f"{mean_std(gm, '.2f')} / {mean_std(wm, '.2f')} |")
    lines += ["", "## k against 1, paired by seed", ""]
    for n, ks in sizes.items():
        ref = ks.get(1)
        for k, seeds in ks.items():
            if ref is None or k == 1:
                continue
            best = {s: run_best(r) for s, r in seeds.items()}
            base = {s: run_best(r) for s, r in ref.items()}
            field = lambda d, f: {s: getattr(b, f) for s, b in d.items() if b is not None}  # noqa: E731
            level = paired_ratio(field(best, "level"), field(base, "level"))
            if level is None:
                continue
            samples = paired_ratio(field(best, "samples"), field(base, "samples"))
            steps = paired_ratio(field(best, "steps"), field(base, "steps"))
            if level.n < 2:
                lines.append(f"- N {n}, k {k}: one pair so far (level x{level.ratio:.3f}); no test yet.")
                continue
            verdict = (f"p = {level.p:.2g}" + (f"; no difference detected, the smallest these {level.n} pairs could "
                                               f"detect is {100 * level.mde:.1f} %" if level.p >= 0.05 else ""))
            lines.append(f"- N {n}, k {k} against k 1 ({level.n} pairs): lowest val loss x{level.ratio:.3f} "
                         f"[{level.lo:.3f}, {level.hi:.3f}] ({verdict}); samples to it x{samples.ratio:.2f} "
                         f"[{samples.lo:.2f}, {samples.hi:.2f}], optimizer steps x{steps.ratio:.2f} "
                         f"[{steps.lo:.2f}, {steps.hi:.2f}].")
            if n == PAIRS_RULE_N and k == PAIRS_RULE_K:
                lines.append(sample_size_line(level, pairs_wanted(levels_by_seed(seeds), levels_by_seed(ref))))
    lines += ["", "## Critical batch against N", "",
              f"Steps to each target on the causal rolling mean of {SMOOTH} validations; 95 % bootstrap over seeds "
              "resampled as pairs; the range over reading the validations raw and with rolling means of 3 and 5. "
              "A target some run never reached is censored (—).", "",
              "| N | target (x k 1's best) | val loss | B_crit | 95 % interval | across methods |", "|---|---|---|---|---|---|"]
    curve: dict[int, list[tuple[float, float, float, float]]] = {}
    for n, ks in sizes.items():
        if len(ks) < 2 or 1 not in ks:
            continue
        base = [b.level for r in ks[1].values() if (b := run_best(r)) is not None]
        for factor in TARGET_FACTORS:
            target = factor * float(np.mean(base))
            fit = paired_bcrit(ks, target)
            spread = method_spread(ks, target)
            if fit is not None:
                curve.setdefault(n, []).append((factor, *fit))
            lines.append(f"| {n} | {factor:.2f} | {target:.4g} | {_fmt(fit[0]) if fit else '—'} | "
                         f"{interval(fit)} | "
                         f"{_fmt(spread[0]) + '–' + _fmt(spread[1]) if spread else '—'} |")
    return lines + [""], curve


def figure(curve: dict[int, list[tuple[float, float, float, float]]], path: Path) -> Path | None:
    """B_crit against N, one line per target, with the bootstrap intervals."""
    if not curve:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4))
    for factor in TARGET_FACTORS:
        pts = [(n, b, lo, hi) for n, rows in curve.items() for f, b, lo, hi in rows
               if f == factor and math.isfinite(b) and b > 0]
        if not pts:
            continue
        n, b, lo, hi = (np.array(v, float) for v in zip(*pts))
        err = np.vstack([b - np.where(np.isfinite(lo), lo, b), np.where(np.isfinite(hi), hi, b) - b])
        ax.errorbar(n, b, yerr=np.clip(err, 0, None), marker="o", capsize=3, label=f"target {factor:.2f}x k 1's best")
    ax.set(xscale="log", yscale="log", xlabel="training subjects N", ylabel="B_crit (samples per step)",
           title="Critical batch against training-set size")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    runs_dir, out = Path(argv[1]), Path(argv[2])
    runs, _ = read_archive(runs_dir)
    lines, curve = report(runs)
    png = figure(curve, out.with_name(out.stem + "_bcrit.png"))
    if png is not None:
        lines += [f"![B_crit against N]({png.name})", ""]
    out.write_text("\n".join(lines))
    print(f"report: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
