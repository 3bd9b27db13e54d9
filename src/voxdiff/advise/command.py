"""`voxdiff advise`: the command line and the order of the measurements. Only click is imported at the
top: the CLI registers this command at start-up and `--help` must stay instant."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from pathlib import Path

import click

DEFAULT_CHECKPOINT = Path("models/checkpoint.pt")
FACTORS = (1, 2, 4, 8)   # branches at effective batch b, 2b, 4b, 8b
ACCUMULATES = (1, 2, 4, 8)  # accumulate_every values in the table (plus the current one)


@dataclasses.dataclass(frozen=True)
class AdviseOptions:
    """The command's options (defaults sized so that the demo's advice takes < 5 minutes on 2 cores)."""
    root: Path | None = None
    params_path: Path | None = None
    checkpoint: Path | None = None      # None: models/checkpoint.pt, or a warm-up when it does not exist
    world_sizes: tuple[int, ...] = (1, 2, 4, 8)
    budget_samples: int = 0             # the largest batch's branches; 0 = 24 of its steps, at least 128
    branch_seeds: int = 2
    branch_batches: tuple[int, ...] = ()  # () = train.batch_size x (1, 2, 4, 8)
    val_draws: int = 8                  # per validation subject, for the branches (training's own: train.val_draws)
    probe_samples: int = 0              # 0 = train.gns_probe_samples (32 when that is 0)
    adam_moment_samples: int = 64        # single-sample gradients that move Adam's v to each branch batch; 0 = keep
    max_micro_batch: int = 64
    speed_steps: int = 2
    warmup_samples: int = 256
    from_scratch: bool = False          # ignore models/checkpoint.pt: warm up from scratch
    out: Path = Path("reports/advise.md")
    log: bool = True
    progress: bool | None = None

    def as_params(self) -> dict:
        return {"checkpoint": str(self.checkpoint or DEFAULT_CHECKPOINT), "world_sizes": ",".join(map(str, self.world_sizes)),
                "budget_samples": self.budget_samples or "auto", "branch_seeds": self.branch_seeds,
                "branch_batches": ",".join(map(str, self.branch_batches)) or "auto", "val_draws": self.val_draws,
                "probe_samples": self.probe_samples or "auto", "adam_moment_samples": self.adam_moment_samples,
                "max_micro_batch": self.max_micro_batch, "warmup_samples": self.warmup_samples,
                "from_scratch": self.from_scratch}


@dataclasses.dataclass
class Inputs:
    """Everything checked before any measurement or any file is written."""
    root: Path
    params: object
    cache: object
    state: dict | None        # None: warm up from scratch
    source: str
    out: Path
    tracking: tuple[str, str] | None   # (uri, experiment id), None with --no-log


def _resolve_out(root: Path, out: Path) -> Path:
    from voxdiff.runtime.errors import VoxdiffError

    out = out if out.is_absolute() else root / out
    if out.suffix != ".md":
        raise VoxdiffError(f"--out {out}: give a Markdown file name ending in .md (the .json and .png go next to it)")
    if out.is_dir():
        raise VoxdiffError(f"--out {out}: is a directory; give a file name ending in .md")
    return out


def _check_compatible(state: dict, params, cache, path: Path) -> None:
    """The checkpoint must hold this network, diffusion and grid: the branches continue its weights."""
    from voxdiff.runtime.errors import VoxdiffError

    theirs = state.get("params") or {}
    for section in ("model", "diffusion", "preprocess"):
        if section in theirs and theirs[section] != params.raw[section]:
            diff = sorted(k for k in set(theirs[section]) | set(params.raw[section])
                          if theirs[section].get(k) != params.raw[section].get(k))
            raise VoxdiffError(f"{path}: trained with other {section} params than params.yaml ({section}."
                               f"{diff[0]}: {theirs[section].get(diff[0])!r} there, {params.raw[section].get(diff[0])!r} "
                               "here): advise continues the checkpoint's weights, so they must match")
    if list(state.get("shape", cache.images.shape[1:])) != list(cache.images.shape[1:]):
        raise VoxdiffError(f"{path}: trained on grid {state.get('shape')}, but data/processed holds "
                           f"{list(cache.images.shape[1:])}")
    if state.get("num_classes", cache.num_classes) != cache.num_classes:
        raise VoxdiffError(f"{path}: trained with {state.get('num_classes')} label classes, data/processed has "
                           f"{cache.num_classes}")
    for key in ("model", "ema", "optimizer", "samples_seen", "step"):
        if key not in state:
            raise VoxdiffError(f"{path}: not a training checkpoint (no {key!r})")


def check_inputs(opts: AdviseOptions) -> Inputs:
    from voxdiff.data.cache import open_cache
    from voxdiff.runtime.errors import VoxdiffError
    from voxdiff.runtime.fsutil import repo_root
    from voxdiff.params import load
    from voxdiff.training import checkpoint

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise VoxdiffError("voxdiff advise runs as one process (not under torchrun); --world-sizes predicts "
                           "several devices from one")
    root = (opts.root or repo_root()).resolve()
    params = load(opts.params_path or root / "params.yaml")
    out = _resolve_out(root, opts.out)
    cache = open_cache(root / "data" / "processed")
    given = opts.checkpoint is not None
    if given and opts.from_scratch:
        raise VoxdiffError("--from-scratch and --checkpoint exclude each other: advise either continues a "
                           "checkpoint or warms up from scratch")
    path = Path(opts.checkpoint or DEFAULT_CHECKPOINT)
    path = path if path.is_absolute() else root / path
    if opts.from_scratch:
        state, source = None, f"a warm-up of {opts.warmup_samples} samples from scratch (--from-scratch)"
    elif path.exists() or given:
        state = checkpoint.load(path)  # a missing or unreadable file: one line
        _check_compatible(state, params, cache, path)
        try:
            source = f"`{path.relative_to(root)}`"
        except ValueError:
            source = f"`{path}`"
    else:
        state, source = None, f"a warm-up of {opts.warmup_samples} samples from scratch (no {DEFAULT_CHECKPOINT})"
    tracking = None
    if opts.log:
        from voxdiff.tracking.runs import ensure_experiment
        from voxdiff.tracking.uri import resolve_tracking_uri

        uri = resolve_tracking_uri(params, root)
        tracking = (uri, ensure_experiment(uri, params.mlflow.experiment, root))
    return Inputs(root, params, cache, state, source, out, tracking)


@dataclasses.dataclass
class Plan:
    """What run_advise derives from the options and params before measuring."""
    batches: tuple[int, ...]   # effective batches of the branches
    marginal: int              # single-sample gradients of the marginal probe
    val_subjects: int


@dataclasses.dataclass
class Measurements:
    state: dict                # the training state advised on (the checkpoint's or the warm-up's)
    speed: list                # fit.SpeedRow per micro-batch
    noise: object              # measure.NoiseReading
    branch_plan: object        # measure.BranchPlan
    branches: object           # measure.BranchRun: the curves, their target, the validations run
    seconds: dict              # phase -> wall seconds
    notes: list


def make_plan(opts: AdviseOptions, inputs: Inputs) -> Plan:
    from voxdiff.training.schedule import adam_settings

    t = inputs.params.train
    batches = tuple(sorted(set(opts.branch_batches))) or tuple(t.batch_size * f for f in FACTORS)
    for b in batches:  # an Adam rule that breaks at a branch's batch: refused now, not after minutes of work
        adam_settings(t, b)
    return Plan(batches, opts.probe_samples or t.gns_probe_samples or 32, len(inputs.cache.split_indices("val")))


def _work_estimate(opts: AdviseOptions, inputs: Inputs, plan: Plan) -> float:
    """The progress bar's total, in samples through forward+backward (a validation draw counts 1/3)."""
    from voxdiff.advise import measure

    samples = measure.branch_samples(inputs.params, plan.batches, opts.budget_samples)
    per_branch = (1 + 0.5 * (len(plan.batches) - 1)) * opts.branch_seeds  # the smaller batches stop early
    points = samples / math.lcm(*plan.batches)
    sweep = sum(m * (opts.speed_steps + 1) for m in (1, 2, 4, 8) if m <= opts.max_micro_batch)
    branches = samples * per_branch
    validations = (1 + points * per_branch) * opts.val_draws * plan.val_subjects / 3
    return (sweep + measure.noise_cost(inputs.params, plan.marginal) + branches + validations
            + measure.adam_moment_draws(opts.adam_moment_samples, plan.batches)
            + (opts.warmup_samples if inputs.state is None else 0))


def measure_all(opts: AdviseOptions, inputs: Inputs, plan: Plan, rt, echo) -> Measurements:
    """a. memory and speed, b. the noise scale, c. the branches (after a warm-up when there is no checkpoint)."""
    from voxdiff.advise import measure

    interactive = sys.stderr.isatty() if opts.progress is None else opts.progress
    progress = measure.Progress(_work_estimate(opts, inputs, plan), interactive, echo)
    seconds, clock = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        seconds[name] = time.perf_counter() - clock
        clock = time.perf_counter()

    try:
        state = inputs.state
        if state is None:
            progress.phase(f"warm-up of {opts.warmup_samples} samples from scratch")
            state = measure.warm_up_state(inputs.params, inputs.root, rt, inputs.cache, opts.warmup_samples,
                                          progress)
            lap("warm-up")
        session = measure.Session(inputs.params, inputs.root, rt, inputs.cache, state, inputs.source)
        speed = measure.speed_sweep(session, opts.max_micro_batch, opts.speed_steps, progress)
        speed = measure.measure_also(session, speed, inputs.params.train.batch_size, opts.speed_steps, progress)
        lap("memory and speed")
        noise = measure.noise_scale(session, plan.marginal, progress)
        lap("noise scale")
        branch_plan = measure.plan_branches(session, plan.batches, opts.branch_seeds, opts.budget_samples,
                                            opts.val_draws, speed, opts.adam_moment_samples)
        branches = measure.run_branches(session, branch_plan, progress)
        lap("branches")
    finally:
        progress.close()
    return Measurements(state, speed, noise, branch_plan, branches, seconds, branches.notes)


def conclude(opts: AdviseOptions, inputs: Inputs, plan: Plan, m: Measurements, rt):
    """d. the fit, the table, the recommendation and what the current setting costs -> report.Advice."""
    from voxdiff.advise import fit, measure, report
    from voxdiff.training.schedule import plan_budget

    t = inputs.params.train
    branch = fit.fit_branches(m.branches.curves, level=t.gns_ci_level, usable_from=m.branch_plan.usable_from,
                              planned=m.branch_plan.batches)
    verdict = fit.reconcile(branch, m.noise.marginal.value, m.noise.marginal.lo)
    current = fit.Setting(t.batch_size, t.accumulate_every, 1)
    horizon = plan_budget(t, 1).total_samples
    table = fit.candidates(verdict.law, m.speed, opts.world_sizes, sorted(set(ACCUMULATES) | {t.accumulate_every}),
                           current, horizon)
    one = fit.recommend(table, world=1)
    if fit.uninformative(branch, verdict) or branch.plateau:
        # B_crit anywhere from 0 to inf, or no progress to buy at this lr: the one-device advice holds for any
        # B_crit (accumulation never saves samples), what more devices buy does not: no multi-device
        # recommendation from a point estimate (at a plateau, the noise scale's).
        best, worth = one, None
    else:
        best, worth = fit.recommend(table), fit.devices_worth_it(table)
    interval = (branch.lo, branch.hi) if verdict.trusted == "branches" else (m.noise.marginal.lo, m.noise.marginal.hi)
    cost = fit.current_cost(verdict.law, table, current, one, interval)
    state = m.state
    ck = {"step": int(state["step"]), "samples_seen": int(state["samples_seen"]),
          "mlflow_run_id": state.get("mlflow_run_id", ""), "finished": bool(state.get("finished")),
          "effective_batch": measure.trained_batch(state), "precision": state.get("precision_resolved", "")}
    sweep = sum(r.micro * (opts.speed_steps + 1) for r in m.speed if r.samples_per_s)
    trained = (sweep + measure.noise_cost(inputs.params, plan.marginal) + m.branches.samples
               + (opts.warmup_samples if inputs.state is None else 0))
    return report.Advice(
        source=inputs.source, checkpoint=ck, device=str(rt.device), precision=rt.precision, current=current,
        horizon_samples=horizon, speed=m.speed, noise=m.noise, plan=m.branch_plan, curves=m.branches.curves,
        branch=branch, verdict=verdict, table=table, recommended=best, recommended_one_device=one,
        devices_worth_it=worth, cost=cost,
        sentence=_sentence(verdict, branch, cost, one, best, worth, fit.uninformative(branch, verdict) or branch.plateau),
        seconds=m.seconds,
        training_samples=trained, validation_draws=m.branches.validations * opts.val_draws * plan.val_subjects,
        notes=m.notes + _notes(state, rt, inputs.params, m.speed, m.branch_plan))


def run_advise(opts: AdviseOptions, echo=None):
    """Check every input, measure (memory/speed, noise scale, branches), conclude, write and log: the Advice."""
    from voxdiff.advise import report
    from voxdiff.runtime.distributed import configure_backends, init_runtime

    echo = echo or (lambda s: click.echo(s, err=True))
    inputs = check_inputs(opts)
    plan = make_plan(opts, inputs)
    t = inputs.params.train
    rt = init_runtime(t.device, t.precision)
    # The kernels training runs on (cudnn.benchmark, TF32, train.deterministic), before any CUDA matmul:
    # samples/s and the branches measured on PyTorch's defaults would advise on another setup.
    configure_backends(rt.device, t.tf32, t.deterministic)
    advice = conclude(opts, inputs, plan, measure_all(opts, inputs, plan, rt, echo), rt)
    advice.files = report.write_outputs(advice, inputs.out)
    if inputs.tracking is not None:
        try:
            advice.run_id = report.log_run(advice, *inputs.tracking, advice.files, opts.as_params())
        except Exception as e:  # the report is written; a tracking failure after the checks only warns
            echo(f"warning: MLflow logging failed ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})")
    return advice


def _sentence(verdict, branch, cost, one, best, worth, uninformative: bool = False) -> str:
    """The recommendation's one sentence: what the current setting costs, and what more devices buy."""
    if one is None:
        return "nothing ran: no recommendation"
    bc = verdict.law.b_crit if verdict.law else None
    loose = "" if verdict.trusted != "branches" or branch.reliable else f", not resolved: {branch.lo:.2g}-{branch.hi:.2g}"
    where = (f"the loss is at a plateau at this lr (no branch batch made measurable progress), and the noise "
             f"scale puts B_crit ≈ {bc:.2g}" if branch.plateau and bc not in (None, 0.0, float('inf'))
             else f"B_crit ≈ {bc:.2g} ({verdict.trusted}{loose})" if bc not in (None, 0.0, float('inf'))
             else "B_crit is below the smallest batch fitted" if bc == 0.0
             else "B_crit is above the largest batch fitted" if bc is not None
             else "the loss is at a plateau at this lr (no branch batch made measurable progress) and the noise "
                  "scale is not resolved: B_crit unknown" if branch.plateau else "B_crit unknown")
    one_txt = (f"on one device use micro-batch {one.setting.micro} with accumulate_every 1, the fastest to the same "
               "progress: accumulation adds samples, never speed")
    head = f"At this point of training {where}: {cost.sentence}; {one_txt}"
    if best is not None and best.setting.world > 1:
        head += (f"; across devices, up to {worth} are worth it (effective batch {best.setting.batch} at the "
                 f"recommendation, {best.minutes / one.minutes:.2g}x the one-device minutes)" if best.minutes and
                 one.minutes else "")
    elif worth == 1:
        head += "; a second device would more than double the device-time for the same progress (B past B_crit)"
    if uninformative and branch.plateau:
        head += ("; what more devices buy is not measured (no batch makes progress from this checkpoint at this lr: "
                 "advise on an earlier checkpoint, or --from-scratch)")
    elif uninformative:
        head += ("; what more devices buy is not measured (the branches' interval runs from 0 to inf: raise "
                 "--budget-samples or --branch-seeds, or advise on a checkpoint where the loss falls faster)")
    return head + "."


def _notes(state, rt, params, speed, plan) -> list[str]:
    notes = []
    if plan.lr < 0.1 * params.train.lr:
        notes.append(f"the lr in force at the checkpoint is {plan.lr:.3g}, under a tenth of train.lr (warm-up or the "
                     "end of a decay): the branches move little; advise on a checkpoint from the middle of training")
    trained = state.get("precision_resolved")
    if trained and trained != rt.precision:
        notes.append(f"the checkpoint trained in {trained}; advise measured in {rt.precision} "
                     "(train.precision resolves per machine)")
    last = max(speed, key=lambda r: r.micro)
    if not last.oom and not last.note:
        notes.append(f"the memory/speed search stopped at --max-micro-batch {last.micro}, not at the device's limit")
    if rt.device.type == "cpu":
        notes.append("world sizes > 1 predict that many devices like this one; processes sharing one CPU's "
                     "cores do not add speed")
    return notes


def _ints(text: str, name: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: comma-separated integers, e.g. 1,2,4,8", param_hint=name) from None
    if not values or min(values) < 1:
        raise click.BadParameter(f"{text!r}: integers >= 1", param_hint=name)
    return values


@click.command("advise")
@click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Project root holding params.yaml and data/ (default: the current directory's project).")
@click.option("--params", "params_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Params file (default: <root>/params.yaml).")
@click.option("--checkpoint", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help=f"Training checkpoint to advise on [default: {DEFAULT_CHECKPOINT}; when it does not exist, "
                   "a short warm-up from scratch].")
@click.option("--world-sizes", default="1,2,4,8", show_default=True,
              help="Device counts to predict (one device measured; N devices at N x its samples/s).")
@click.option("--budget-samples", type=click.IntRange(0), default=0,
              help="Samples the largest batch's branches train (rounded up to whole steps of every batch; the "
                   "smaller batches stop once past its target; if it lowers nothing, the next batch down sets "
                   "the target) [default: 24 steps of the largest batch, at least 128: 384 on the demo].")
@click.option("--branch-seeds", type=click.IntRange(2), default=2, show_default=True,
              help="Seeds (per-sample draws) per branch batch; the interval is a bootstrap over them.")
@click.option("--branch-batches", default="", help="Effective batches of the branches [default: train.batch_size "
              "x 1,2,4,8].")
@click.option("--val-draws", type=click.IntRange(1), default=8, show_default=True,
              help="Validation draws per validation subject for the branches (training's train.val_draws is too "
                   "few to resolve a short branch's gain).")
@click.option("--probe-samples", type=click.IntRange(0), default=0,
              help="Single-sample gradients of the marginal noise-scale probe [default: train.gns_probe_samples].")
@click.option("--adam-moment-samples", type=click.IntRange(0), default=64, show_default=True,
              help="Single-sample gradients from which each branch's Adam second moment is moved from the "
                   "checkpoint's batch to the branch's (the sampling noise's share of it; the checkpoint's remembers "
                   "~1000 steps of its own batch, which a short branch cannot forget); at least 4x the largest "
                   "branch batch; 0 keeps the checkpoint's.")
@click.option("--max-micro-batch", type=click.IntRange(1), default=64, show_default=True,
              help="Largest micro-batch the memory/speed search tries.")
@click.option("--warmup-samples", type=click.IntRange(1), default=256, show_default=True,
              help="Without a checkpoint: samples trained from scratch first.")
@click.option("--from-scratch", is_flag=True,
              help="Ignore models/checkpoint.pt and advise on a warm-up of --warmup-samples from scratch: for a "
                   "training yet to run (early training, where the loss falls fastest), or when the checkpoint is at "
                   "a plateau and the branches cannot measure B_crit there.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("reports/advise.md"),
              show_default=True, help="Markdown report; the .json and .png are written next to it.")
@click.option("--no-log", is_flag=True, help="Do not log the advice to MLflow.")
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: only on a terminal).")
def advise_command(root, params_path, checkpoint, world_sizes, budget_samples, branch_seeds, branch_batches,
                   val_draws, probe_samples, adam_moment_samples, max_micro_batch, warmup_samples, from_scratch, out,
                   no_log, progress):
    """What accumulate_every (and micro-batch, and device count) costs or saves on your own model, at your
    own point in training, measured in a few minutes from a checkpoint, on the device training uses.

    \b
    a. memory and samples/s of training steps at micro-batch 1, 2, 4, ... (an out-of-memory ends the search);
    b. the gradient noise scale B_simple at the checkpoint (marginal over timesteps and per timestep
       bucket, with an interval);
    c. short training branches from the checkpoint at effective batch b, 2b, 4b, 8b on the same samples,
       2 seeds or more, each with Adam's second moment moved to its own batch (the checkpoint's remembers
       ~1000 steps of the trained batch): the steps each needs to the same val-loss gain, fitted with
       S = S_min (1 + B_crit / B), give a local B_crit with an interval that needs no noise-scale theory
       (a largest batch that lowers nothing is reported, and the next batch down sets the target; when
       no batch's gain beats the validations' jitter the checkpoint is at a plateau: B_crit is not
       measurable there, advise says so and the table uses the noise scale: --from-scratch advises on
       early training instead);
       when the noise scale disagrees by more than 2x, advise says so and trusts the branches;
    d. a table of micro-batch x accumulate_every x world size with memory, samples/s, samples and steps to
       the same progress relative to the best, and predicted minutes; the recommendation and why.

    Writes reports/advise.md, .json and .png, and logs them to MLflow as a run tagged with the training
    run it advises on. Nothing under models/ is written. The demo's advice took 3 minutes on 2 CPU
    cores, 4 with --from-scratch (docs/advise.md).
    """
    opts = AdviseOptions(root=root, params_path=params_path, checkpoint=checkpoint,
                         world_sizes=_ints(world_sizes, "--world-sizes"), budget_samples=budget_samples,
                         branch_seeds=branch_seeds,
                         branch_batches=_ints(branch_batches, "--branch-batches") if branch_batches else (),
                         val_draws=val_draws, probe_samples=probe_samples,
                         adam_moment_samples=adam_moment_samples, max_micro_batch=max_micro_batch,
                         warmup_samples=warmup_samples, from_scratch=from_scratch, out=out, log=not no_log,
                         progress=progress)
    advice = run_advise(opts)
    click.echo(summary(advice))


def summary(a) -> str:
    """The terminal's lines, at most 8 (tests/test_advise.py counts them): the recommendation, what the current
    setting costs against it, B_crit as the branches measured it, the noise scale, the report. The reasoning
    (which estimate the table uses and why, the notes) is in the report."""
    rec, b, m = a.recommended, a.branch, a.noise.marginal
    lines = [f"recommended: micro-batch {rec.setting.micro}, accumulate_every {rec.setting.accumulate}, "
             f"world size {rec.setting.world}" if rec is not None else "recommended: none (nothing ran)"]
    lines += _current_lines(a)
    lines.append(f"B_crit:      {_b_crit_text(b)}")
    noise = (f"B_simple {_fmt(m.value)} ({a.noise.level:.0%} interval {_fmt(m.lo)}–{_fmt(m.hi)})"
             if m.value is not None else "B_simple not resolved" + (f" (at least {_fmt(m.lo)})" if m.lo else ""))
    uses = {"noise scale": "it", "branches": "the branches"}.get(a.verdict.trusted, "neither: memory and speed only")
    lines.append(f"noise scale: {noise}; the table uses {uses}")
    lines.append(f"report:      {_shown(a.files[0])} (+ .json, .png: the reasoning)"
                 + (f", MLflow run {a.run_id}" if a.run_id else ""))
    return "\n".join(lines)


def _current_lines(a) -> list[str]:
    """What the current setting costs against the recommendation (minutes, samples) and, when it
    accumulates, against accumulate_every 1 at its own micro-batch (samples and steps, over B_crit's interval)."""
    cur, rec, cost = a.current, a.recommended, a.cost
    head = f"current:     micro-batch {cur.micro}, accumulate_every {cur.accumulate}"
    if rec is not None and rec.setting == cur:
        return [head + ": the recommendation itself"]
    mine = next((c for c in a.table if c.setting == cur), None)
    against = []
    if mine is not None and rec is not None and mine.minutes and rec.minutes:
        against.append(f"{mine.minutes / rec.minutes:.2g}x the recommendation's minutes")
    if mine is not None and rec is not None and mine.samples_rel and rec.samples_rel:
        against.append(f"{mine.samples_rel / rec.samples_rel:.2g}x its samples")
    lines = [head + (": " + ", ".join(against) + (";" if cur.accumulate > 1 else "") if against else "")]
    if cur.accumulate > 1:
        e, (lo, hi) = cost.samples_vs_accumulate_1, cost.samples_vs_accumulate_1_range
        if e is None:
            lines.append(f"             against accumulate_every 1: B_crit unknown, so between 1x and {cur.accumulate}x "
                         "the samples")
        else:
            spread = f" ({lo:.2g}-{hi:.2g}x over its interval)" if lo is not None else ""
            steps = f", {cost.steps_vs_accumulate_1:.2g}x the steps" if cost.steps_vs_accumulate_1 else ""
            lines.append(f"             against accumulate_every 1: ~{e:.2g}x the samples{spread}{steps}")
    elif not against:
        lines[0] += ": accumulate_every 1 already takes the fewest samples at this micro-batch"
    return lines


def _b_crit_text(b) -> str:
    """B_crit as the branches measured it: a value, a bound or a plateau, with its interval."""
    interval = f"{b.level:.0%} interval {_fmt(b.lo)}–{_fmt(b.hi)}"
    if b.status == "plateau":
        return "plateau: no branch batch made measurable progress at this lr (not measurable here)"
    if b.status == "measured":
        return f"{_fmt(b.b_crit)} ({interval}), measured by the branches" + ("" if b.reliable else ", not pinned down")
    if b.status == "bound":
        side, batch = ("below", min(b.fitted_batches)) if b.b_crit == 0 else ("above", max(b.fitted_batches))
        return f"{side} {batch}, the {'smallest' if side == 'below' else 'largest'} batch fitted ({interval}): a bound"
    return f"not measured by the branches ({b.status})"


def _shown(path) -> str:
    """A path as the user typed it: relative to the current directory when it lies below it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _fmt(x) -> str:
    if x is None:
        return "—"
    return "∞" if x == float("inf") else f"{x:.3g}"
