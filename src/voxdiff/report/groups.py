"""Grouping runs by a param and each group's summary (final loss, samples to target, own best), what differs
between groups besides the param (confounders), reruns; the tests themselves are analysis.statistics."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from typing import NamedTuple


from voxdiff.analysis.convergence import FALLING, PAST_BEST, PLATEAU, best_point
from voxdiff.params import MEASUREMENT_KEYS, OPERATIONAL_KEYS
from voxdiff.report.loading import RunData, as_float


EXPECTED_TO_VARY = {"seed", "effective_batch_size", "effective_lr",  # derived from the effective batch by train.lr_scaling
                    "effective_adam_beta1", "effective_adam_beta2", "effective_adam_eps"}
# Params that do not shape the training trajectory: two runs equal in everything else are the same
# configuration trained twice (a re-run), not two seeds. Where runs go (mlflow.*), what is evaluated
# afterwards (evaluate.*), and the keys the trainer leaves out of its fingerprint (params.py: MEASUREMENT_KEYS,
# OPERATIONAL_KEYS, the one list both read): validation and noise-scale probes, post-hoc EMA profiles, the
# checkpoint cadence, the device, torch.compile and the precision asked for (the resolved precision, which
# does change the numbers, is its own param and stays in; so do train.tf32 and train.deterministic).
# train.gns_* and train.phema_* are measurement-only as families (tests/test_compare.py: every current one is in
# MEASUREMENT_KEYS): the prefixes also cover retired keys that archived runs carry (phema_snapshot_every_samples).
NOT_TRAINING_PREFIXES = ("mlflow.", "evaluate.", "train.gns_", "train.phema_")
NOT_TRAINING_KEYS = {f"train.{k}" for k in MEASUREMENT_KEYS + OPERATIONAL_KEYS} | {"device_resolved"}
# Training keys added after runs were archived, at the value that gives the behaviour those runs had
# (docs/study/grid.py says the same): a run without the key trained that way, so a missing key is neither
# a difference between runs nor another configuration.
ADDED_LATER = {"train.lr_schedule": "constant", "train.lr_min": "0.0"}
# The budget: varies by design when every run made the same number of optimizer steps (equal steps).
BUDGET_KEYS = {"train.max_samples", "train.max_steps"}
# A tag that names what was trained on: the same params on other data are another configuration.
TRAINING_TAGS = ("voxdiff.data_fingerprint",)


class RunBest(NamedTuple):
    """A run at its own convergence (convergence.best_point): its lowest val loss and its cost there."""
    level: float
    steps: float
    samples: float
    wall: float      # NaN when the run logged no wall time
    at_end: bool     # the lowest window was the run's last: still falling, level and cost are bounds


def run_best(r: RunData) -> RunBest | None:
    best = best_point(r.val_loss)
    if best is None:
        return None
    i = best.index
    return RunBest(best.level, float(r.val_steps[i]), float(r.val_samples[i]), float(r.val_wall[i]), best.at_end)


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
    flattening: list[float]           # val_flattening per run (last quarter's val gain / first quarter's)
    eval: dict[str, list[float]]
    posthoc: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # phema_* and ema_sigma_rel
    plateau: list[float] = dataclasses.field(default_factory=list)  # last-quarter relative change per run
    best: list[RunBest] = dataclasses.field(default_factory=list)   # each run at its lowest val loss
    verdicts: list[str] = dataclasses.field(default_factory=list)  # convergence.plateau_verdict per run, as plateau
    best_seeds: list[str] = dataclasses.field(default_factory=list)  # the seed of each run in `best`

    def best_by_seed(self, field: str) -> dict[str, float]:
        """One RunBest field per seed (the first run of a seed: reruns are dropped before grouping)."""
        out: dict[str, float] = {}
        for seed, b in zip(self.best_seeds, self.best):
            out.setdefault(seed, float(getattr(b, field)))
        return out

    @property
    def n(self) -> int:
        return len(self.final_val)

    @property
    def at_plateau(self) -> int:
        """Runs at their plateau by convergence.plateau_verdict (a run past its best is not one)."""
        return self.verdicts.count(PLATEAU)

    @property
    def still_falling(self) -> int:
        return self.verdicts.count(FALLING)

    @property
    def past_best(self) -> int:
        return self.verdicts.count(PAST_BEST)


def shapes_training(key: str) -> bool:
    return not key.startswith(NOT_TRAINING_PREFIXES) and key not in NOT_TRAINING_KEYS


def training_params(run: RunData) -> dict[str, str]:
    """The params that shape a run's training trajectory (seed included), keys added later filled in."""
    return {k: v for k, v in {**ADDED_LATER, **run.params}.items() if shapes_training(k)}


def training_configuration(run: RunData) -> tuple:
    """What determines a run's training trajectory: `training_params` and the data fingerprint."""
    return tuple(sorted(training_params(run).items())) + tuple((k, run.tags.get(k)) for k in TRAINING_TAGS
                                                               if k in run.tags)


def drop_reruns(runs: list[RunData]) -> tuple[list[RunData], list[RunData]]:
    """(kept, dropped): of the runs with an identical training configuration (the same seed trained
    again: DVC never restores `train` from its run cache), only the newest (start time, then run id)
    is kept; the others would count as extra seeds. Kept runs stay in their order."""
    newest: dict[tuple, RunData] = {}
    for r in runs:
        key = training_configuration(r)
        if key not in newest or (r.start_time, r.run_id) > (newest[key].start_time, newest[key].run_id):
            newest[key] = r
    kept_ids = {r.run_id for r in newest.values()}
    return [r for r in runs if r.run_id in kept_ids], [r for r in runs if r.run_id not in kept_ids]


def reruns_note(dropped: list[RunData]) -> str | None:
    if not dropped:
        return None
    n = len(dropped)
    return (f"left out {n} re-run{'s' if n != 1 else ''} of an identical configuration: run ids "
            f"{', '.join(r.run_id for r in dropped)} (the same params and seed as a newer run, which is kept: "
            "training the same configuration again is not another seed)")


def group_runs(runs: list[RunData], group_by: str) -> dict[str, list[RunData]]:
    groups: dict[str, list[RunData]] = {}
    for r in runs:
        groups.setdefault(r.params.get(group_by, "(unset)"), []).append(r)
    numeric = all(as_float(k) == as_float(k) for k in groups)  # NaN != NaN for non-numbers
    order = sorted(groups, key=lambda k: (as_float(k), k) if numeric else (0.0, k))
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
        setting={name: distinct(runs, p) for name, p in (
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
        flattening=[r.metrics["val_flattening"] for r in with_val if "val_flattening" in r.metrics],
        plateau=[r.plateau_change for r in with_val if r.plateau_change is not None],
        best=[b for r in with_val if (b := run_best(r)) is not None],
        best_seeds=[r.params.get("seed", "?") for r in with_val if run_best(r) is not None],
        verdicts=[r.plateau_verdict for r in with_val if r.plateau_change is not None],
        eval={k: [r.metrics[k] for r in with_val if k in r.metrics] for k in evals},
        posthoc=posthoc_metrics(with_val),
    )


def posthoc_metrics(runs: list[RunData]) -> dict[str, list[float]]:
    """phema_* metrics, the fixed EMA's sigma_rel and its final val loss, over the runs that tracked
    post-hoc EMA profiles (one value per such run, in the same order under every key)."""
    tracked = [r for r in runs if "phema_best_val_loss" in r.metrics]
    keys = sorted({k for r in tracked for k in r.metrics if k.startswith(("phema_", "ema_sigma_rel"))})
    out = {k: [r.metrics[k] for r in tracked if k in r.metrics] for k in keys}
    if tracked:
        out["fixed_ema_final_val_loss"] = [r.final_val_loss for r in tracked]
    return out


def confounders(runs: list[RunData], group_by: str) -> dict[str, list[str]]:
    """Params that shape training or what is evaluated (evaluate.*), other than the grouped one (and seed),
    that differ between runs; the budget keys not when every run made the same number of optimizer steps
    (an equal-steps design)."""
    params = [{**training_params(r), **{k: v for k, v in r.params.items() if k.startswith("evaluate.")}}
              for r in runs]
    expected = EXPECTED_TO_VARY | {group_by}
    steps = {r.metrics.get("total_steps") for r in runs}
    if len(steps) == 1 and None not in steps:
        expected |= BUDGET_KEYS
    keys = {k for p in params for k in p} - expected
    values = {k: sorted({p.get(k, "(unset)") for p in params}) for k in sorted(keys)}
    return {k: v for k, v in values.items() if len(v) > 1}


def distinct(runs: list[RunData], param: str) -> str:
    return "/".join(sorted({r.params.get(param, "?") for r in runs}))


def most_common_int(runs: list[RunData], param: str) -> int | None:
    values = [int(v) for r in runs if (v := as_float(r.params.get(param))) == v]
    return Counter(values).most_common(1)[0][0] if values else None
