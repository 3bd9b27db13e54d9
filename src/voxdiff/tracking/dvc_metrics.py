"""The DVC metrics files: the few figures `dvc exp show` puts side by side, the rest one file over.

metrics/train.json and metrics/eval.json (dvc.yaml `metrics:`) hold nine figures under short names, so
that `dvc exp show --only-changed` after a queued grid fits a 160-column terminal (tests/test_e2e_dvc.py).
DVC's own columns take most of it: the experiment (25 characters), its date (8-12), state and executor
(18), the changed param (`train.accumulate_every`, 22), each with 3 of padding, and every dependency that
differs between experiments as a 32-character hash. Hence evaluate depends on the trained model through
`metrics/checkpoint.json` as a params file ({"checkpoint": 10 hex digits of the checkpoint's sha256}, a
10-character column) rather than on models/checkpoint.pt (a 32-character one), and the figures are few:

  train.json  val_loss    final validation loss (EMA weights, fixed draws): train_detail's final_val_loss
              plateau     1 when the val loss fell by less than convergence.PLATEAU_THRESHOLD (2 %) over the
                          last quarter of the steps (or rose), 0 when not, null with too few validations
              samples     samples seen (the same for every run of a grid at equal samples: --only-changed
                          leaves it out)
              samples/s   training samples per second
  eval.json   ssim        SSIM to the real volume (brain); ssim_floor: the higher of its two floors (noise,
                          tissue-mean), the figure to beat
              diversity   MS-SSIM between samples of one label map (1 = identical); diversity_ref: the same
                          for two images of one built-in label map (absent for your data)
              dice        label fidelity: Dice of a segmenter trained on real volumes on the samples against
                          their label maps, mean over the tissues (eval_dice_fidelity_mean; absent with
                          evaluate.segmenter_steps 0). Its references (the real volumes' Dice, noise) and
                          train-on-synthetic are in eval_detail.json
              ssim and ssim_floor are rounded to 3 decimals, dice to 2 (DVC prints 5 significant digits):
                          the 2 columns ssim saves and dice's 7 (4 + padding) keep a 2-run grid at 158 columns
                          in a replica of the e2e test's table (153 without dice)

Everything else (best val loss, early stopping's point (own_best_*), optimizer steps, clip fraction, the
plateau's change and level, post-hoc EMA, noise scale, timings, each floor, per-tissue figures, the MLflow
run id, checksums) is in metrics/train_detail.json and metrics/eval_detail.json under the names MLflow
uses: plain DVC outputs (cache: false), not metrics, read by `voxdiff metrics` and by anyone who wants
every field; the same names are in MLflow and in `voxdiff compare`.
"""

from __future__ import annotations

import json
from pathlib import Path

TRAIN_FIGURES = (("val_loss", "final_val_loss"), ("plateau", "plateau_reached"), ("samples", "total_samples"),
                 ("samples/s", "samples_per_s"))
EVAL_FIGURES = (("ssim", "eval_ssim"), ("diversity", "eval_msssim_samples"),
                ("diversity_ref", "eval_diversity_reference"), ("dice", "eval_dice_fidelity_mean"))
ROUNDED = {"ssim": 3, "ssim_floor": 3, "dice": 2}  # decimals in eval.json (every digit stays in eval_detail.json)


def train_figures(summary: dict) -> dict:
    """metrics/train.json from the training summary (metrics/train_detail.json)."""
    return {short: summary.get(key) for short, key in TRAIN_FIGURES}


def eval_figures(metrics: dict) -> dict:
    """metrics/eval.json from the evaluation's metrics (metrics/eval_detail.json)."""
    out = {"ssim": metrics.get("eval_ssim")}
    floors = [metrics.get(f"eval_ssim_floor_{f}") for f in ("noise", "tissue_mean")]
    out["ssim_floor"] = max(floors) if None not in floors else None
    out.update({short: metrics[key] for short, key in EVAL_FIGURES[1:] if key in metrics})
    return {k: round(v, ROUNDED[k]) if k in ROUNDED and isinstance(v, float) else v for k, v in out.items()}


def checkpoint_id(summary: dict) -> dict:
    """metrics/checkpoint.json: the trained model's identity for evaluate's DVC params."""
    return {"checkpoint": summary["checkpoint_sha256"][:10]}


def read(root: Path, name: str) -> dict:
    """Every field of metrics/<name>_detail.json ({} when missing); a workspace from before the split
    has them all in metrics/<name>.json, which is read instead."""
    detail = Path(root) / "metrics" / f"{name}_detail.json"
    if detail.is_file():
        return json.loads(detail.read_text())
    legacy = Path(root) / "metrics" / f"{name}.json"
    data = json.loads(legacy.read_text()) if legacy.is_file() else {}
    return data if {"final_val_loss", "eval_ssim"} & set(data) else {}
