"""Demo-default tuning: train + evaluate named configurations on the built-in data, one after another.

    .venv/bin/python benchmarks/tuning.py --samples 768 eps-2e-4 x0-2e-4 ...   # names from CONFIGS
    .venv/bin/python benchmarks/tuning.py --render                             # docs/tuning.md from the results

Each configuration is params.yaml plus the overrides below, trained for --samples samples in its own
folder under benchmarks/.scratch/tuning/ (sharing the preprocessed built-in data) and evaluated by the
evaluate stage's own code. One JSON line per run goes to benchmarks/tuning.jsonl (committed): the
table in docs/tuning.md is rebuilt from it. Run nothing else on the machine meanwhile: it records time.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "tuning.jsonl"
SCRATCH = HERE / ".scratch" / "tuning"

CONFIGS: dict[str, dict] = {
    # the demo as it shipped before tuning (epsilon, lr 2e-4), in fp32 and in bf16
    "eps-2e-4-fp32": {"diffusion.prediction": "epsilon", "train.lr": 2e-4, "train.precision": "fp32"},
    "eps-2e-4": {"diffusion.prediction": "epsilon", "train.lr": 2e-4},
    "eps-1e-3": {"diffusion.prediction": "epsilon", "train.lr": 1e-3},
    "v-2e-4": {"diffusion.prediction": "v_prediction", "train.lr": 2e-4},
    "v-1e-3": {"diffusion.prediction": "v_prediction", "train.lr": 1e-3},
    "x0-2e-4": {"diffusion.prediction": "sample", "train.lr": 2e-4},
    "x0-1e-3": {"diffusion.prediction": "sample", "train.lr": 1e-3},
    "x0-3e-3": {"diffusion.prediction": "sample", "train.lr": 3e-3},
    "x0-1e-3-wide": {"diffusion.prediction": "sample", "train.lr": 1e-3, "model.channels": [32, 64, 64]},
    "x0-1e-3-4lvl": {"diffusion.prediction": "sample", "train.lr": 1e-3, "model.channels": [16, 32, 64, 64],
                     "model.attention_levels": [False, False, False, True]},
    "v-1e-3-l2": {"diffusion.prediction": "v_prediction", "train.lr": 1e-3, "diffusion.loss": "l2"},
    "x0-2e-3": {"diffusion.prediction": "sample", "train.lr": 2e-3},
    "x0-1e-3-snr5": {"diffusion.prediction": "sample", "train.lr": 1e-3, "diffusion.min_snr_gamma": 5.0},
    "v-1e-3-snr5": {"diffusion.prediction": "v_prediction", "train.lr": 1e-3, "diffusion.min_snr_gamma": 5.0},
    "x0-1e-3-ema256": {"diffusion.prediction": "sample", "train.lr": 1e-3, "train.ema_halflife_samples": 256.0},
}


# Evaluation-only variants (issue 35: samples that vary as the data does): a configuration above, trained once, its
# volumes drawn by another sampler. name -> (the configuration whose trained model it evaluates, evaluate overrides).
SAMPLERS: dict[str, tuple[str, dict]] = {
    "x0-1e-3-eta0.5": ("x0-1e-3", {"evaluate.ddim_eta": 0.5}),
    "x0-1e-3-eta1": ("x0-1e-3", {"evaluate.ddim_eta": 1.0}),
    "x0-1e-3-ddpm": ("x0-1e-3", {"evaluate.sampler": "ancestral"}),
    "v-1e-3-eta1": ("v-1e-3", {"evaluate.ddim_eta": 1.0}),
    "v-1e-3-ddpm": ("v-1e-3", {"evaluate.sampler": "ancestral"}),
}


def set_key(raw: dict, dotted: str, value) -> None:
    node = raw
    *parents, last = dotted.split(".")
    for part in parents:
        node = node[part]
    node[last] = value


def run_one(name: str, overrides: dict, samples: int, base_raw: dict, trained_as: str | None = None) -> dict:
    """Train `name` (or reuse the finished training of `trained_as`, whose overrides `overrides` extends with
    evaluate.* keys only) and evaluate it; the row of tuning.jsonl."""
    import yaml

    from voxdiff.pipeline.evaluate import run_evaluate
    from voxdiff.params import validate
    from voxdiff.pipeline.train import run_training

    raw = copy.deepcopy(base_raw)
    for k, v in {**overrides, "train.max_samples": samples, "train.max_steps": 0}.items():
        set_key(raw, k, v)
    params = validate(raw)
    root = SCRATCH / f"{trained_as or name}-{samples}"
    (root / "data").mkdir(parents=True, exist_ok=True)
    link = root / "data" / "processed"
    if not link.exists():
        link.symlink_to(REPO / "data" / "processed")
    if trained_as is None:  # a fresh training; a variant evaluates the finished one (evaluate.* is not training)
        (root / "models" / "checkpoint.pt").unlink(missing_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    t0 = time.time()
    summary = run_training(params, root, progress=False)
    train_s = time.time() - t0
    t1 = time.time()
    metrics = run_evaluate(params, root, progress=False)
    curve = (root / "metrics" / "val_curve.tsv").read_text().splitlines()[1:]
    return {"name": name, "overrides": overrides, "samples": samples, "trained_as": trained_as,
            "train_seconds": round(train_s, 1),
            "eval_seconds": round(time.time() - t1, 1), "samples_per_s": round(summary["samples_per_s"], 3),
            "precision": summary["precision"], "final_val_loss": summary["final_val_loss"],
            "val_curve": [[int(c.split("\t")[1]), float(c.split("\t")[3])] for c in curve],
            **{k: v for k, v in metrics.items() if k.startswith("eval_") and not k.startswith("eval_mean")}}


def sampler_of(row: dict) -> str:
    """The sampler of a row's evaluated volumes: DDIM (eta) or DDPM ancestral; rows from before
    evaluate.sampler existed were DDIM, eta 0."""
    o = row.get("overrides", {})
    if o.get("evaluate.sampler") == "ancestral":
        return "DDPM"
    return f"DDIM eta {o.get('evaluate.ddim_eta', 0.0):g}"


def render(rows: list[dict]) -> str:
    # No timing columns: these runs shared the machine with other work; speed lives in `make bench`.
    cols = [("run", lambda r: r["name"]), ("samples", lambda r: r["samples"]),
            ("precision", lambda r: r["precision"]),
            ("SSIM", lambda r: f"{r['eval_ssim']:.3f}"), ("PSNR dB", lambda r: f"{r['eval_psnr']:.1f}"),
            ("MAE", lambda r: f"{r['eval_mae']:.3f}"),
            ("contrast order", lambda r: f"{r['eval_contrast_order_fraction']:.2f}"),
            ("contrast ratio", lambda r: "n/a" if r["eval_contrast_ratio"] is None else f"{r['eval_contrast_ratio']:.2f}"),
            ("beats floors", lambda r: "yes" if r.get("eval_beats_floors") else "no"),
            ("sampler", sampler_of),
            ("diversity MS-SSIM", lambda r: "n/a" if r.get("eval_msssim_samples") is None
             else f"{r['eval_msssim_samples']:.4f}"),
            ("data's own", lambda r: "n/a" if r.get("eval_diversity_reference") is None
             else f"{r['eval_diversity_reference']:.4f}"),
            ("Dice fidelity", lambda r: "n/a" if r.get("eval_dice_fidelity_mean") is None
             else f"{r['eval_dice_fidelity_mean']:.3f}")]
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(f(r)) for _, f in cols) + " |" for r in rows]
    f = rows[-1] if rows else {}
    floors = (f"Floors on the same validation subjects: SSIM noise {f['eval_ssim_floor_noise']:.3f}, tissue-mean "
              f"{f['eval_ssim_floor_tissue_mean']:.3f}; PSNR noise {f['eval_psnr_floor_noise']:.1f} dB, tissue-mean "
              f"{f['eval_psnr_floor_tissue_mean']:.1f} dB; MAE noise {f['eval_mae_floor_noise']:.3f}, tissue-mean "
              f"{f['eval_mae_floor_tissue_mean']:.3f}.") if rows else ""
    return "\n".join(lines) + "\n\n" + floors + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help=f"configurations: {', '.join(CONFIGS)}; sampler variants (after their "
                    f"configuration): {', '.join(SAMPLERS)}")
    ap.add_argument("--samples", type=int, default=768)
    ap.add_argument("--render", action="store_true", help="print the results table (Markdown)")
    args = ap.parse_args(argv)
    if args.render:
        rows = [json.loads(x) for x in RESULTS.read_text().splitlines() if x.strip()]
        sys.stdout.write(render(rows))
        return 0
    import yaml

    sys.path.insert(0, str(REPO / "src"))
    base_raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for name in args.names:
        if name in SAMPLERS:
            trained_as, extra = SAMPLERS[name]
            row = run_one(name, {**CONFIGS[trained_as], **extra}, args.samples, base_raw, trained_as)
        else:
            row = run_one(name, CONFIGS[name], args.samples, base_raw)
        with RESULTS.open("a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(f"{name}: SSIM {row['eval_ssim']:.3f} PSNR {row['eval_psnr']:.1f} MAE {row['eval_mae']:.3f} "
              f"contrast {row['eval_contrast_order_fraction']} diversity {row.get('eval_msssim_samples')} "
              f"(data {row.get('eval_diversity_reference')}) floors {row.get('eval_beats_floors')} "
              f"{row['samples_per_s']:.2f} samples/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
