"""Benchmark 11, `voxdiff advise`: its samples and wall time against the grid of trainings it replaces.

    .venv/bin/python benchmarks/run.py --only advise     # after `make demo` (uses models/checkpoint.pt)

The advice runs as the user runs it, `voxdiff advise` in a fresh process with its default settings, on the
repository's demo checkpoint when it is a finished run of these params (after `make demo`), else on its
own warm-up from scratch (said in the notes: then the time includes the warm-up and the phase is early).
Its samples (forward and backward through training steps and the probe; a validation draw counts 1/3: a
forward pass) are set against the study's archive (docs/study/runs): all of its runs, and the grid at the
same micro-batch and no LR scaling, the one that answers "which accumulate_every" at that micro-batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from harness import REPO, SCRATCH, goal, info

STUDY = REPO / "docs" / "study" / "runs"
TIME_GOAL_MIN = 5.0
SAMPLES_GOAL_PCT = 5.0


def study_grid(micro: int) -> dict:
    """Samples and runs of the study's archive, all of it and at this micro-batch (lr_scaling none), and
    the accumulate_every with the lowest mean final val loss there (the study's recommendation)."""
    runs = []
    for f in sorted(STUDY.glob("*.json")):
        r = json.loads(f.read_text())
        if r.get("status") == "FINISHED" and r["tags"].get("voxdiff.kind") == "train":
            runs.append(r)

    def samples(r) -> float:
        return float(r["metrics"].get("total_samples") or r["params"].get("train.max_samples") or 0)

    mine = [r for r in runs if r["params"].get("train.batch_size") == str(micro)
            and r["params"].get("train.lr_scaling") == "none"]
    finals: dict[int, list[float]] = {}
    for r in mine:
        finals.setdefault(int(r["params"]["train.accumulate_every"]), []).append(float(r["metrics"]["final_val_loss"]))
    best = min(finals, key=lambda k: sum(finals[k]) / len(finals[k])) if finals else None
    return {"runs": len(runs), "samples": sum(map(samples, runs)), "grid_runs": len(mine),
            "grid_samples": sum(map(samples, mine)), "best_accumulate_every": best}


def demo_checkpoint(raw: dict) -> Path | None:
    """models/checkpoint.pt when it is a finished run of this network, diffusion and grid (after make demo)."""
    import torch

    path = REPO / "models" / "checkpoint.pt"
    if not path.is_file():
        return None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return None
    same = all(state.get("params", {}).get(k) == raw[k] for k in ("model", "diffusion", "preprocess"))
    return path if same and state.get("finished") else None


def advise(ctx) -> dict:
    """voxdiff advise on the demo checkpoint: wall time (fresh process) and samples against the study's grid."""
    work = SCRATCH / "advise"
    work.mkdir(parents=True, exist_ok=True)
    params = work / "params.yaml"
    params.write_text(yaml.safe_dump(ctx.raw))
    ckpt = demo_checkpoint(ctx.raw)
    cmd = [str(Path(sys.executable).with_name("voxdiff")), "advise", "--root", str(ctx.root), "--params", str(params),
           "--out", str(work / "advise.md"), "--no-log", "--no-progress"]
    if ckpt is not None:
        cmd += ["--checkpoint", str(ckpt)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"voxdiff advise failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    data = json.loads((work / "advise.json").read_text())
    cost = data["cost"]
    used = cost["training_samples"] + cost["validation_draws"] / 3
    study = study_grid(ctx.base.train.batch_size)
    rec = data["recommended_one_device"] or data["recommended"]
    same = rec is not None and rec["accumulate_every"] == study["best_accumulate_every"]
    where = ("the demo's finished checkpoint (models/checkpoint.pt)" if ckpt is not None
             else f"its own warm-up from scratch (no finished demo checkpoint: run `make demo` first)")
    goals = [goal("advise wall time, fresh process", wall / 60, "<=", TIME_GOAL_MIN, unit="min",
                  why=f"{wall:.0f} s on {where}; by phase {cost['seconds_by_phase']} (load average: see above)"),
             goal("advise's samples vs the study's whole archive", 100 * used / study["samples"], "<=",
                  SAMPLES_GOAL_PCT, unit="%",
                  why=f"{used:.0f} sample-equivalents against {study['samples']:.0f} in {study['runs']} runs"),
             info(f"advise's samples vs the study's micro-batch {ctx.base.train.batch_size} grid",
                  100 * used / study["grid_samples"] if study["grid_samples"] else None, unit="%",
                  note=f"{study['grid_runs']} runs, {study['grid_samples']:.0f} samples"),
             info("same accumulate_every as the study's best at this micro-batch", same,
                  note=f"advise: {rec and rec['accumulate_every']}, study: {study['best_accumulate_every']}")]
    rows = [{"what": "advise, whole command (fresh process)", "s": wall},
            *({"what": f"advise phase: {k}", "s": v} for k, v in cost["seconds_by_phase"].items()),
            {"what": "training samples (sweep, probe passes, branches)", "samples": cost["training_samples"]},
            {"what": "validation draws (forward only)", "samples": cost["validation_draws"]},
            {"what": f"study archive ({study['runs']} runs)", "samples": study["samples"]},
            {"what": "B_crit: branches / noise scale", "value": f"{data['b_crit_branch']} / {data['b_noise']}"}]
    return {"goals": goals, "rows": rows, "advise": {k: data[k] for k in ("b_crit_branch", "b_crit_branch_ci",
                                                                          "b_noise", "b_noise_ci", "recommended",
                                                                          "current_cost", "agreement")},
            "notes": [f"Advised on {where}.",
                      "Samples = forward+backward samples of training steps, probe gradients (two passes each) and "
                      "branches, plus validation draws at 1/3 (forward only). The study's grid took "
                      f"{study['samples']:.0f} samples over {study['runs']} runs."]}


if __name__ == "__main__":  # the study's side alone: python benchmarks/advise_bench.py
    print(json.dumps({micro: study_grid(micro) for micro in (1, 2)}, indent=1))
