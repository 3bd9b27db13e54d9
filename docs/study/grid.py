"""The study's grid, and which of its runs the archive (docs/study/runs/*.json) still lacks.

    python docs/study/grid.py missing [ARM..]  # one line of `-S key=value` overrides per missing run (of these arms)
    python docs/study/grid.py status           # how many runs of each arm are archived
    python docs/study/grid.py ids steps        # run ids of a design, as a filter term for voxdiff compare
                                               # (exit 3: none archived yet; 2: no such arm)

Every run is params.yaml (the demo configuration) with COMMON and the run's own overrides. A run is
archived when a run with exactly these params is in docs/study/runs/, so `make study` continues where
an earlier session stopped: the study accumulates across sessions, in the order listed here (seed 0 of
every setting first, so a partial study already spans the grid).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs"
EXPERIMENT = "voxdiff-study"
BUDGET = 1536  # samples of the equal-samples arms (the first 36 runs)
STEPS = 1536   # optimizer steps of the equal-steps arms: the archived micro-batch 1 x k 1 runs (1536 samples) are their k = 1 arm

# Keys of every run. The equal-steps arms set train.max_steps instead of max_samples (equal optimizer
# steps: each effective batch gets the same number of updates, so each can reach its own plateau).
# train.precision auto: bf16 autocast on a CPU with native bf16 (every run archived before the precision
# arm), fp32 without; each run records which as `precision_resolved`, and the precision arm measures what
# the difference does.
COMMON = {"train.val_every_samples": 64, "train.checkpoint_every": 64, "evaluate.subjects": 2,
          "evaluate.samples_per_condition": 2, "train.precision": "auto", "mlflow.experiment": EXPERIMENT}
SAMPLES = {"train.max_samples": BUDGET, "train.max_steps": 0}
EQUAL_STEPS = {"train.max_samples": 0, "train.max_steps": STEPS}
KS = (1, 2, 4, 8)
EPS_PILOT_STEPS = 6144  # 4x the x0 runs' steps (47 minutes on 2 CPU cores in fp32)
# The pilot did not plateau in 6144 steps (last quarter -6 %; its plateau is out of one run's reach in a
# session), so med-ddpm's regime gets an equal-steps design at 3072 steps: k 1 and 2, seeds 0-1 (k 2:
# 6144 samples, about 10 minutes with bf16 on a CPU with AMX, 47 in fp32 on 2 AVX2 cores). The pilot
# trained in fp32 and stays out of it: these runs are bf16 where the CPU has it, like the x0 study.
EPS_STEPS = 3072
EPSILON = {"diffusion.prediction": "epsilon", "train.grad_clip": 0.0}
# The arms that test why the noise scale misses (clipping, the L1 loss, the constant LR) compare effective
# batch 1 with 4 at equal steps: k 4 is 6144 samples (about 10 minutes in bf16 with AMX, 47 in fp32 on 2
# AVX2 cores), k 8 twice that; effective batch 4 is already past the measured B_crit (about 1).
CAUSE_KS = (1, 4)
LR_GRID = (5.0e-4, 2.0e-3)
# Twice the equal-steps arm's steps at effective batch 1 and 4, whose 1536-step runs still fell by 2 % or more
# in the last quarter on 2 of 3 seeds: does each settle by 3072 steps, and at the same level? At a constant
# LR the first 1536 steps of each are the steps arm's run of the same seed (the draws are a function of the
# global sample index), so the arm extends those runs. k 4 is 12,288 samples (about 30 minutes in bf16 with AMX).
LONG_STEPS = 2 * STEPS
# med-ddpm's regime to its plateau: the pilot's power-law fit (L_inf + a s^-alpha from step 512) passes the
# plateau criterion near 14,000 steps, so k 1 and 2 train 16,384 steps, seeds 0-1 (k 1 about 35 minutes, k 2
# about 60, in bf16 with AMX; at 3072 steps both still fell 7-9 % in the last quarter).
EPS_LONG_STEPS = 16384
# Training-set size as an axis, in med-ddpm's regime (issue 34): the eps-long runs over-fit their 10 training
# subjects, so the answer there may be the data's. One synthesised set of 336 subjects, 16 of them for
# validation (the same subjects and draws for every N: 64 validation samples, 8x the 8 the earlier arms used,
# for a validation jitter of at most ~0.5 % of the level where it was ~1 %); the training sets are nested
# subsets of the other 320 (data.train_subjects). Every run validates on one grid in samples (every 256,
# whatever k: the registered B_crit method reads steps-to-target on it, docs/study/data-size-protocol.md),
# keeps the EMA at its own best, and stops early once 8192 samples have passed since it (cap 32768 samples,
# stated before the runs: a run that reaches it says so as "at cap").
DATA_SIZE = {"data.subjects": 336, "data.val_subjects": 16}
DS_CAP = 32768
DS_REGIME = {**DATA_SIZE, **EPSILON, "train.batch_size": 1, "train.lr_scaling": "none", "train.max_steps": 0,
             "train.max_samples": DS_CAP, "train.val_every_samples": 256, "train.checkpoint_every": 256,
             "train.early_stop_patience_samples": 8192, "train.gns_buckets_every_samples": 2048}
DS_LR_GRID = (5.0e-4, 1.0e-3, 2.0e-3)  # chosen at the largest N, k 1, seed 0, over the first DS_LR_SAMPLES
DS_LR_SAMPLES = 8192
# The pilot (report_ds_lr.md, 8192 samples): final val loss 0.0547 at 5e-4, 0.0545 at 1e-3 (within 1 %: the
# registered tie rule takes the smaller lr), 0.0591 at 2e-3. Every data-size run uses it, at every k (no LR scaling).
DS_LR = 5.0e-4
# (N_train, k, seeds): 5 seeds at the largest N for a paired k 1 / k 2 comparison that can detect ~5 %; more (seeds
# 5, 6, 7) as the registered rule asks once those five pairs are archived (ds_seeds).
DS_DESIGN = ((160, (1, 2), (0, 1, 2, 3, 4)), (160, (4,), (0, 1, 2)), (40, (1, 2), (0, 1, 2)), (10, (1, 2), (0, 1, 2)))


@functools.cache
def records() -> tuple[dict, ...]:
    """The archive's runs (docs/study/runs/*.json), read once per process: each one's file, run id, status and params.
    Their metric histories are dropped: a hundred runs' histories held at once double the read (garbage collection)."""
    keep = ("run_id", "status", "params")
    return tuple({"path": p, **{k: r.get(k) for k in keep}} for p in sorted(RUNS.glob("*.json"))
                 for r in [json.loads(p.read_text())]) if RUNS.is_dir() else ()


@functools.cache
def ds_archived_levels() -> tuple[dict[int, float], dict[int, float]]:
    """The own-best levels (seed -> level) of the archived, finished N = 160 data-size runs at k 2 and at k 1."""
    from voxdiff.report.data_size import PAIRS_RULE_K, PAIRS_RULE_N, by_size, is_data_size_run, levels_by_seed
    from voxdiff.report.loading import record_to_run

    runs = [record_to_run(json.loads(r["path"].read_text())) for r in records()
            if r["status"] == "FINISHED" and r["params"].get("data.train_subjects") == str(PAIRS_RULE_N)]
    by_k = by_size([r for r in runs if is_data_size_run(r)]).get(PAIRS_RULE_N, {})
    return tuple(levels_by_seed(by_k.get(k, {})) for k in (PAIRS_RULE_K, 1))


def ds_seeds(n: int, ks: tuple[int, ...], seeds: tuple[int, ...]) -> tuple[int, ...]:
    """A DS_DESIGN row's seeds; for the rule's k 1 / k 2 pairs at its N, the design's first ones and then as many as
    the registered sample-size rule asks for from the pairs archived so far (data_size.pairs_wanted: sd(r) only)."""
    from voxdiff.report.data_size import PAIRS_RULE_K, PAIRS_RULE_N, pairs_wanted

    if n != PAIRS_RULE_N or set(ks) != {1, PAIRS_RULE_K}:
        return seeds
    return tuple(range(max(len(seeds), pairs_wanted(*ds_archived_levels()))))


def arms() -> list[tuple[str, dict]]:
    """(arm, overrides) in run order. First the 36 archived equal-samples runs (micro-batch 1 and 2,
    no LR scaling, 3 seeds; then the LR rules at micro-batch 2, 2 seeds). Then the equal-steps study
    of the critical batch (issue: the answer at convergence): micro-batch 1 x k 2/4/8 for STEPS steps
    (the archived 1536-step k = 1 runs are its k = 1 arm), seed 0 of every k first, smallest k first
    (a run cut short by the end of a session is lost: the cheaper ones land first); then the arms that test the noise scale's miss and the
    regime: a pilot of med-ddpm's epsilon-prediction regime and its k 1 / 2 arm, clipping off, the L2 loss,
    a cosine LR decay (each at effective batch 1 and 4), an LR grid at effective batch 1 and 8, and effective
    batch 1 and 4 trained twice as long (do they settle?), and med-ddpm's regime to its plateau."""
    out = []
    for seed in (0, 1, 2):
        for micro in (2, 1):
            for k in KS:
                out.append(("main", {**SAMPLES, "train.batch_size": micro, "train.accumulate_every": k,
                                     "train.lr_scaling": "none", "seed": seed}))
        if seed < 2:
            for rule in ("sqrt", "linear", "sde"):
                for k in (1, 8):  # reference_batch 4 = micro-batch 2 x k 2: k 1 and 8 are the rules' extremes
                    out.append((f"lr-{rule}", {**SAMPLES, "train.batch_size": 2, "train.accumulate_every": k,
                                               "train.lr_scaling": rule, "seed": seed}))
    # Does the precision change the answer? Micro-batch 1 x k 1, seed 0, in fp32 against the archived bf16
    # runs of that setting (3 seeds): runs resolved to fp32 on a CPU without native bf16 are pooled with the
    # bf16 ones only as far as this comparison allows (report_precision.md).
    out.append(("precision", {**SAMPLES, "train.batch_size": 1, "train.accumulate_every": 1, "train.lr_scaling": "none",
                              "train.precision": "fp32", "seed": 0}))
    micro1 = {**EQUAL_STEPS, "train.batch_size": 1, "train.lr_scaling": "none"}
    for seed in (0, 1, 2):
        for k in (2, 4, 8):
            out.append(("steps", {**micro1, "train.accumulate_every": k, "seed": seed}))
        if seed == 0:
            # med-ddpm's regime (epsilon-prediction, L1, no clipping): how many steps until it shows
            # anatomy and plateaus here (docs/tuning.md: still noise after 768 samples). The eps arm
            # below is sized from it.
            out.append(("eps-pilot", {**micro1, "train.max_steps": EPS_PILOT_STEPS, "train.accumulate_every": 1,
                                      **EPSILON, "seed": 0}))
    for seed in (0, 1):
        for k in (1, 2):
            out.append(("eps", {**micro1, "train.max_steps": EPS_STEPS, "train.accumulate_every": k,
                                **EPSILON, "seed": seed}))
        for k in CAUSE_KS:
            out.append(("steps-noclip", {**micro1, "train.accumulate_every": k, "train.grad_clip": 0.0, "seed": seed}))
            out.append(("steps-l2", {**micro1, "train.accumulate_every": k, "diffusion.loss": "l2", "seed": seed}))
            out.append(("steps-cosine", {**micro1, "train.accumulate_every": k, "train.lr_schedule": "cosine",
                                         "train.lr_min": 1.0e-5, "seed": seed}))
    # LR per batch (Shallue et al. 2019: most batch-size disagreements are untuned LRs): x0.5 and x2 around
    # the study's 1e-3 at effective batch 1 and 8; the x1 runs are the steps arm's.
    for seed in (0, 1):
        for k in (1, 8):
            for lr in LR_GRID:
                out.append(("steps-lr", {**micro1, "train.accumulate_every": k, "train.lr": lr, "seed": seed}))
    for seed in (0, 1, 2):
        for k in CAUSE_KS:
            out.append(("steps-long", {**micro1, "train.max_steps": LONG_STEPS, "train.accumulate_every": k,
                                       "seed": seed}))
    for seed in (0, 1):
        for k in (1, 2):
            out.append(("eps-long", {**micro1, "train.max_steps": EPS_LONG_STEPS, "train.accumulate_every": k,
                                     **EPSILON, "seed": seed}))
    # Data size: the LR pilot first, then seed by seed (k 1 and k 2 of a seed back to back: a pair is what the
    # paired analysis reads), the largest N first.
    for lr in DS_LR_GRID:
        out.append(("ds-lr", {**DS_REGIME, "data.train_subjects": 160, "train.accumulate_every": 1,
                              "train.max_samples": DS_LR_SAMPLES, "train.early_stop_patience_samples": 0,
                              "train.lr": lr, "seed": 0}))
    for n, ks, seeds in DS_DESIGN if DS_LR is not None else ():
        for seed in ds_seeds(n, ks, seeds):
            for k in ks:
                out.append((f"data-size-{n}", {**DS_REGIME, "data.train_subjects": n, "train.accumulate_every": k,
                                               "train.lr": DS_LR, "seed": seed}))
    return out


def archived() -> list[dict]:
    return [r["params"] for r in records()]


# Keys an arm sets that only decide what is measured, never the trajectory: they tell no run of one arm from a
# run of another (the archived runs probed at 512 or 768 samples; the data-size arm probes every 2048).
MEASURING_ONLY = ("train.gns_buckets_every_samples",)


def defaults() -> dict:
    """params.yaml's value, as MLflow logs it (str), of every key some arm sets: a run of one arm must not
    count as a run of another that leaves the key at its default (the steps arm's k 4 is not the no-clip
    arm's k 4)."""
    from voxdiff.params import flatten, load_yaml

    flat = flatten(load_yaml((HERE.parents[1] / "params.yaml").read_text()))
    keys = {k for _, o in arms() for k in {**COMMON, **o} if not k.startswith("mlflow.") and k not in MEASURING_ONLY}
    return {k: str(flat[k]) for k in keys if flat.get(k) is not None}


def is_archived(overrides: dict, done: list[dict], base: dict | None = None) -> bool:
    base = defaults() if base is None else base
    want = {**base, **{k: str(v) for k, v in {**COMMON, **overrides}.items() if not k.startswith("mlflow.")}}
    # Keys added after a run was archived are at their default there (constant LR, clipping on, L1).
    return any(all(p.get(k, base.get(k)) == v for k, v in want.items()) for p in done)


def design(arm: str) -> list[dict]:
    """The runs one comparison reads: an arm's own, and for the equal-steps arm also its k = 1 arm, the
    archived micro-batch 1 x k 1 equal-samples runs (1536 samples = 1536 steps); for the precision arm
    the same runs, its bf16 counterpart; for the LR grid its x1 point, the same k = 1 runs and the steps
    arm's k = 8."""
    runs = [o for a, o in arms() if a == arm]
    if arm in ("steps", "precision", "steps-lr"):
        runs += [o for a, o in arms() if a == "main" and o["train.batch_size"] == 1 and o["train.accumulate_every"] == 1]
    if arm == "steps-lr":
        runs += [o for a, o in arms() if a == "steps" and o["train.accumulate_every"] == 8]
    return runs


def archived_ids(overrides: list[dict]) -> list[str]:
    ids, base = [], defaults()
    for record in records():
        if record.get("status") == "FINISHED" and any(is_archived(o, [record["params"]], base) for o in overrides):
            ids.append(record["run_id"])
    return ids


def missing(only: list[str] | None = None) -> list[tuple[str, dict]]:
    """The runs still to do, in run order; `only`: of these arms."""
    done, base = archived(), defaults()
    return [(arm, o) for arm, o in arms() if not is_archived(o, done, base) and (not only or arm in only)]


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "status"
    known = dict.fromkeys(a for a, _ in arms())
    unknown = [a for a in argv[2:] if a not in known] if cmd in ("ids", "missing") else []
    if unknown:
        print(f"grid.py: unknown arm {unknown[0]!r} (arms: {', '.join(known)})", file=sys.stderr)
        return 2
    if cmd == "ids" and len(argv) != 3:
        print("grid.py: usage: grid.py ids ARM", file=sys.stderr)
        return 2
    if cmd == "ids":
        # 3, not 1, when none is archived yet: report.sh tells "nothing yet" from a crash (Python exits 1)
        ids = archived_ids(design(argv[2]))
        print("attributes.run_id IN (" + ", ".join(f"'{i}'" for i in ids) + ")")
        return 0 if ids else 3
    if cmd == "missing":
        for _, o in missing(argv[2:]):
            print(" ".join(f"-S {k}={v}" for k, v in {**COMMON, **o}.items()))
        return 0
    todo = missing()
    total = arms()
    for arm in dict.fromkeys(a for a, _ in total):
        n = sum(a == arm for a, _ in total)
        left = sum(a == arm for a, _ in todo)
        print(f"{arm:12s} {n - left:3d}/{n} archived")
    return 0


if __name__ == "__main__":
    import signal

    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `grid.py missing | head` ends quietly
    sys.exit(main(sys.argv))
