"""The measurements of `voxdiff advise`, on the device and at the precision training would use.

Everything runs through the real Trainer (exact accumulation, per-sample draws from (seed, global sample
index), Adam, clipping, the lr rule), built from params.yaml with a few keys changed per measurement
(`Session.params_for`); nothing is written to models/ (post-hoc EMA is off in every trainer made here).
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
from pathlib import Path

import torch

from voxdiff.advise.fit import BranchCurve, SpeedRow
from voxdiff.data.cache import ProcessedCache
from voxdiff.runtime.errors import TrainingDiverged, VoxdiffError
from voxdiff.params import Params
from voxdiff.pipeline.plan import short_run
from voxdiff.runtime.distributed import Runtime, peak_memory_mb, reset_peak_memory, timed
from voxdiff.training.schedule import lr_at, plan_budget, scaled_lr
from voxdiff.training.trainer import Trainer

NOT_MEASURED = "voxdiff advise: the accumulation noise scale is not read here"
MEMORY_HEADROOM = 0.9   # CPU: stop before a micro-batch predicted to need more than this share of free RAM


class Progress:
    """One tqdm bar over the whole measurement on a terminal (units: samples through forward+backward;
    a validation draw, forward only, counts 1/3); plain log lines otherwise."""

    def __init__(self, total: float, enabled: bool, echo):
        self.echo, self.bar = echo, None
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=round(total), unit="sample", dynamic_ncols=True, desc="advise")

    def tick(self, n: float) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def extend(self, n: float) -> None:
        """More work than the total foresaw (a batch that sets the target in place of one that stalled)."""
        if self.bar is not None:
            self.bar.total += round(n)
            self.bar.refresh()

    def phase(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text, refresh=True)
        else:
            self.echo(f"[voxdiff advise] {text}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclasses.dataclass
class Session:
    """What every measurement shares: params.yaml, the processed cache, the runtime and the training
    state advised on (a checkpoint's, or a short warm-up's)."""
    params: Params
    root: Path
    rt: Runtime
    cache: ProcessedCache
    state: dict
    source: str   # where `state` came from, for the report

    @property
    def samples_seen(self) -> int:
        return int(self.state["samples_seen"])

    @property
    def trained_batch(self) -> int | None:
        return trained_batch(self.state)

    def params_for(self, micro: int, accumulate: int, total_samples: int, seed: int | None = None,
                   **train) -> Params:
        """params.yaml with this micro-batch, accumulation and sample budget (and any other train keys);
        post-hoc EMA off and no kept copies (train.keep_checkpoints_at_samples: points of the advised run, past
        these budgets), so that no trainer made here writes snapshots or refuses its budget."""
        return short_run(self.params, max_samples=max(1, int(total_samples)), seed=seed, batch_size=micro,
                         accumulate_every=accumulate, phema_sigma_rels=[], **train)

    def trainer(self, params: Params, restore: bool = True) -> Trainer:
        """A Trainer for `params`, holding the advised state's weights, EMA and Adam moments (restore)."""
        tr = Trainer(params, self.root, self.rt, self.cache)
        if restore:
            # Optimizer.load_state_dict keeps the given tensors when device and dtype match, and the
            # branch's steps would then write into self.state: every trainer gets its own copy.
            skip = ("history", "phema")  # neither is read here: no post-hoc EMA in these trainers
            tr.restore(copy.deepcopy({k: v for k, v in self.state.items() if k not in skip})
                       | {"history": [], "phema": {}})
            for group in tr.opt.param_groups:  # load_state_dict restored the checkpoint's; keep this batch's
                group["betas"], group["eps"] = tr.adam.betas, tr.adam.eps
        tr.gns_reason = NOT_MEASURED  # the accumulation probe (GradProbe) is not what advise reads
        return tr


def trained_batch(state: dict) -> int | None:
    """The effective batch a training state was trained at (samples per optimizer step)."""
    step = int(state.get("step") or 0)
    return round(int(state["samples_seen"]) / step) if step else None


def warm_up_state(params: Params, root: Path, rt: Runtime, cache: ProcessedCache, samples: int,
                  progress: Progress) -> dict:
    """No checkpoint: train `samples` from scratch at params.yaml's setting, in memory only."""
    tr = Trainer(short_run(params, max_samples=samples, phema_sigma_rels=[]), root, rt, cache)
    while tr.counters.samples_seen < samples:
        before = tr.counters.samples_seen
        tr.counters.history.append(tr.train_step())  # ema_position replays it
        progress.tick(tr.counters.samples_seen - before)
    return tr.state(False, None)


# --- a. memory and speed per micro-batch ------------------------------------------------------------
def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or (
        isinstance(e, RuntimeError) and "can't allocate memory" in str(e))


def _cpu_memory_limit(rows: list[SpeedRow], micro: int) -> str:
    """Why the next micro-batch is not tried on the CPU (its peak, extrapolated linearly from the last two,
    exceeds the free RAM), or ''."""
    done = [r for r in rows if r.peak_memory_mb]
    if len(done) < 2:
        return ""
    import psutil

    a, b = done[-2], done[-1]
    per_sample = max(0.0, (b.peak_memory_mb - a.peak_memory_mb) / (b.micro - a.micro))
    predicted = b.peak_memory_mb + per_sample * (micro - b.micro)
    rss = psutil.Process().memory_info().rss / 2**20
    room = psutil.virtual_memory().available / 2**20 + rss
    if predicted > MEMORY_HEADROOM * room:
        return f"micro-batch {micro} would need ~{predicted:.0f} MB of {room:.0f} MB free"
    return ""


def time_micro_batch(session: Session, micro: int, steps: int) -> SpeedRow:
    """Peak memory and samples/s of whole training steps (forward, backward, clip, Adam, EMA) at this
    micro-batch, accumulate 1: the fastest of `steps` timed steps after one warm-up step (other work on the
    machine only ever slows a step down). Fresh weights: neither figure depends on them."""
    dev = session.rt.device
    _release(dev)
    reset_peak_memory(dev)
    tr = session.trainer(session.params_for(micro, 1, micro * (steps + 1)), restore=False)
    times = [timed(tr.train_step, dev)[0] for _ in range(steps + 1)]
    peak = peak_memory_mb(dev)
    del tr
    _release(dev)
    return SpeedRow(micro, micro / min(times[1:]), peak)


def _try_micro_batch(session: Session, micro: int, steps: int) -> SpeedRow:
    """time_micro_batch, with an out-of-memory caught: the row says so. Memory is released after the
    except block, once the traceback (which holds the failed trainer's frame) is gone."""
    try:
        return time_micro_batch(session, micro, steps)
    except (torch.OutOfMemoryError, RuntimeError) as e:
        if not _is_oom(e):
            raise
    _release(session.rt.device)
    return SpeedRow(micro, None, None, oom=True, note="out of memory")


def measure_also(session: Session, rows: list[SpeedRow], micro: int, steps: int, progress: Progress) -> list[SpeedRow]:
    """The sweep plus `micro` (the current setting's) when the search stopped before it without running
    out of memory: the table needs its samples/s."""
    if any(r.micro == micro for r in rows) or any(r.oom and r.micro <= micro for r in rows):
        return rows
    progress.phase(f"memory and speed: micro-batch {micro} (the current setting)")
    row = _try_micro_batch(session, micro, steps)
    progress.tick(micro * (steps + 1))
    return sorted([*rows, row], key=lambda r: r.micro)


def speed_sweep(session: Session, max_micro: int, steps: int, progress: Progress) -> list[SpeedRow]:
    """Micro-batch 1, 2, 4, ... until an out-of-memory (caught: it ends the search), the CPU's free RAM,
    `max_micro`, or samples/s that did not beat the best so far by 5 % at two doublings in a row (a larger
    micro-batch that runs no faster only adds samples)."""
    rows: list[SpeedRow] = []
    best, stale, micro = 0.0, 0, 1
    while micro <= max_micro:
        limit = _cpu_memory_limit(rows, micro) if session.rt.device.type == "cpu" else ""
        if limit:
            rows.append(SpeedRow(micro, None, None, note=limit))
            break
        progress.phase(f"memory and speed: micro-batch {micro}")
        row = _try_micro_batch(session, micro, steps)
        if row.oom:
            rows.append(row)
            break
        progress.tick(micro * (steps + 1))
        rows.append(row)
        if row.samples_per_s > 1.05 * best:
            best, stale = row.samples_per_s, 0
        else:
            stale += 1
            if stale == 2:
                rows[-1] = dataclasses.replace(row, note="samples/s stopped growing: search ended")
                break
        micro *= 2
    if not any(r.samples_per_s for r in rows):
        raise VoxdiffError(f"micro-batch 1 does not fit on {session.rt.device} ({rows[0].note}): "
                           "set model.activation_checkpointing: true or a smaller preprocess.shape")
    return rows


# --- b. the noise scale at the checkpoint -------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Estimate:
    value: float | None   # None when |G|^2 is not resolved (then lo is a lower bound)
    lo: float | None
    hi: float | None


@dataclasses.dataclass(frozen=True)
class NoiseReading:
    marginal: Estimate
    buckets: list          # [(timestep range (lo, hi), Estimate)], least noisy first
    samples: int           # single-sample gradients in the marginal probe
    level: float
    adam: Estimate | None = None  # the marginal one in Adam's coordinates (no Adam state: None)


def noise_cost(params: Params, marginal: int) -> int:
    """Single-sample forward+backward passes of the probe (two passes per gradient)."""
    t = params.train
    return 2 * (t.gns_buckets * t.gns_bucket_samples + marginal)


def noise_scale(session: Session, marginal: int, progress: Progress) -> NoiseReading:
    from voxdiff.training.gns import ADAM_PREFIX, bucket_edges

    progress.phase(f"noise scale: {noise_cost(session.params, marginal)} single-sample gradients")
    tr = session.trainer(session.params_for(1, 1, 1, gns_probe_samples=marginal))
    values = tr.bucket_noise_scale()  # gns.probe_noise_scale at the raw weights: marginal and per bucket
    del tr
    progress.tick(noise_cost(session.params, marginal))
    t = session.params.train

    def estimate(prefix: str) -> Estimate:
        return Estimate(values.get(prefix), values.get(f"{prefix}_lo"), values.get(f"{prefix}_hi"))

    edges = bucket_edges(session.params.diffusion.timesteps, t.gns_buckets)
    return NoiseReading(estimate("gns_marginal"), [(edges[b], estimate(f"gns_t{b}")) for b in range(t.gns_buckets)],
                        marginal, t.gns_ci_level, estimate(ADAM_PREFIX) if ADAM_PREFIX in values else None)


# --- c. training branches from the checkpoint ---------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class BranchPlan:
    batches: tuple[int, ...]   # effective batches b, 2b, 4b, ...
    seeds: tuple[int, ...]     # training seeds (per-sample draws) of the branches
    samples: int               # the largest batch's branches: a multiple of val_every
    start: int                 # global sample index every branch starts at (a multiple of every batch)
    val_every: int             # samples between validations (the batches' least common multiple)
    micro: dict                # batch -> the micro-batch it runs at (exact accumulation: same trajectory)
    lr: float                  # train.lr of the branches, held constant: the lr in force at the checkpoint
    val_draws: int             # validation draws per validation subject
    ema_halflife: float        # train.ema_halflife_samples of the branches
    ema_position: float        # mean sample position of the checkpoint's EMA weights, from the branches' start
    adam_moment_samples: int = 0  # single-sample gradients that move each branch's Adam v to its batch; 0 = keep

    @property
    def usable_from(self) -> float:
        """Samples after which a branch's EMA holds < 7 % of the checkpoint's weights (4 half-lives)."""
        return 4 * self.ema_halflife


def ema_position(state: dict, halflife: float) -> float:
    """Mean sample position (samples seen when each averaged iterate was made) of the EMA weights in
    `state`, replayed from its step history with the half-life in force at each step (AveragedModel's
    first update copies the weights); without a history, the steady state of `halflife`."""
    position, before = None, 0
    for h in state.get("history") or []:
        seen = int(h["samples_seen"])
        beta = 0.5 ** ((seen - before) / max(float(h.get("ema_halflife") or halflife), 1e-8))
        position = seen if position is None else beta * position + (1 - beta) * seen
        before = seen
    if position is not None:
        return position
    if not state["step"]:
        return 0.0
    seen = int(state["samples_seen"])
    eff = max(1, round(seen / int(state["step"])))
    beta = 0.5 ** (eff / halflife)
    return seen - eff * beta / (1 - beta)


def branch_ema_halflife(params: Params, batches) -> float:
    """The branches' EMA half-life: training's, capped at 4 steps of the smallest batch (half a step of the
    largest, at 8x). The gradient noise an EMA keeps from the iterates has a variance of about
    (lr/B) (1 - beta)/(1 + beta), beta = 0.5^(B/halflife): at this half-life 0.037-0.044 lr/b over b..8b,
    within 1.2x (the raw iterate's differs 8x, and a half-life of 2 steps of b 1.5x); and a branch forgets the
    checkpoint's EMA after 4 half-lives (16 steps of the smallest batch), before even the fastest branch, the
    smallest batch, reaches a target deep in the largest batch's budget unless B_crit is well below b."""
    return min(params.train.ema_halflife_samples, 4.0 * min(batches))


def branch_samples(params: Params, batches, requested: int) -> int:
    """Samples of the largest batch's branches: `requested`, or (0) 24 steps of the largest batch and at
    least 128, rounded up to whole steps of every batch. The smaller batches stop once past the target.
    (On the demo's last checkpoint 12 steps set a target only 1.6 % below the start, which the smaller
    batches passed while their EMA still held the checkpoint's weights.)"""
    unit = math.lcm(*batches)
    want = requested or max(128, 24 * max(batches))
    return max(1, math.ceil(want / unit)) * unit


def plan_branches(session: Session, batches: tuple[int, ...], seeds: int, samples: int, val_draws: int,
                  speed: list[SpeedRow], adam_moment_samples: int) -> BranchPlan:
    unit = math.lcm(*batches)  # every branch steps onto each validation point and the start (= max for 2^n)
    start = math.ceil(session.samples_seen / unit) * unit  # a few draws skipped, never repeated
    ran = {r.micro: r.samples_per_s for r in speed if r.samples_per_s}
    micro = {b: max((m for m in ran if b % m == 0), key=lambda m: ran[m], default=1) for b in batches}
    t = session.params.train
    eff = t.batch_size * t.accumulate_every
    total = plan_budget(t, 1).total_samples
    # The branches are short: they hold the lr of this point of the schedule (warm-up or decay included),
    # rescaled per effective batch by train.lr_scaling as training would.
    now = lr_at(t, eff, max(session.samples_seen, 1), total) / scaled_lr(t, eff)
    first = session.params.seed
    return BranchPlan(batches, tuple(first + i for i in range(seeds)), branch_samples(session.params, batches, samples),
                      start, unit, micro, t.lr * now, val_draws, branch_ema_halflife(session.params, batches),
                      ema_position(session.state, t.ema_halflife_samples) - start,
                      adam_moment_draws(adam_moment_samples, batches))


def adam_moment_draws(requested: int, batches) -> int:
    """Single-sample gradients of the Adam move: `requested` (0: no move), at least 4x the largest branch
    batch (the estimate's upward bias where G ~ 0 is about B / 2n of v: <= 12 %)."""
    return max(requested, 4 * max(batches)) if requested else 0


@dataclasses.dataclass
class BranchRun:
    """What run_branches hands on: the curves, the target they were timed to, the validations run, and the
    larger batches that made no progress over their whole branch (left out of the target and the fit)."""
    curves: list
    target: float | None
    validations: int
    notes: list
    no_progress: list = dataclasses.field(default_factory=list)  # batches that lowered nothing, largest first

    @property
    def samples(self) -> int:
        return sum(c.samples for c in self.curves)


def _branch(session: Session, plan: BranchPlan, b: int, seed: int, first: float, target: float | None,
            moments, progress: Progress) -> tuple[BranchCurve, int, str]:
    """One branch: train from the checkpoint at effective batch b, validating the EMA every plan.val_every
    samples at its weights' mean position (tracked exactly, step by step, with the beta optimizer_step used),
    until plan.samples or, with a target, two validations in a row at or below it. Returns the curve, the
    validations run and a note ('' or a divergence)."""
    from voxdiff.training.schedule import ema_beta

    m = plan.micro[b]
    p = session.params_for(m, b // m, plan.start + plan.samples, seed=seed, lr=plan.lr, lr_schedule="constant",
                           warmup_samples=0, val_draws=plan.val_draws, ema_halflife_samples=plan.ema_halflife)
    tr = session.trainer(p)
    if moments is not None and session.trained_batch:
        tr.move_adam_second_moment(moments, session.trained_batch)
    c = tr.counters
    c.step, c.samples_seen = plan.start // b, plan.start
    progress.phase(f"branches: seed {seed}, effective batch {b} ({m} x {b // m})")
    position, xs, ys, trained = plan.ema_position, [plan.ema_position], [first], [0]
    seconds, below, note = 0.0, 0, ""
    draws_cost = plan.val_draws * len(session.cache.split_indices("val")) / 3
    try:
        while c.samples_seen < plan.start + plan.samples and below < 2:
            updates = c.ema_updates
            seconds += timed(tr.train_step, session.rt.device)[0]
            if c.ema_updates > updates:
                beta = ema_beta(p.train, b, c.samples_seen)
                position = beta * position + (1 - beta) * (c.samples_seen - plan.start)
            progress.tick(b)
            if (c.samples_seen - plan.start) % plan.val_every == 0:
                xs.append(position)
                ys.append(tr.validation_loss())
                trained.append(c.samples_seen - plan.start)
                progress.tick(draws_cost)
                # a crossing counts once the EMA has forgotten the checkpoint's weights
                usable = c.samples_seen - plan.start >= plan.usable_from
                below = below + 1 if target is not None and usable and ys[-1] <= target else 0
    except TrainingDiverged as e:
        note = f"branch B={b} seed {seed} diverged ({e}); kept up to its last validation"
    done = c.samples_seen - plan.start
    del tr
    return BranchCurve(b, seed, m, tuple(xs), tuple(ys), seconds, done, tuple(trained)), len(xs) - 1, note


def run_branches(session: Session, plan: BranchPlan, progress: Progress) -> BranchRun:
    """The branches, in time_batches' order: the largest batch first, every seed, its whole budget: the mean
    gain it makes sets the target (fit.target_and_stalled); then each smaller batch, every seed, until its EMA is at
    or below the target at two validations in a row (or the same budget). Within a seed every batch consumes
    the same global sample indices, so the draws (subject, timestep, noise) are the same samples at every batch.

    Why the EMA, read at its weights' mean position: the raw iterate's val loss carries the gradient noise of
    its last steps, larger at smaller B (on the demo's checkpoint it sat 12 % above the EMA's and jumped by up
    to +70 % at B = 2), a B-dependent offset that is not progress; the EMA's hardly depends on B
    (branch_ema_halflife), and its lag is removed by placing each validation at the weights' mean position.
    Why a target deep in the largest batch's branch: smaller batches reach it sooner, and it must still
    lie past the samples in which their EMA forgets the checkpoint (plan.usable_from).
    Why Adam's second moment is moved per batch (plan.adam_moment_samples): the checkpoint's v averages
    ~1/(1 - beta2) steps of the trained batch's squared gradients; a branch of a few dozen steps keeps it,
    so at a larger batch Adam would divide a less noisy gradient by the smaller batch's v, a B-independence
    that is the checkpoint's memory, not this point's critical batch. Each branch's v is moved to its own
    batch by the sampling noise's share (Trainer.move_adam_second_moment)."""
    progress.phase("branches: the checkpoint's EMA")
    tr = session.trainer(session.params_for(1, 1, 1, val_draws=plan.val_draws))
    first = tr.validation_loss()  # the same weights and draws at the start of every branch
    moments = None
    if plan.adam_moment_samples:
        progress.phase(f"branches: Adam's second moment per batch, from {plan.adam_moment_samples} single-sample gradients")
        moments = tr.gradient_moments(plan.adam_moment_samples)
        progress.tick(plan.adam_moment_samples)
    del tr

    # one branch's work in progress-bar units (command._work_estimate counts half of it for a smaller batch)
    per_branch = plan.samples * (1 + plan.val_draws * len(session.cache.split_indices("val")) / 3 / plan.val_every)

    def run_batch(b: int, target: float | None) -> BranchRun:
        if target is None and b != max(plan.batches):  # a fallback: its whole budget, untimed
            progress.extend(0.5 * per_branch * len(plan.seeds))
        out = BranchRun([], None, 0, [])
        for seed in plan.seeds:
            curve, validations, note = _branch(session, plan, b, seed, first, target, moments, progress)
            out.curves.append(curve)
            out.validations += validations
            out.notes += [note] if note else []
        return out

    run = time_batches(plan.batches, run_batch, plan.usable_from, session.params.train.gns_ci_level)
    skipped = set(plan.batches) - {c.batch for c in run.curves}
    if skipped:  # no target: the batches below were never run, where the progress bar's total counted half each
        progress.extend(-0.5 * per_branch * len(plan.seeds) * len(skipped))
    run.validations += 1  # the checkpoint's EMA
    return run


def time_batches(batches, run_batch, usable_from: float, level: float = 0.9) -> BranchRun:
    """The order of the branches: the largest batch untimed (its whole budget); the first whose gain passes
    the validations' jitter (fit.target_and_stalled, the verdict the fit reads too) sets the target and times
    every smaller one. run_batch(b, target) -> BranchRun of batch b's seeds.

    Why the next batch down sets the target when the largest makes no measurable progress: at the
    checkpoint's lr a large batch can be past the batch it trains stably at (in the study, effective batch 8
    spiked at 2x the lr; on the demo's checkpoint batch 16's val loss rose by 0.014 in 24 steps), and one
    such batch would leave the others untimed. Each such batch is named in no_progress; a batch below the
    largest runs untimed only while fit.may_set_target allows (of four batches one may fall back; of three
    or fewer, none)."""
    from voxdiff.advise.fit import may_set_target, target_and_stalled

    run = BranchRun([], None, 0, [])
    for b in sorted(batches, reverse=True):
        if run.target is None and not may_set_target(b, batches):
            break  # no batch that may set the target made progress: nothing to time the others to
        got = run_batch(b, run.target)
        run.curves += got.curves
        run.validations += got.validations
        run.notes += got.notes
        if run.target is None:
            verdict = target_and_stalled(run.curves, level, usable_from, planned=batches)
            run.target, run.no_progress = verdict.target, list(verdict.stalled)
    return run
