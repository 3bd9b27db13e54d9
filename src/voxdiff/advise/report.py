"""What `voxdiff advise` writes: Markdown, JSON (finite numbers or null, never NaN) and one figure next to
each other, and its own MLflow run tagged with the training run it advises on."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from voxdiff.advise.fit import BranchCurve, BranchFit, Candidate, CurrentCost, Setting, SpeedRow, Verdict
from voxdiff.runtime.fsutil import atomic_path, write_text
from voxdiff.tracking.runs import end_with_batch


@dataclasses.dataclass
class Advice:
    """Everything advise measured and concluded (the JSON is this, flattened for readers)."""
    source: str                   # the checkpoint (or warm-up) advised on
    checkpoint: dict              # step, samples seen, MLflow run id, effective batch it trained at
    device: str
    precision: str
    current: Setting
    horizon_samples: int
    speed: list[SpeedRow]
    noise: object                 # measure.NoiseReading
    plan: object                  # measure.BranchPlan
    curves: list[BranchCurve]
    branch: BranchFit
    verdict: Verdict
    table: list[Candidate]
    recommended: Candidate | None
    recommended_one_device: Candidate | None
    devices_worth_it: int | None
    cost: CurrentCost
    sentence: str
    seconds: dict                 # phase -> wall seconds
    training_samples: int         # samples through forward+backward (sweep, probe passes, branches)
    validation_draws: int
    notes: list[str]
    files: list = dataclasses.field(default_factory=list)   # what write_outputs wrote
    run_id: str | None = None                                # its MLflow run

    @property
    def b_noise(self):
        return self.noise.marginal


def finite(x):
    """JSON-safe: NaN and infinities become null, recursively; numpy scalars become Python numbers."""
    if isinstance(x, dict):
        return {str(k): finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    if isinstance(x, (np.floating, np.integer)):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _moment_sentence(plan) -> str:
    if not plan.adam_moment_samples:
        return ("Every branch keeps the checkpoint's Adam second moment (--adam-moment-samples 0): over a short "
                "branch it still holds the checkpoint's batch's gradient statistics.")
    return (f"Each branch's Adam second moment is moved from the checkpoint's batch B0 to its own B by the "
            f"sampling noise's share, sigma^2 (1/B0 - 1/B) per coordinate (with the clip's scale), sigma^2 from "
            f"{plan.adam_moment_samples} single-sample gradients: the checkpoint's remembers ~1000 steps of its own "
            "batch.")


def _samples_per_batch(a: "Advice") -> dict:
    return {b: float(np.mean([c.samples for c in a.curves if c.batch == b])) for b in a.plan.batches
            if any(c.batch == b for c in a.curves)}


def _gain_rates(a: "Advice", per_step: bool) -> dict:
    """Mean over seeds of (gain to the branch's best validation) / samples (or steps) it trained."""
    start, out = a.branch.start_loss, {}
    for b in a.plan.batches:
        rates = [(start - min(c.losses)) / max(c.samples, 1) * (b if per_step else 1) for c in a.curves if c.batch == b]
        if rates:
            out[b] = float(np.mean(rates))
    return out


def _target_batch(b: BranchFit):
    """The batch whose branch set the target: the largest fitted one ('—' without a fit)."""
    return max(b.fitted_batches) if b.fitted_batches and b.target_loss is not None else "—"


def _bound(b: BranchFit) -> dict | None:
    """An unresolved branch fit as what it is, a bound: below the smallest batch tested or above the largest."""
    if b.b_crit == 0:
        return {"below": min(b.fitted_batches)}
    if b.b_crit == math.inf:
        return {"above": max(b.fitted_batches)}
    return None


def _setting_json(c: Candidate | None) -> dict | None:
    return None if c is None else {**c.setting.as_json(), "effective_batch": c.setting.batch, "minutes": c.minutes}


def as_json(a: Advice) -> dict:
    b, m, plan = a.branch, a.noise.marginal, a.plan
    return finite({
        # b_crit_branch: 0 when steps did not fall with B (see b_crit_branch_bound), null for inf
        "b_crit_branch": b.b_crit, "b_crit_branch_ci": [b.lo, b.hi], "ci_level": b.level,
        "b_crit_branch_bound": _bound(b), "b_crit_branch_reliable": b.reliable,
        # measured | bound | plateau (no measurable progress: null, not a number) | no target
        "b_crit_branch_status": b.status,
        "b_crit_branch_ci_seeds_only": list(b.seed_interval), "branch_val_jitter": b.jitter,
        "b_noise": m.value, "b_noise_ci": [m.lo, m.hi],
        # the same probe in Adam's whitened coordinates, tr(P Sigma) / G^T P G: reported, not used
        "b_noise_adam": a.noise.adam.value if a.noise.adam else None,
        "b_noise_adam_ci": [a.noise.adam.lo, a.noise.adam.hi] if a.noise.adam else [None, None],
        "trusted": a.verdict.trusted, "b_noise_over_b_crit_branch": a.verdict.ratio, "agreement": a.verdict.sentence,
        "b_crit_used": a.verdict.law.b_crit if a.verdict.law else None,
        "recommended": _setting_json(a.recommended), "recommended_one_device": _setting_json(a.recommended_one_device),
        "devices_worth_it": a.devices_worth_it,
        "current_cost": a.cost.as_json(), "sentence": a.sentence,
        "horizon_samples": a.horizon_samples,
        "table": [c.as_json() for c in a.table],
        "speed": [dataclasses.asdict(r) for r in a.speed],
        "noise_scale": {"marginal": dataclasses.asdict(m), "samples": a.noise.samples, "level": a.noise.level,
                        "buckets": [{"timesteps": list(t), **dataclasses.asdict(e)} for t, e in a.noise.buckets]},
        "branches": {"batches": list(plan.batches), "seeds": list(plan.seeds), "samples_largest_batch": plan.samples,
                     "samples_per_batch": _samples_per_batch(a), "start_sample": plan.start,
                     "val_every_samples": plan.val_every, "val_draws": plan.val_draws,
                     "lr": plan.lr, "micro_batch": plan.micro, "ema_halflife": plan.ema_halflife,
                     "adam_moment_samples": plan.adam_moment_samples,
                     "checkpoint_ema_position": plan.ema_position, "start_loss": b.start_loss,
                     "target_loss": b.target_loss, "mean_gain": b.mean_gain, "gain_spread": b.gain_spread,
                     "gain_per_sample": _gain_rates(a, per_step=False),
                     "gain_per_step": _gain_rates(a, per_step=True), "early_crossings": b.early,
                     "steps_to_target": b.steps, "dropped": b.dropped,
                     "no_progress": list(b.no_progress), "b_crit_at_other_targets": b.checks,
                     "note": b.note,
                     "curves": [dataclasses.asdict(c) for c in a.curves]},
        "checkpoint": {"source": a.source, **a.checkpoint}, "device": a.device, "precision": a.precision,
        "current": a.current.as_json(),
        "cost": {"seconds": sum(a.seconds.values()), "seconds_by_phase": a.seconds,
                 "training_samples": a.training_samples, "validation_draws": a.validation_draws},
        "notes": a.notes,
    })


# --- Markdown ------------------------------------------------------------------------------------------
def _num(x, fmt: str = ".3g", none: str = "—") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    if x == math.inf:
        return "∞"
    return format(x, fmt)


def _interval(lo, hi) -> str:
    return f"{_num(lo)}–{_num(hi, none='∞')}"


def _bcrit_cell(b: BranchFit) -> str:
    if b.plateau:
        return "not measurable: the checkpoint is at a plateau (no batch's fall beats the validations' jitter; c.)"
    if b.b_crit is None:
        return f"not measured ({b.note})"
    if b.b_crit == 0:
        return f"below {min(b.fitted_batches)} (steps did not fall with B)"
    if b.b_crit == math.inf:
        return f"above {max(b.fitted_batches)} (steps fell as 1/B)"
    return f"**{b.b_crit:.3g}**"


def markdown(a: Advice, figure: Path) -> str:
    """reports/advise.md: the advice and its table first, then how each input was measured."""
    sections = (_advice_section(a, figure), _speed_section(a), _noise_section(a), _branches_section(a),
                _cost_section(a))
    return "\n".join(line for section in sections for line in section)


def _advice_section(a: Advice, figure: Path) -> list[str]:
    b, m, rec = a.branch, a.noise.marginal, a.recommended
    lines = ["# What should accumulate_every be? (`voxdiff advise`)", "",
             f"Advised on {a.source}: {a.checkpoint.get('samples_seen')} samples seen, step {a.checkpoint.get('step')}"
             + (f", MLflow run `{a.checkpoint['mlflow_run_id']}`" if a.checkpoint.get("mlflow_run_id") else "")
             + f"; device {a.device}, precision {a.precision}. Current setting (params.yaml): micro-batch "
             f"{a.current.micro} × accumulate_every {a.current.accumulate} × world size {a.current.world} = "
             f"effective batch {a.current.batch}.", ""]
    if rec is not None:
        lines += [f"**Recommended: micro-batch {rec.setting.micro}, accumulate_every {rec.setting.accumulate}, "
                  f"world size {rec.setting.world}.** {a.sentence}", ""]
    lines += ["| | |", "|---|---|",
              f"| critical batch, measured by the branches | {_bcrit_cell(b)}"
              + ("" if b.plateau else f" ({b.level:.0%} interval {_interval(b.lo, b.hi)}"
                 f"{'' if b.reliable or b.firm_bound else ': not resolved'})") + " |",
              f"| gradient noise scale B_simple (marginal over timesteps) | {_num(m.value, none='not resolved')} "
              f"({a.noise.level:.0%} interval {_interval(m.lo, m.hi)}) |",
              f"| which the table uses | {a.verdict.trusted} |", "", a.verdict.sentence[0].upper() + a.verdict.sentence[1:]
              + ".", "", f"![advise]({figure.name})", "", "## Candidate settings", "",
              f"Samples and optimizer steps to the same progress relative to the best row (S = S_min(1 + B_crit/B), "
              f"E = E_min(1 + B/B_crit), B = micro-batch × accumulate_every × world size); minutes to make the "
              f"progress the current setting makes in {a.horizon_samples} samples (its budget in params.yaml), at "
              "this point of training. Accumulation runs at its micro-batch's memory and samples/s; N devices at N× "
              "one device's samples/s (communication not measured: an upper bound on their speed).", "",
              "| micro-batch | accumulate_every | world size | effective batch | peak memory MB | samples/s | "
              "samples vs best | steps vs best | minutes | device-minutes |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in a.table:
        mark = " (current)" if c.current else ""
        bold = "**" if rec is not None and c.setting == rec.setting else ""
        lines.append(f"| {bold}{c.setting.micro}{bold}{mark} | {c.setting.accumulate} | {c.setting.world} | "
                     f"{c.setting.batch} | {_num(c.memory_mb, '.0f')} | {_num(c.samples_per_s, '.3g')} | "
                     f"{_num(c.samples_rel, '.2f')} | {_num(c.steps_rel, '.2f')} | {_num(c.minutes, '.3g')} | "
                     f"{_num(c.device_minutes, '.3g')} |")
    return lines + ["", "The recommendation is the fastest row among those that spend at most twice the least "
                    "device-time (devices × minutes): on one device the fastest micro-batch at accumulate_every 1; "
                    "across devices, more of them while the effective batch stays near B_crit or below." +
                    (f" Up to {a.devices_worth_it} device(s) pass that test." if a.devices_worth_it else ""), ""]


def _speed_section(a: Advice) -> list[str]:
    lines = ["## a. Memory and speed per micro-batch", "",
             "Whole training steps (forward, backward, clipping, Adam, EMA) at accumulate_every 1, the fastest of "
             "the timed steps after one warm-up step; peak memory: " +
             ("CUDA max allocated." if a.device.startswith("cuda") else "this process's peak RSS."), "",
             "| micro-batch | samples/s | peak memory MB | note |", "|---|---|---|---|"]
    for r in a.speed:
        lines.append(f"| {r.micro} | {_num(r.samples_per_s)} | {_num(r.peak_memory_mb, '.0f')} | "
                     f"{'out of memory' if r.oom else r.note} |")
    return lines + [""]


def _noise_section(a: Advice) -> list[str]:
    m = a.noise.marginal
    lines = ["## b. Gradient noise scale at the checkpoint", "",
             f"B_simple = tr(Σ)/|G|² from single-sample gradients of the checkpoint's weights on fixed probe draws "
             f"(`Trainer.bucket_noise_scale`, two passes, jackknife + Fieller interval at {a.noise.level:.0%}); "
             f"marginal: {a.noise.samples} draws with timesteps uniform as in training. An unresolved value "
             "(|G|²'s interval includes 0) has only a lower bound.", "",
             "| timesteps | B_simple | interval |", "|---|---|---|",
             f"| all (marginal) | {_num(m.value, none='not resolved')} | {_interval(m.lo, m.hi)} |"]
    for (t0, t1), e in a.noise.buckets:
        lines.append(f"| {t0}–{t1 - 1} | {_num(e.value, none='not resolved')} | {_interval(e.lo, e.hi)} |")
    if a.noise.adam is not None:
        e = a.noise.adam
        lines += [f"| all, in Adam's coordinates | {_num(e.value, none='not resolved')} | {_interval(e.lo, e.hi)} |",
                  "", "The last row: the marginal draws' tr(PΣ)/GᵀPG with P = 1/(√v̂ + ε) from the checkpoint's Adam "
                  "state, the noise scale of the gradient Adam acts on (B_simple assumes plain SGD); reported beside "
                  "the plain one, not used for the advice."]
    return lines + [""]


def _branches_section(a: Advice) -> list[str]:
    b, plan = a.branch, a.plan
    lines = ["## c. Training branches from the checkpoint", "",
             f"The branches at the largest batch (and at each next one down while none lowered the val loss) train "
             f"{plan.samples} samples from the checkpoint (global samples "
             f"{plan.start} onwards: the same samples at every batch within a seed), the smaller batches until "
             f"their EMA is past the target at two validations in a row; lr {plan.lr:.3g} held constant (the lr in force "
             f"at the checkpoint; train.lr_scaling applied per batch), seeds {', '.join(map(str, plan.seeds))}, EMA "
             f"half-life {plan.ema_halflife:g} samples; the EMA is validated every {plan.val_every} samples on "
             f"{plan.val_draws} draws per validation subject, each validation placed at the mean sample "
             f"position of the EMA's weights (the checkpoint's EMA sits at {plan.ema_position:.0f}): its lag, the same "
             "in samples at every batch, drops out, and so does the raw iterate's gradient noise, larger at small "
             f"batches. {_moment_sentence(plan)} Target: the val loss {_num(b.target_loss, '.5g')} (the checkpoint's EMA: {b.start_loss:.5g}), "
             f"80 % of the way from the level of the largest batch that made progress (B = {_target_batch(b)}) once "
             "its EMA forgot the checkpoint's "
             f"(after {plan.usable_from:g} samples) to its end level; the position where each "
             "branch crosses it, read between validations, / B = its steps, fitted with S = S_min(1 + B_crit/B) "
             "(`voxdiff.analysis.convergence`); the interval by a bootstrap over seeds and over each curve's validations around "
             "its trend (the seeds alone give "
             f"{_interval(*b.seed_interval) if b.seed_interval[0] is not None else '—'}).", "",
             "| effective batch | runs as | samples trained | val-loss gain (mean ± std over seeds) | gain per 1000 "
             "samples | gain per step | steps to target |", "|---|---|---|---|---|---|---|"]
    per_sample, per_step, trained = _gain_rates(a, False), _gain_rates(a, True), _samples_per_batch(a)
    for batch in plan.batches:
        mu = plan.micro[batch]
        steps = ("no measurable progress: left out of the fit" if batch in b.no_progress
                 else f"not fitted ({b.status})" if b.status in ("plateau", "no fit", "no target")
                 else ", ".join(f"{s:.1f}" for s in b.steps.get(batch, [])) or "not reached")
        lines.append(f"| {batch} | {mu} × {batch // mu} | {_num(trained.get(batch), '.0f')} | "
                     f"{_num(b.mean_gain.get(batch), '.3g')} ± {_num(b.gain_spread.get(batch), '.2g')} "
                     f"| {_num(None if batch not in per_sample else 1000 * per_sample[batch], '.3g')} "
                     f"| {_num(per_step.get(batch), '.3g')} | {steps} |")
    checks = ", ".join(f"{_num(v)} at {f:.0%} of the gain" for f, v in b.checks.items())
    return lines + ["", f"B_crit at other targets: {checks or '—'}." + (f" Dropped (never reached the target): "
                                                                        f"{', '.join(b.dropped)}." if b.dropped else ""),
                    *([f"Note: {b.note}."] if b.note else []), ""]


def _cost_section(a: Advice) -> list[str]:
    lines = ["## What it cost", "",
             f"{sum(a.seconds.values()):.0f} s in all (" + ", ".join(f"{k} {v:.0f} s" for k, v in a.seconds.items())
             + f"); {a.training_samples} samples through forward and backward, {a.validation_draws} validation "
             "draws (forward only).", ""]
    if a.notes:
        lines += ["## Notes", "", *(f"- {n}" for n in a.notes), ""]
    return lines


# --- the figure ------------------------------------------------------------------------------------------
def figure(a: Advice, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), constrained_layout=True)
    ax = axes[0]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, batch in enumerate(a.plan.batches):
        stalled = batch in a.branch.no_progress  # drawn apart: left out of the target and the fit
        for c in (c for c in a.curves if c.batch == batch):
            ax.plot(c.positions, c.losses, "x--" if stalled else "o-", ms=3, lw=1, color=colors[i % len(colors)],
                    alpha=0.5 if stalled else 0.8,
                    label=(f"B = {batch}" + (" (no progress)" if stalled else "")) if c.seed == a.plan.seeds[0] else None)
    if a.branch.target_loss is not None:
        ax.axhline(a.branch.target_loss, color="k", lw=0.8, ls=":", label="target")
    ax.axvline(0, color="0.6", lw=0.8)
    ax.set(xlabel="mean sample position of the EMA's weights, from the checkpoint", ylabel="val loss (EMA)",
           title="c. branches")
    ax.legend(fontsize=8)
    ax = axes[1]
    for batch, steps in a.branch.steps.items():
        ax.plot([batch] * len(steps), steps, "o", color="C0")
    grid = np.geomspace(min(a.plan.batches) / 2, max(a.plan.batches) * 2, 100)
    law = a.branch.law
    if law is not None and law.s_min > 0 and a.branch.steps:
        scale = np.mean([np.mean(v) / law.steps(b) for b, v in a.branch.steps.items()])
        ax.plot(grid, [scale * law.steps(g) for g in grid], "-", color="C0",
                label=f"branches: B_crit {_num(law.b_crit)}")
        if a.noise.marginal.value:
            bn = a.noise.marginal.value
            s = np.mean([np.mean(v) / (1 + bn / b) for b, v in a.branch.steps.items()])
            ax.plot(grid, [s * (1 + bn / g) for g in grid], "--", color="C3", label=f"noise scale: {bn:.3g}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(a.plan.batches), [str(b) for b in a.plan.batches])
    ax.set(yscale="log", xlabel="effective batch B", ylabel="steps to the target", title="S = S_min (1 + B_crit / B)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    ax = axes[2]
    ran = [r for r in a.speed if r.samples_per_s]
    ax.plot([r.micro for r in ran], [r.samples_per_s for r in ran], "o-", color="C2")
    ax.set_xscale("log", base=2)
    ax.set_xticks([r.micro for r in ran], [str(r.micro) for r in ran])
    ax.set(xlabel="micro-batch", ylabel="samples/s", title="a. speed and memory")
    twin = ax.twinx()
    twin.plot([r.micro for r in ran], [r.peak_memory_mb for r in ran], "s--", color="C1")
    twin.set_ylabel("peak memory MB", color="C1")
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def write_outputs(a: Advice, out_md: Path) -> list[Path]:
    """reports/advise.md, reports/advise.json and reports/advise.png (names follow --out)."""
    out_json, out_png = out_md.with_suffix(".json"), out_md.with_suffix(".png")
    figure(a, out_png)
    with atomic_path(out_json) as tmp:
        tmp.write_text(json.dumps(as_json(a), indent=1, allow_nan=False) + "\n")
    write_text(out_md, markdown(a, out_png))
    return [out_md, out_json, out_png]


# --- MLflow ----------------------------------------------------------------------------------------------
def log_run(a: Advice, uri: str, experiment_id: str, files: list[Path], options: dict) -> str:
    """The advice as its own MLflow run, tagged with the training run it advises on (and nested under it
    when that run is in this experiment). Returns the run id."""
    from mlflow.entities import Metric, Param, RunTag
    from mlflow.tracking import MlflowClient

    from voxdiff import __version__

    client = MlflowClient(tracking_uri=uri)
    advised = a.checkpoint.get("mlflow_run_id") or ""
    tags = {"voxdiff.kind": "advise", "voxdiff.version": __version__, "voxdiff.advised_run": advised,
            "voxdiff.advised_samples": str(a.checkpoint.get("samples_seen")), "voxdiff.device": a.device}
    if advised:
        try:
            if client.get_run(advised).info.experiment_id == experiment_id:
                tags["mlflow.parentRunId"] = advised
        except Exception:
            pass  # the training run is in another store: the tag still names it
    run = client.create_run(experiment_id, run_name="advise", tags=tags)
    rid = run.info.run_id
    data = as_json(a)
    values = {"b_crit_branch": data["b_crit_branch"], "b_crit_branch_lo": data["b_crit_branch_ci"][0],
              "b_crit_branch_hi": data["b_crit_branch_ci"][1], "b_noise": data["b_noise"],
              "b_noise_lo": data["b_noise_ci"][0], "b_noise_hi": data["b_noise_ci"][1],
              "b_crit_used": data["b_crit_used"], "current_samples_vs_accumulate_1":
              data["current_cost"]["samples_vs_accumulate_1"], "advise_seconds": data["cost"]["seconds"],
              "advise_training_samples": data["cost"]["training_samples"]}
    if a.recommended is not None:
        values.update({f"recommended_{k}": v for k, v in a.recommended.setting.as_json().items()})
    import time

    ts = int(time.time() * 1000)
    return end_with_batch(client, rid, files,
                          metrics=[Metric(k, float(v), ts, 0) for k, v in values.items() if v is not None],
                          params=[Param(k, str(v)[:6000]) for k, v in options.items()],
                          tags=[RunTag("voxdiff.trusted", a.verdict.trusted),
                                RunTag("voxdiff.b_crit_branch_status", a.branch.status)])
