"""Does `voxdiff advise` agree with the study's measured critical batch? (about 15 minutes per micro-batch on 2 free CPU cores)

    .venv/bin/python benchmarks/advise_vs_study.py                 # micro-batch 2, seed 0
    .venv/bin/python benchmarks/advise_vs_study.py --micro 1       # med-ddpm's micro-batch
    .venv/bin/python benchmarks/advise_vs_study.py --phases 512    # one phase only

What it does, in benchmarks/.scratch/advise_vs_study/ (nothing under the repository's data/, models/ or
mlflow.db is touched):

1. trains the study's configuration (params.yaml, micro-batch --micro x accumulate_every 1, seed --seed,
   1536 samples: the study's k = 1 run) with the real Trainer and keeps a checkpoint at each phase the study
   probed: early, middle, late = 512, 1024, 1536 samples (about 5 minutes of training in all);
2. runs `voxdiff advise` (its default settings, branches at --micro x 1, 2, 4, 8) on each checkpoint
   (about 2.5 minutes each);
3. reads the study's own B_crit at the same phase from its archive (docs/study/runs: the 12 runs at this
   micro-batch, no LR scaling): the val loss the k = 1 run of this seed had at the phase sets a window
   [loss x 1.15, loss] just above it, and the optimizer steps each archived run took to cross the window
   (from its upper to its lower edge, interpolated between validations) are fitted with
   S = S_min (1 + B_crit / B) (convergence.bootstrap_critical_batch over the seeds). That is the local
   trade-off at that loss, what the branches measure. Runs that never reach the window's lower edge are
   left out and named. Where fewer than 3 batch sizes reach the window (the middle and late phases: the
   large batches never get that low within the study's 1536 samples, so the study cannot measure B_crit
   there), the comparison falls back to the study report's own figure, B_crit at the deepest target every
   run reaches (`voxdiff compare`'s critical-batch table), and says so; the cumulative fit (steps from the
   start to the phase's loss) is written beside both;
4. writes benchmarks/advise_vs_study.md and .json (advise_vs_study_micro1.* for --micro 1): per phase, the study's B_crit with its interval, advise's
   branch B_crit and noise scale, their ratios to the study's and whether each is within 2x.

A ratio beyond 2x is reported, not hidden: the README section on advise says where and why.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
import yaml  # noqa: E402

import harness  # noqa: E402

PHASES = (512, 1024, 1536)
WINDOW = (1.15, 1.00)   # the local window above the phase's val loss: from loss x 1.15 down to the loss itself
OUT = harness.HERE / "advise_vs_study"  # micro-batch 2; another micro-batch writes advise_vs_study_micro<N>


def out_path(micro: int) -> Path:
    return OUT if micro == 2 else OUT.with_name(f"{OUT.name}_micro{micro}")


def train_phases(raw: dict, root: Path, phases, work: Path) -> dict[int, Path]:
    """The study's run of this setting, checkpointed at each phase (the trajectory does not depend on where
    it is cut: every schedule is counted in samples against the 1536-sample budget)."""
    from voxdiff.data.cache import open_cache
    from voxdiff.params import validate
    from voxdiff.training import checkpoint
    from voxdiff.runtime.distributed import init_runtime
    from voxdiff.pipeline.train import run_sample_counted_events
    from voxdiff.training.trainer import Trainer

    params = validate(raw)
    rt = init_runtime(params.train.device, params.train.precision)
    tr = Trainer(params, root, rt, open_cache(root / "data" / "processed"))
    paths, todo = {}, sorted(phases)
    for p in todo:
        path = work / f"checkpoint-{p}.pt"
        if path.is_file():
            paths[p] = path
    if len(paths) == len(todo):
        return paths
    while tr.counters.samples_seen < max(todo):
        before = tr.counters.samples_seen
        record = tr.train_step()
        last = tr.counters.samples_seen >= tr.budget.total_samples
        run_sample_counted_events(tr, record, before, last)  # validation as in training (the EMA curve)
        tr.counters.history.append(record)
        for p in todo:
            if before < p <= tr.counters.samples_seen and p not in paths:
                paths[p] = work / f"checkpoint-{p}.pt"
                checkpoint.save(paths[p], tr.state(last, None))
                print(f"[advise_vs_study] checkpoint at {tr.counters.samples_seen} samples", file=sys.stderr)
    return paths


def study_runs(micro: int, design: str = "equal-steps"):
    """The study's runs of this micro-batch in its main regime (x0, L1, clip 1, constant lr 1e-3, bf16 via
    precision auto, not the precision arm's fp32 run). At micro-batch 1 the equal-steps design: k = 1 from
    the 1536-sample runs, k = 2, 4, 8 from the 1536-step runs (which reach the middle and late phases' val
    loss, so the local B_crit is measurable there); at micro-batch 2 the 1536-sample runs."""
    from voxdiff.report.loading import read_archive

    runs, _ = read_archive(harness.REPO / "docs" / "study" / "runs",
                           {"train.batch_size": str(micro), "train.lr_scaling": "none", "train.precision": "auto",
                            "diffusion.prediction": "sample", "diffusion.loss": "l1", "train.grad_clip": "1.0",
                            "train.lr": "0.001"})
    constant = [r for r in runs if r.params.get("train.lr_schedule") in (None, "constant")]
    samples = [r for r in constant if r.params.get("train.max_samples") == "1536"]
    steps = [r for r in constant if r.params.get("train.max_steps") == "1536"]
    if design == "equal-samples" or micro != 1 or not steps:
        return samples
    return [r for r in samples if r.params.get("train.accumulate_every") == "1"] + steps


def study_b_crit(runs, seed: int, phase: int) -> dict:
    """The study's local B_crit at the val loss its k = 1 run (this seed) had at `phase` samples."""
    from voxdiff.analysis.convergence import bootstrap_critical_batch, fit_critical_batch

    ref = next(r for r in runs if r.params.get("train.accumulate_every") == "1" and r.params.get("seed") == str(seed))
    level = float(np.interp(phase, ref.val_samples, ref.val_loss))
    hi, lo = level * WINDOW[0], level * WINDOW[1]
    local: dict[float, list[float]] = {}
    cumulative: dict[float, list[float]] = {}
    left_out = []
    for r in runs:
        b = float(r.params["effective_batch_size"])
        start, end = r.crossing(hi, r.val_steps), r.crossing(lo, r.val_steps)
        at = r.crossing(level, r.val_steps)
        if at is not None:
            cumulative.setdefault(b, []).append(at)
        if start is None or end is None or end <= start:
            left_out.append(f"B={b:g} seed {r.params.get('seed')}")
            continue
        local.setdefault(b, []).append(end - start)

    def fitted(steps):
        if len(steps) < 2:
            return None
        fit = fit_critical_batch([b for b, v in steps.items() for _ in v], [s for v in steps.values() for s in v])
        ci = bootstrap_critical_batch(steps, n_boot=2000, seed=0, level=0.9)
        return {"b_crit": fit.b_crit, "lo": ci.lo, "hi": ci.hi, "batches": sorted(steps)}

    return {"phase": phase, "val_loss": level, "window": [hi, lo],
            "local": fitted(local) if len(local) >= 3 else None, "cumulative": fitted(cumulative),
            "deepest_common_target": deepest_common(runs, fitted), "left_out": left_out}


def deepest_common(runs, fitted) -> dict | None:
    """The report's figure: B_crit at the deepest of compare's target levels (every run reaches it)."""
    from voxdiff.analysis.convergence import target_levels

    start = min(float(r.val_loss[0]) for r in runs)
    reached = max(float(r.val_loss.min()) for r in runs)
    levels = target_levels(start, reached, 3)
    if not levels:
        return None
    steps: dict[float, list[float]] = {}
    for r in runs:
        s = r.crossing(levels[-1], r.val_steps)
        if s is not None:
            steps.setdefault(float(r.params["effective_batch_size"]), []).append(s)
    out = fitted(steps)
    return None if out is None else {**out, "target": levels[-1]}


def ratio_cell(x, ref) -> tuple[float | None, bool | None]:
    if x is None or ref is None or not (0 < ref < math.inf) or not (0 < x < math.inf):
        return None, None
    r = x / ref
    return r, 0.5 <= r <= 2.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--micro", type=int, default=2, help="micro-batch of the study's grid (1 or 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--phases", default=",".join(map(str, PHASES)))
    ap.add_argument("--advise-args", default="", help="extra `voxdiff advise` options, e.g. '--budget-samples 256'")
    ap.add_argument("--no-control", action="store_true",
                    help="skip the control: advise again with --adam-moment-samples 0 (the checkpoint's Adam v kept)")
    ap.add_argument("--out", type=Path, default=None,
                    help="results file stem (default: benchmarks/advise_vs_study[_micro<N>]); .md and .json are written")
    ap.add_argument("--refit", type=Path, default=None, metavar="RESULTS_JSON",
                    help="no training, no measurement: re-fit the branch curves that the run which wrote RESULTS_JSON "
                         "left in benchmarks/.scratch with the current voxdiff.advise.fit (a change of the fit alone); "
                         "timings and machine are that run's, and the report says so")
    a = ap.parse_args(argv)
    phases = [int(p) for p in a.phases.split(",")]
    prior = json.loads(a.refit.read_text()) if a.refit else None
    if prior:  # the re-fitted run's micro-batch, seed and phases, and never over its own results
        a.micro, a.seed, phases = prior["micro"], prior["seed"], [r["phase"] for r in prior["rows"]]
        if (a.out or out_path(a.micro)).with_suffix(".json").resolve() == a.refit.resolve():
            ap.error("--refit: give --out another stem than the results being re-fitted")

    raw = yaml.safe_load((harness.REPO / "params.yaml").read_text())
    raw = harness.with_overrides(raw, {"seed": a.seed, "train.batch_size": a.micro, "train.accumulate_every": 1,
                                       "train.max_samples": max(PHASES), "train.max_steps": 0,
                                       "train.phema_sigma_rels": []})
    work = harness.SCRATCH / "advise_vs_study" / f"micro{a.micro}-seed{a.seed}"
    root = None if prior else harness.data_root(raw)
    work.mkdir(parents=True, exist_ok=True)
    params = work / "params.yaml"
    if not prior:
        params.write_text(yaml.safe_dump(raw))
    t0 = time.time()
    ckpts = None if prior else train_phases(copy.deepcopy(raw), root, phases, work)
    trained_s = prior["training_seconds"] if prior else time.time() - t0

    from voxdiff.advise.command import AdviseOptions, run_advise

    runs = study_runs(a.micro)
    samples_runs = study_runs(a.micro, "equal-samples")
    if {r.run_id for r in samples_runs} == {r.run_id for r in runs}:
        samples_runs = runs  # one replicate set only (micro-batch 2): no second table
    extra = a.advise_args.split()
    from voxdiff.runtime.distributed import pick_device

    rows = []
    stepped = sorted({int(r.params["train.accumulate_every"]) for r in runs if r.params.get("train.max_steps") == "1536"})
    design = (f"k = 1 from the 1536-sample runs, k = {', '.join(map(str, stepped))} from the 1536-step runs"
              if stepped else "the 1536-sample runs")
    result = {"study_design": design, "micro": a.micro, "seed": a.seed, "training_seconds": trained_s, "rows": rows, "window": WINDOW,
              "machine": prior["machine"] if prior else harness.machine(pick_device(raw["train"]["device"])),
              "precision": prior["precision"] if prior else precision_of(ckpts),
              "refit_of": a.refit.name if prior else None}
    for p in phases:
        t1 = time.time()
        opts = dict(root=root, params_path=params, checkpoint=ckpts[p] if ckpts else None, out=work / f"advise-{p}.md", log=False,
                    progress=False, branch_batches=tuple(a.micro * f for f in (1, 2, 4, 8)))
        for key, value in zip(extra[::2], extra[1::2]):  # --budget-samples 256 -> budget_samples=256
            opts[key.lstrip("-").replace("-", "_")] = int(value)
        t1 = time.time()
        kept = work / f"advise-{p}-v-kept.json"
        if prior:
            old = next(r for r in prior["rows"] if r["phase"] == p)
            advise_seconds = old["advise_seconds"]
            data = refit(json.loads((work / f"advise-{p}.json").read_text()), old["advise"]["b_noise"])
            control = (refit(json.loads(kept.read_text()))
                       if not a.no_control and old.get("control_v_kept") else None)
        else:
            run_advise(AdviseOptions(**opts), echo=lambda s: print(s, file=sys.stderr))
            advise_seconds = time.time() - t1
            data = json.loads((work / f"advise-{p}.json").read_text())
            control = None
            if not a.no_control:
                run_advise(AdviseOptions(**{**opts, "adam_moment_samples": 0, "out": kept.with_suffix(".md")}),
                           echo=lambda s: print(s, file=sys.stderr))
                control = json.loads(kept.read_text())
        study = study_b_crit(runs, a.seed, p)
        replicate = study_b_crit(samples_runs, a.seed, p) if samples_runs is not runs else None
        basis = "local" if study["local"] else "deepest_common_target"
        ref = (study[basis] or {}).get("b_crit")
        br, br_ok = ratio_cell(data["b_crit_branch"], ref)
        nr, nr_ok = ratio_cell(data["b_noise"], ref)
        ar, ar_ok = ratio_cell(data.get("b_noise_adam"), ref)
        rows.append({"phase": p, "study": study, "advise": {k: data.get(k) for k in (
            "b_crit_branch", "b_crit_branch_ci", "b_crit_branch_status", "b_crit_branch_bound", "b_noise", "b_noise_ci", "b_noise_adam",
            "b_noise_adam_ci", "trusted",
            "agreement", "recommended_one_device", "cost")}, "study_basis": basis, "branch_over_study": br,
            "branch_within_2x": br_ok, "noise_over_study": nr, "noise_within_2x": nr_ok, "adam_over_study": ar,
            "adam_within_2x": ar_ok, "advise_seconds": advise_seconds,
            "study_equal_samples_runs": replicate,
            "control_v_kept": None if control is None else {
                "b_crit_branch": control["b_crit_branch"], "b_crit_branch_ci": control["b_crit_branch_ci"],
                "b_crit_branch_status": control.get("b_crit_branch_status"),
                "ratio": ratio_cell(control["b_crit_branch"], ref)[0]}})
        write(result, a.out or out_path(a.micro))  # after every phase: an interrupted run keeps the phases it finished
    print(markdown(result))
    return 0


def refit(data: dict, b_noise: float | None = None) -> dict:
    """An advise.json's branch verdict redone from its stored curves with the current fit (and the verdict
    against its stored noise scale); everything measured stays as it was, and what followed from the old
    verdict (the recommendation and its cost) is dropped. `b_noise`: the re-fitted run's noise scale for this
    file, which must match (scratch may hold a later run's files)."""
    from voxdiff.advise import fit, report

    if b_noise is not None and b_noise != data["b_noise"]:
        sys.exit(f"--refit: the scratch advise JSON (B_noise {data['b_noise']}) is not the re-fitted run's "
                 f"({b_noise}): a later run overwrote it")
    b = data["branches"]
    curves = [fit.BranchCurve(**{k: tuple(v) if isinstance(v, list) else v for k, v in c.items()}) for c in b["curves"]]
    got = fit.fit_branches(curves, level=data["ci_level"], usable_from=4 * b["ema_halflife"], planned=b["batches"])
    verdict = fit.reconcile(got, data["b_noise"], data["b_noise_ci"][0])

    def finite(x):  # the JSON's null for inf
        return None if x is None or x == math.inf else x

    return {**data, "b_crit_branch": finite(got.b_crit), "b_crit_branch_ci": [finite(got.lo), finite(got.hi)],
            "b_crit_branch_status": got.status, "b_crit_branch_bound": report._bound(got), "trusted": verdict.trusted,
            "agreement": verdict.sentence, "recommended_one_device": None, "cost": None}


def write(result: dict, out: Path) -> None:
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=float) + "\n")
    out.with_suffix(".md").write_text(markdown(result))


def precision_of(ckpts: dict) -> str:
    """The precision the checkpoints trained in (the study's archive: bf16, on a CPU with native bf16)."""
    from voxdiff.training import checkpoint

    return str(checkpoint.load(next(iter(ckpts.values()))).get("precision_resolved", "unknown"))


def _n(x, fmt=".3g"):
    return "—" if x is None else ("∞" if x == math.inf else format(x, fmt))


def _interval(ci) -> str:
    ci = list(ci or [None, None])
    if ci[0] is not None and ci[1] is None:  # the JSON writes an unbounded upper end as null
        ci[1] = math.inf
    return f"({_n(ci[0])}–{_n(ci[1])})"


def branch_cell(a: dict) -> str:
    status, bound = a.get("b_crit_branch_status"), a.get("b_crit_branch_bound") or {}
    if status == "plateau":
        return "not measurable: at a plateau"
    if status in ("no target", "no fit"):
        return status
    if status == "bound" and bound:
        side, batch = next(iter(bound.items()))
        return f"{side} {batch} {_interval(a['b_crit_branch_ci'])}"
    return f"{_n(a['b_crit_branch'])} {_interval(a['b_crit_branch_ci'])}"


def control_cells(control: dict | None) -> str:
    if control is None:
        return "— | —"
    return f"{branch_cell(control)} | {_n(control['ratio'], '.2f')}"


def study_design(result: dict) -> str:
    return result.get("study_design", "the 1536-sample runs")


def markdown(result: dict) -> str:
    m = result.get("machine", {})
    lines = [f"# advise against the study (micro-batch {result['micro']}, seed {result['seed']})", "",
             f"Trained and advised in {result.get('precision', '?')} on {m.get('cpu', '?')} ({m.get('cores_logical', '?')} "
             f"cores{', native bf16' if m.get('native_bf16') else ', no native bf16' if 'native_bf16' in m else ''}); "
             f"training to the last phase took {result['training_seconds']:.0f} s. The study's runs trained in bf16.", "",
             *([f"Re-fit: the branch curves measured by the run that wrote `{result['refit_of']}` (the same checkpoints "
                "and timings), fitted again with the current `voxdiff.advise.fit`; nothing was measured again.", ""]
               if result.get("refit_of") else []),
             "Study: local B_crit from the archived runs' optimizer steps across the window "
             f"[val loss × {WINDOW[0]}, × {WINDOW[1]}] at the val loss the k = 1 run had at the phase "
             "(90 % bootstrap interval over seeds), or, where fewer than 3 batch sizes get that low, the report's "
             "B_crit at the deepest target every run reaches; cumulative: steps from the start to that loss. advise: "
             "`voxdiff advise` with its defaults on the k = 1 run's checkpoint at the phase (each branch's Adam second "
             "moment moved to its batch by the sampling noise's share); control: the same with --adam-moment-samples 0 (the checkpoint's v kept). "
             f"Study runs: {study_design(result)}.", "",
             "| phase (samples) | val loss | study B_crit used (interval) | basis | study, cumulative | advise "
             "branches (interval) | ratio | within 2× | noise scale | ratio | within 2× | noise scale, Adam's "
             "coordinates | ratio | within 2× | control: branches, v kept (interval) | ratio | advise s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        s, a = r["study"], r["advise"]
        loc, cum = s[r["study_basis"]] or {}, s["cumulative"] or {}
        basis = ("local window" if r["study_basis"] == "local" else
                 f"deepest common target {loc.get('target', float('nan')):.4f} (local not measurable)")
        lines.append(f"| {r['phase']} | {s['val_loss']:.4f} | {_n(loc.get('b_crit'))} ({_n(loc.get('lo'))}–"
                     f"{_n(loc.get('hi'))}) | {basis} | {_n(cum.get('b_crit'))} | {branch_cell(a)} | "
                     f"{_n(r['branch_over_study'], '.2f')} | {r['branch_within_2x']} | "
                     f"{_n(a['b_noise'])} | {_n(r['noise_over_study'], '.2f')} | {r['noise_within_2x']} | "
                     f"{_n(a.get('b_noise_adam'))} | {_n(r.get('adam_over_study'), '.2f')} | {r.get('adam_within_2x', '—')} | "
                     f"{control_cells(r.get('control_v_kept'))} | {r['advise_seconds']:.0f} |")
    replicates = [r for r in result["rows"] if r.get("study_equal_samples_runs")]
    if replicates:
        lines += ["", "The study's reference from the other replicate set: the 1536-sample runs at k = 2, 4, 8 (same "
                  "settings and seeds as the 1536-step runs over their first 1536 samples, trained from an earlier commit, "
                  "so not the same trajectories): local and cumulative B_crit (90 % interval).", "",
                  "| phase | equal-steps runs: local | cumulative | 1536-sample runs: local | cumulative |",
                  "|---|---|---|---|---|"]
        for r in replicates:
            cells = []
            for s in (r["study"], r["study_equal_samples_runs"]):
                for key in ("local", "cumulative"):
                    f = s[key] or {}
                    cells.append(f"{_n(f.get('b_crit'))} ({_n(f.get('lo'))}–{_n(f.get('hi'))})")
            lines.append(f"| {r['phase']} | " + " | ".join(cells) + " |")
    for r in result["rows"]:
        if r["study"]["left_out"]:
            lines.append(f"\nPhase {r['phase']}: runs left out of the study's fit (never crossed the window): "
                         + ", ".join(r["study"]["left_out"]))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
