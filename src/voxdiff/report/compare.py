"""voxdiff compare: how does one param (default train.accumulate_every) change convergence?

Reads the training runs that the trainer logged to MLflow, groups them by the param, and writes a
Markdown report with figures: validation loss against optimizer steps, samples seen and wall time;
a table per setting; the measured gradient noise scale and the accumulate_every it implies; and a
plain-language reading that only calls a difference real when the seeds' spread supports it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from pathlib import Path

import click
import numpy as np

from voxdiff.errors import VoxdiffError
from voxdiff.fsutil import atomic_path, repo_root, write_text
from voxdiff.training.gns import balanced_accumulate_every, critical_batch_tradeoff, not_measurable_reason

TRAIN_KIND = "train"
CURVE_KEYS = ("val_loss", "samples_seen", "wall_time", "gns", "peak_memory_mb")
# Params that follow from the grouped one or differ on purpose between seeds: not confounders.
EXPECTED_TO_VARY = {"seed", "effective_batch_size", "effective_lr"}
MAX_TAG_CHARS = 8000  # MLflow's limit on a tag value


# --- data ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class RunData:
    run_id: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float]  # latest value of every metric
    val_steps: np.ndarray
    val_loss: np.ndarray
    val_samples: np.ndarray    # samples seen at each validation
    val_wall: np.ndarray       # wall time (s) at each validation, NaN when not logged
    gns_samples: np.ndarray
    gns: np.ndarray
    peak_memory_mb: float

    @property
    def has_val(self) -> bool:
        return len(self.val_loss) > 0

    @property
    def final_val_loss(self) -> float:
        return self.metrics.get("final_val_loss", float(self.val_loss[-1]))

    def first_reaching(self, target: float) -> int | None:
        """Index of the first validation at or below target."""
        hits = np.flatnonzero(self.val_loss <= target)
        return int(hits[0]) if len(hits) else None

    def crossing(self, target: float, x: np.ndarray) -> float | None:
        """Where (in x: steps, samples or seconds) the val curve first reaches target, linearly
        interpolated between the two validations around the crossing: a sparser validation cadence
        would otherwise round the answer up to its next validation."""
        i = self.first_reaching(target)
        if i is None:
            return None
        if i == 0 or self.val_loss[i - 1] == self.val_loss[i] or math.isnan(x[i - 1]):
            return float(x[i])  # NaN when x is unknown there (e.g. no wall time logged)
        frac = (self.val_loss[i - 1] - target) / (self.val_loss[i - 1] - self.val_loss[i])
        return float(x[i - 1] + frac * (x[i] - x[i - 1]))


@dataclasses.dataclass
class GroupSummary:
    key: str
    run_ids: list[str]
    missing_val: list[str]            # runs of this group without any val_loss
    setting: dict[str, str]           # micro-batch, accumulate_every, effective batch, lr, world size
    seeds: list[str]
    final_val: list[float]
    reached: int                      # runs whose val loss reached the target
    steps_to_target: list[float]      # one per run that reached the target
    samples_to_target: list[float]
    time_to_target: list[float]
    total_wall_time: list[float]
    peak_memory_mb: list[float]
    gns: list[float]                  # last measured value per run
    eval: dict[str, list[float]]

    @property
    def n(self) -> int:
        return len(self.final_val)


@dataclasses.dataclass
class CompareResult:
    report_path: Path
    figure_paths: list[Path]
    group_by: str
    groups: list[GroupSummary]
    target_val_loss: float | None
    b_noise: float | None
    balanced_accumulate_every: int | None
    messages: list[str]
    compare_run_id: str | None

    def terminal_table(self) -> str:
        head = ["setting", "seeds", "final val loss", "steps→target", "samples→target", "time→target s",
                "B_noise"]
        rows = [[g.key, str(g.n), _mean_std(g.final_val, ".4g", ".2g") if g.n else "no val_loss",
                 _reached(g.steps_to_target, g, ".0f"), _reached(g.samples_to_target, g, ".0f"),
                 _reached(g.time_to_target, g, ".1f"), _mean_std(g.gns, ".3g")] for g in self.groups]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        target = "—" if self.target_val_loss is None else f"{self.target_val_loss:.4g}"
        return "\n".join([f"{self.group_by}   (target val loss {target})", line(head),
                          *(line(r) for r in rows)])


# --- reading MLflow -----------------------------------------------------------------------------------
def open_client(tracking_uri: str):
    """An MlflowClient, refusing to create an empty SQLite database where none exists."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri[len("sqlite:///"):])
        if not db.is_file():
            raise VoxdiffError(f"no MLflow database at {db} (tracking URI {tracking_uri}); "
                               "train first or pass --tracking-uri")
    from mlflow import MlflowClient  # slow import: only when needed

    return MlflowClient(tracking_uri)


def find_training_runs(client, experiment: str, filter_string: str | None, tracking_uri: str):
    """Finished training runs of the experiment, and a message about unfinished ones left out."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise VoxdiffError(f"MLflow experiment {experiment!r} not found at {tracking_uri}")
    query = f"tags.`voxdiff.kind` = '{TRAIN_KIND}'" + (f" and {filter_string}" if filter_string else "")
    runs, token = [], None
    try:
        while True:
            page = client.search_runs([exp.experiment_id], query, order_by=["attributes.start_time ASC"],
                                      page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
    except MlflowException as e:
        raise VoxdiffError(f"invalid --filter {filter_string!r}: {str(e).splitlines()[0]}") from None
    # A running or failed run has a partial curve: its "final" numbers would mislead.
    finished = [r for r in runs if r.info.status == "FINISHED"]
    unfinished = [f"{r.info.run_id[:8]} ({r.info.status})" for r in runs if r.info.status != "FINISHED"]
    if not finished:
        where = f" matching {filter_string!r}" if filter_string else ""
        raise VoxdiffError(f"no finished training runs in MLflow experiment {experiment!r}{where} "
                           f"at {tracking_uri}")
    note = (f"left out {len(unfinished)} unfinished run(s): {', '.join(unfinished)}" if unfinished else None)
    return exp, finished, note


def _history(client, run_id: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    by_step: dict[int, float] = {}
    for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
        by_step[m.step] = m.value  # the last value logged at a step wins (a resumed run re-logs it)
    steps = sorted(by_step)
    return np.array(steps, float), np.array([by_step[s] for s in steps], float)


def _at_steps(curve: tuple[np.ndarray, np.ndarray], steps: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    xs, ys = curve
    return np.interp(steps, xs, ys) if len(xs) else fallback


def load_run(client, run) -> RunData:
    rid, logged = run.info.run_id, run.data.metrics
    empty = (np.array([]), np.array([]))
    hist = {k: _history(client, rid, k) if k in logged else empty for k in CURVE_KEYS}
    steps, val = hist["val_loss"]
    batch = _float(run.data.params.get("effective_batch_size"))
    gns_steps, gns = hist["gns"]
    memory = hist["peak_memory_mb"][1]
    return RunData(
        run_id=rid, params=dict(run.data.params), tags=dict(run.data.tags), metrics=dict(logged),
        val_steps=steps, val_loss=val,
        val_samples=_at_steps(hist["samples_seen"], steps, steps * batch),
        val_wall=_at_steps(hist["wall_time"], steps, np.full(len(steps), np.nan)),
        gns_samples=_at_steps(hist["samples_seen"], gns_steps, gns_steps * batch), gns=gns,
        peak_memory_mb=float(memory.max()) if len(memory) else math.nan)


# --- grouping and statistics ----------------------------------------------------------------------
def group_runs(runs: list[RunData], group_by: str) -> dict[str, list[RunData]]:
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.params.get(group_by, "(unset)"), []).append(r)
    numeric = all(_float(k) == _float(k) for k in groups)  # NaN != NaN for non-numbers
    order = sorted(groups, key=lambda k: (_float(k), k) if numeric else (0.0, k))
    return {k: groups[k] for k in order}


def default_target(runs: list[RunData]) -> float | None:
    """The highest of the runs' best val losses: a level every run reached."""
    bests = [float(r.val_loss.min()) for r in runs if r.has_val]
    return max(bests) if bests else None


def summarize_group(key: str, runs: list[RunData], target: float | None) -> GroupSummary:
    with_val = [r for r in runs if r.has_val]
    hits = [r for r in with_val if target is not None and r.first_reaching(target) is not None]
    evals = sorted({k for r in with_val for k in r.metrics if k.startswith("eval_")})
    return GroupSummary(
        key=key, run_ids=[r.run_id for r in runs], missing_val=[r.run_id for r in runs if not r.has_val],
        setting={name: _distinct(runs, p) for name, p in (
            ("micro-batch", "train.batch_size"), ("accumulate_every", "train.accumulate_every"),
            ("effective batch", "effective_batch_size"), ("lr", "effective_lr"), ("world size", "world_size"))},
        seeds=[r.params.get("seed", "?") for r in with_val],
        final_val=[r.final_val_loss for r in with_val],
        reached=len(hits),
        steps_to_target=[r.crossing(target, r.val_steps) for r in hits],
        samples_to_target=[r.crossing(target, r.val_samples) for r in hits],
        time_to_target=[t for r in hits if not math.isnan(t := r.crossing(target, r.val_wall))],
        total_wall_time=[t for r in with_val
                         if not math.isnan(t := r.metrics.get("total_wall_time", float(r.val_wall[-1])))],
        peak_memory_mb=[r.peak_memory_mb for r in with_val if not math.isnan(r.peak_memory_mb)],
        gns=[float(r.gns[-1]) for r in with_val if len(r.gns)],
        eval={k: [r.metrics[k] for r in with_val if k in r.metrics] for k in evals},
    )


def confounders(runs: list[RunData], group_by: str) -> dict[str, list[str]]:
    """Params other than the grouped one (and seed) that differ between runs."""
    keys = {k for r in runs for k in r.params} - EXPECTED_TO_VARY - {group_by}
    values = {k: sorted({r.params.get(k, "(unset)") for r in runs}) for k in sorted(keys)}
    return {k: v for k, v in values.items() if len(v) > 1}


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


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm-Bonferroni adjusted p-values (None stays None): the verdicts of one report section are a
    family of tests against the same best setting, so each is corrected for the others."""
    idx = sorted((i for i, p in enumerate(pvalues) if p is not None), key=lambda i: pvalues[i])
    m, out, running = len(idx), list(pvalues), 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


# --- noise scale ----------------------------------------------------------------------------------
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
    micro, world = _most_common_int(runs, "train.batch_size"), _most_common_int(runs, "world_size") or 1
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
    ks = sorted({k for g in groups if (k := _float(g.setting["accumulate_every"])) == k} | {k_star})
    for k, t in zip(ks, critical_batch_tradeoff(b_noise, [k * micro * world for k in ks])):
        mark = " (k*)" if k == k_star else ""
        lines.append(f"| {k:g}{mark} | {t.batch:g} | {t.steps_over_min:.2f} | {t.samples_over_min:.2f} |")
    lines += ["", "B_noise grows as the loss falls, so this describes the end of these runs; the estimate is "
              "noisy (see the range). Treat k* as an order of magnitude: below it, more accumulation costs "
              "few extra samples and saves optimizer steps; above it, steps barely fall while samples grow."]
    return lines, b_noise, k_star


def _not_measurable(g: GroupSummary) -> str | None:
    k, w = _float(g.setting["accumulate_every"]), _float(g.setting["world size"])
    return not_measurable_reason(int(k), int(w) if w == w else 1) if k == k else None


# --- reading --------------------------------------------------------------------------------------
def reading_section(groups: list[GroupSummary], runs: list[RunData], group_by: str, target: float | None):
    measured = [g for g in groups if g.n]
    lines = ["## Reading", ""]
    if not measured:
        return lines + ["No group logged a validation loss: nothing to compare."]
    best = min(measured, key=lambda g: np.mean(g.final_val))
    lines.append(f"- Lowest final val loss: **{group_by}={best.key}** ({_mean_std(best.final_val, '.4g', '.2g')}, "
                 f"{best.n} seed(s)).")
    lines += _verdicts([(f"{group_by}={g.key}", g.final_val) for g in measured if g is not best],
                       f"{group_by}={best.key}", best.final_val, "final val loss")
    reached = [g for g in measured if g.reached == g.n]
    if target is not None and len(reached) > 1:
        fastest = min(reached, key=lambda g: np.mean(g.samples_to_target))
        lines.append(f"- Fewest samples to reach val loss {target:.4g}: **{group_by}={fastest.key}** "
                     f"({_mean_std(fastest.samples_to_target, '.0f')}).")
        lines += _verdicts([(f"{group_by}={g.key}", g.samples_to_target) for g in reached if g is not fastest],
                           f"{group_by}={fastest.key}", fastest.samples_to_target, "samples to target")
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
    return ["- " + _verdict(name, ref, values, (kind, diff, p), what)
            for (name, values), (kind, diff, _), p in zip(items, tests, adjusted)]


def _verdict(name: str, ref: str, values: list[float], test: tuple[str, float, float | None], what: str) -> str:
    kind, diff, p = test
    word = "higher" if diff > 0 else "lower"
    head = f"{name}: {what} {_mean_std(values, '.4g', '.2g')}"
    if kind == "unreplicated":
        return (f"{head}, {abs(diff):.3g} {word} than {ref}, but unreplicated (a single seed on one side): "
                "run more seeds before reading anything into it.")
    if p < ALPHA:
        return f"{head}, clearly {word} than {ref} (difference {abs(diff):.3g}, Welch p = {p:.2g} after Holm)."
    return f"{head}: within seed noise of {ref} (difference {abs(diff):.3g}, Welch p = {p:.2g} after Holm)."


# --- figures ----------------------------------------------------------------------------------------
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
    return [p for p in paths if p is not None]


# --- report ---------------------------------------------------------------------------------------
def summary_table(groups: list[GroupSummary], group_by: str) -> list[str]:
    head = ("| setting | micro-batch | accumulate_every | effective batch | lr | seeds | final val loss | steps "
            "to target | samples to target | time to target (s) | total wall time (s) | peak memory (MB) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for g in groups:
        s = g.setting
        stats = (f"{_mean_std(g.final_val, '.4g', '.2g')} | {_reached(g.steps_to_target, g, '.0f')} | "
                 f"{_reached(g.samples_to_target, g, '.0f')} | {_reached(g.time_to_target, g, '.1f')} | "
                 f"{_mean_std(g.total_wall_time, '.1f')} | {_mean_std(g.peak_memory_mb, '.0f')}"
                 if g.n else "no val_loss | — | — | — | — | —")
        lines.append(f"| {group_by}={g.key} | {s['micro-batch']} | {s['accumulate_every']} | "
                     f"{s['effective batch']} | {s['lr']} | {g.n} | {stats} |")
    return lines


def eval_table(groups: list[GroupSummary], group_by: str) -> list[str]:
    keys = sorted({k for g in groups for k in g.eval})
    if not keys:
        return []
    lines = ["## Evaluation", "", "| setting | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for g in groups:
        cells = (_mean_std(g.eval.get(k, []), ".4g", ".2g") for k in keys)
        lines.append(f"| {group_by}={g.key} | " + " | ".join(cells) + " |")
    return lines + [""]


def runs_table(groups: dict[str, list[RunData]], group_by: str) -> list[str]:
    lines = ["## Runs", "", "| setting | run id | seed | DVC experiment | final val loss |",
             "|---|---|---|---|---|"]
    for key, runs in groups.items():
        for r in runs:
            final = f"{r.final_val_loss:.4g}" if r.has_val else "no val_loss"
            lines.append(f"| {group_by}={key} | {r.run_id} | {r.params.get('seed', '?')} | "
                         f"{r.tags.get('voxdiff.dvc_exp_name', '')} | {final} |")
    return lines


def render_report(*, experiment: str, tracking_uri: str, group_by: str, filter_string: str | None,
                  groups: list[GroupSummary], by_key: dict[str, list[RunData]], runs: list[RunData],
                  target: float | None, target_given: bool, figures: list[Path], messages: list[str],
                  noise_lines: list[str], reading_lines: list[str]) -> str:
    where = f", filter `{filter_string}`" if filter_string else ""
    lines = [f"# How `{group_by}` changes convergence", "",
             f"Experiment `{experiment}` at `{tracking_uri}`{where}: {len(runs)} finished training run(s) "
             f"in {len(groups)} group(s).", ""]
    if messages:
        lines += ["**Warnings**", "", *(f"- {m}" for m in messages), ""]
    lines += ["## Validation loss", ""] + [f"![{p.stem}]({p.name})" for p in figures if "val_loss" in p.name]
    lines += ["", "Curves: mean over seeds; shaded band: min–max over seeds.", "", "## Summary per setting", ""]
    if target is None:
        lines.append("No validation loss logged: no target level.")
    else:
        how = ("given by the user" if target_given
               else "the highest of the runs' best val losses, a level every run reached")
        lines.append(f"Target val loss **{target:.4g}** ({how}). Steps/samples/time to target: first validation "
                     "at or below it, mean ± std over the runs that reached it (k/n when not all did).")
    lines += ["", *summary_table(groups, group_by), "", *eval_table(groups, group_by), *noise_lines]
    lines += ["", *(f"![{p.stem}]({p.name})" for p in figures if "gns" in p.name)]
    lines += ["", *reading_lines, "", *runs_table(by_key, group_by), ""]
    return "\n".join(lines)


def log_report(client, experiment_id: str, group_by: str, filter_string: str | None, target: float | None,
               run_ids: list[str], files: list[Path]) -> str:
    """Log the report and figures as their own MLflow run; return its id."""
    from mlflow.entities import Param

    ids = ",".join(run_ids)
    if len(ids) > MAX_TAG_CHARS:  # the report itself lists every run
        ids = ids[:MAX_TAG_CHARS - 20].rsplit(",", 1)[0] + ",...(see report)"
    run = client.create_run(experiment_id, run_name=f"compare {group_by}",
                            tags={"voxdiff.kind": "compare", "voxdiff.compared_runs": ids})
    rid = run.info.run_id
    try:
        client.log_batch(rid, params=[Param("group_by", group_by), Param("filter", filter_string or ""),
                                      Param("target_val_loss", "" if target is None else f"{target:.6g}")])
        for f in files:
            client.log_artifact(rid, str(f))
    except Exception:
        client.set_terminated(rid, "FAILED")
        raise
    client.set_terminated(rid, "FINISHED")
    return rid


def compare_runs(tracking_uri: str, experiment: str, out_path: str | os.PathLike,
                 group_by: str = "train.accumulate_every", filter_string: str | None = None,
                 target_val_loss: float | None = None, log: bool = True) -> CompareResult:
    """Write the comparison report (Markdown + PNGs next to it); log it to MLflow unless log=False."""
    out_path = Path(out_path)
    client = open_client(tracking_uri)
    exp, found, unfinished_note = find_training_runs(client, experiment, filter_string, tracking_uri)
    runs = [load_run(client, r) for r in found]
    by_key = group_runs(runs, group_by)
    target = target_val_loss if target_val_loss is not None else default_target(runs)
    groups = [summarize_group(k, rs, target) for k, rs in by_key.items()]
    messages = _messages(groups, runs, group_by, unfinished_note)
    noise_lines, b_noise, k_star = noise_scale_section(groups, runs, group_by)
    figures = make_figures(by_key, group_by, out_path)
    text = render_report(experiment=experiment, tracking_uri=tracking_uri, group_by=group_by,
                         filter_string=filter_string, groups=groups, by_key=by_key, runs=runs, target=target,
                         target_given=target_val_loss is not None, figures=figures, messages=messages,
                         noise_lines=noise_lines, reading_lines=reading_section(groups, runs, group_by, target))
    write_text(out_path, text)
    run_id = (log_report(client, exp.experiment_id, group_by, filter_string, target,
                         [r.run_id for r in runs], [out_path, *figures]) if log else None)
    return CompareResult(out_path, figures, group_by, groups, target, b_noise, k_star, messages, run_id)


def _messages(groups: list[GroupSummary], runs: list[RunData], group_by: str, unfinished: str | None) -> list[str]:
    msgs = [unfinished] if unfinished else []
    for g in groups:
        if g.missing_val:
            which = "its" if len(g.missing_val) == len(g.run_ids) else f"{len(g.missing_val)} of its"
            msgs.append(f"{group_by}={g.key}: no val_loss logged in {which} {len(g.run_ids)} run(s) "
                        f"({', '.join(i[:8] for i in g.missing_val)}); left out of curves and statistics")
    for k, vals in confounders(runs, group_by).items():
        msgs.append(f"runs also differ in {k} ({', '.join(vals)}): differences may not be due to {group_by} alone")
    return msgs


# --- formatting helpers ---------------------------------------------------------------------------
def _float(s) -> float:
    try:
        return float(s)
    except (TypeError, ValueError):
        return math.nan


def _distinct(runs: list[RunData], param: str) -> str:
    return "/".join(sorted({r.params.get(param, "?") for r in runs}))


def _most_common_int(runs: list[RunData], param: str) -> int | None:
    values = [int(v) for r in runs if (v := _float(r.params.get(param))) == v]
    return Counter(values).most_common(1)[0][0] if values else None


def _mean_std(values: list[float], spec: str, std_spec: str | None = None) -> str:
    """'mean ± std' (sample std over runs), just the value for one run, '—' for none."""
    if not values:
        return "—"
    mean = format(float(np.mean(values)), spec)
    if len(values) == 1:
        return mean
    return f"{mean} ± {format(float(np.std(values, ddof=1)), std_spec or spec)}"


def _reached(values: list[float], g: GroupSummary, spec: str) -> str:
    """A to-target statistic, marked k/n when only k of the group's n runs reached the target."""
    if g.n == 0:
        return "—"
    if g.reached == 0:
        return "not reached"
    cell = _mean_std(values, spec)
    return cell if g.reached == g.n else f"{cell} ({g.reached}/{g.n})"


# --- CLI --------------------------------------------------------------------------------------------
@click.command("compare")
@click.option("--experiment", default=None, help="MLflow experiment [default: params.yaml mlflow.experiment].")
@click.option("--tracking-uri", default=None,
              help="MLflow tracking URI [default: MLFLOW_TRACKING_URI, else params.yaml, else <repo>/mlflow.db].")
@click.option("--group-by", default="train.accumulate_every", show_default=True, help="Param to group runs by.")
@click.option("--filter", "filter_string", default=None,
              help="Extra MLflow filter, e.g. \"params.`train.lr_scaling` = 'none'\".")
@click.option("--target-val-loss", type=float, default=None,
              help="Val loss level for steps/samples-to-target [default: the highest best val loss over runs].")
@click.option("--out", "out_path", default="reports/compare.md", show_default=True,
              type=click.Path(dir_okay=False),
              help="Markdown report; figures are written next to it.")
@click.option("--no-log", is_flag=True, help="Do not log the report to MLflow.")
def compare_command(experiment, tracking_uri, group_by, filter_string, target_val_loss, out_path, no_log):
    """Compare training runs grouped by a param: convergence curves, noise scale, a reading."""
    if experiment is None or tracking_uri is None:
        from voxdiff.tracking.uri import resolve_tracking_uri

        params = _load_params_if_present()
        if experiment is None:
            if params is None:
                raise VoxdiffError("no --experiment given and no params.yaml found to read mlflow.experiment from")
            experiment = params.mlflow.experiment
        tracking_uri = tracking_uri or resolve_tracking_uri(params, _root())
    result = compare_runs(tracking_uri, experiment, out_path, group_by, filter_string, target_val_loss,
                          log=not no_log)
    click.echo(result.terminal_table())
    for m in result.messages:
        click.echo(f"warning: {m}", err=True)
    if result.balanced_accumulate_every is not None:
        click.echo(f"noise scale B_noise ≈ {result.b_noise:.3g} → balanced accumulate_every ≈ "
                   f"{result.balanced_accumulate_every}")
    click.echo(f"report: {result.report_path}" + (f" (MLflow run {result.compare_run_id})"
                                                   if result.compare_run_id else ""))


def _root() -> Path:
    return Path(os.environ.get("DVC_ROOT") or repo_root())


def _load_params_if_present():
    from voxdiff import params

    path = _root() / "params.yaml"
    return params.load(path) if path.is_file() else None
