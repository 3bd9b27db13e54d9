"""The DVC metrics files hold a few figures under short names (tracking/dvc_metrics.py); `voxdiff metrics`
reads every field from the detail files next to them, and from a workspace written before the split."""

from __future__ import annotations

import json

from click.testing import CliRunner

from voxdiff.cli import main
from voxdiff.tracking import dvc_metrics

SUMMARY = {"final_val_loss": 0.0341, "best_val_loss": 0.0339, "plateau_reached": 1, "plateau_change": -0.004,
           "total_samples": 1536, "total_steps": 768, "samples_per_s": 3.46, "clip_fraction": 0.12,
           "effective_batch_size": 2, "gns": None, "gns_note": "not measurable", "mlflow_run_id": "abc",
           "checkpoint_sha256": "0123456789abcdef" * 4, "own_best_val_loss": 0.0335, "own_best_step": 704}
EVAL = {"eval_ssim": 0.85, "eval_ssim_floor_noise": 0.01, "eval_ssim_floor_tissue_mean": 0.77, "eval_psnr": 20.5,
        "eval_psnr_floor_noise": 5.0, "eval_psnr_floor_tissue_mean": 18.0, "eval_msssim_samples": 0.95,
        "eval_diversity_reference": 0.96, "eval_w1_csf": 0.1, "eval_dice_fidelity_mean": 0.81234}


def test_figures_are_the_few_a_reader_compares():
    assert dvc_metrics.train_figures(SUMMARY) == {"val_loss": 0.0341, "plateau": 1, "samples": 1536, "samples/s": 3.46}
    assert dvc_metrics.eval_figures(EVAL) == {"ssim": 0.85, "ssim_floor": 0.77, "diversity": 0.95,
                                              "diversity_ref": 0.96, "dice": 0.81}  # ssim 3 decimals, dice 2
    assert dvc_metrics.eval_figures({**EVAL, "eval_ssim": 0.86236})["ssim"] == 0.862
    no_reference = {k: v for k, v in EVAL.items() if k != "eval_diversity_reference"}
    assert "diversity_ref" not in dvc_metrics.eval_figures(no_reference)
    assert dvc_metrics.checkpoint_id(SUMMARY) == {"checkpoint": "0123456789"}


def write(root, name, data):
    (root / "metrics").mkdir(exist_ok=True)
    (root / "metrics" / name).write_text(json.dumps(data))


def test_voxdiff_metrics_reads_the_detail_files(tmp_path):
    write(tmp_path, "train.json", dvc_metrics.train_figures(SUMMARY))
    write(tmp_path, "train_detail.json", SUMMARY)
    write(tmp_path, "eval.json", dvc_metrics.eval_figures(EVAL))
    write(tmp_path, "eval_detail.json", EVAL)
    res = CliRunner().invoke(main, ["metrics", "--root", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "best val loss" in res.output and "0.0339" in res.output and "optimizer steps" in res.output
    assert "floors: noise 0.01, tissue-mean 0.77" in res.output and "(not measurable)" in res.output
    # early stopping's point, its window named from convergence.BEST_WINDOW
    from voxdiff.analysis.convergence import BEST_WINDOW
    lines = res.output.splitlines()
    best = next(i for i, line in enumerate(lines) if f"lowest {BEST_WINDOW}-validation mean" in line)
    assert lines[best].endswith("0.0335") and lines[best + 1].split() == ["at", "optimizer", "step", "704"]


def test_voxdiff_metrics_reads_a_workspace_from_before_the_split(tmp_path):
    write(tmp_path, "train.json", SUMMARY)  # every field in train.json, no detail file
    write(tmp_path, "eval.json", EVAL)
    res = CliRunner().invoke(main, ["metrics", "--root", str(tmp_path)])
    assert res.exit_code == 0 and "0.0339" in res.output and "SSIM" in res.output, res.output
    assert dvc_metrics.read(tmp_path, "train") == SUMMARY


def test_no_metrics_yet(tmp_path):
    write(tmp_path, "train.json", dvc_metrics.train_figures(SUMMARY))  # compact only: nothing to show in full
    res = CliRunner().invoke(main, ["metrics", "--root", str(tmp_path)])
    assert res.exit_code == 1 and "run `make demo`" in res.output
