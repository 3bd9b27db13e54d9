"""The `voxdiff` command line. Each pipeline stage is a subcommand; stages/*.py call the same code.

User errors print one line (`error: ...`) and exit 2; `--debug` shows the traceback instead.
Heavy imports (torch, MONAI, MLflow) happen inside the commands so that `--help` is instant.
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from pathlib import Path

import click

from voxdiff import __version__


def _root_option(f):
    return click.option("--root", type=click.Path(file_okay=False, path_type=Path), default=None,
                        help="Project root holding params.yaml and data/ (default: the current directory's project).")(f)


def _params_option(f):
    return click.option("--params", "params_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                        help="Params file (default: <root>/params.yaml).")(f)


def _resolve(root: Path | None, params_path: Path | None):
    from voxdiff.runtime.fsutil import repo_root
    from voxdiff.params import load

    root = (root or repo_root()).resolve()
    return root, load(params_path or root / "params.yaml")


def user_errors(fn):
    """Turn VoxdiffError into one line on stderr and exit code 2 (traceback only with --debug)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from voxdiff.runtime.errors import exit_on_user_error

        debug = click.get_current_context().find_root().params.get("debug", False)
        return exit_on_user_error(lambda: fn(*args, **kwargs), debug)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="voxdiff")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
def main(debug: bool) -> None:
    """voxdiff: measure how gradient accumulation (train.accumulate_every) changes the convergence
    of a 3D label-map-to-MRI diffusion model, reproducibly, with DVC and MLflow.

    \b
    Pipeline (what `dvc repro` runs, one stage per command):
      voxdiff prepare     built-in MNI152 pseudo-subjects, or index and check your NIfTI data
      voxdiff preprocess  reorient, resample, crop, normalise, split -> data/processed cache
      voxdiff train       3D conditional DDPM with exact gradient accumulation -> models/
      voxdiff evaluate    sample with the EMA model, fidelity/diversity/tissue metrics
    Then: voxdiff compare (report across runs; --runs reads an archive), voxdiff export (runs -> archive),
    voxdiff sample (your own label map), voxdiff advise (what accumulate_every to set, measured on
    your checkpoint),
    voxdiff metrics (the last run's figures), voxdiff doctor (environment for a bug report).
    All settings live in params.yaml.
    """
    if not debug:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="monai")
        os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")


@main.command()
@_root_option
@_params_option
@user_errors
def prepare(root, params_path):
    """Create data/raw: synthesise the built-in pseudo-subjects (data.source: mni152) from the MNI152
    template shipped in nilearn, or index and check your own NIfTI pairs (data.source: a directory)."""
    from voxdiff.data.prepare import run_prepare

    root, params = _resolve(root, params_path)
    run_prepare(params, root)


@main.command()
@_root_option
@_params_option
@user_errors
def preprocess(root, params_path):
    """Create data/processed: canonical RAS orientation, preprocess.spacing (labels nearest-neighbour),
    crop/pad to preprocess.shape, per-volume intensity scaling to [-1, 1], train/val split, preview PNG."""
    from voxdiff.data.preprocess import run_preprocess

    root, params = _resolve(root, params_path)
    run_preprocess(params, root)


@main.command()
@_root_option
@_params_option
@click.option("--progress/--no-progress", default=None, help="Progress bar (default: only on a terminal).")
@click.option("--restart", is_flag=True, help="Train from scratch whatever models/checkpoint.pt holds (also: "
              "VOXDIFF_RESTART=1 dvc repro). Without it an unreadable checkpoint is refused, not overwritten.")
@click.option("--plan", is_flag=True, help="Do not train: print what the training will need and take (steps, "
              "samples, checkpoint, snapshot and DVC-cache disk against the free disk, peak memory and step time "
              "measured with a few real steps, predicted wall time) and exit; exit 2 when the disk cannot hold it.")
@click.option("--plan-steps", type=click.IntRange(min=1), default=3, show_default=True,
              help="With --plan: timed training steps (after one warm-up step).")
@user_errors
def train(root, params_path, progress, restart, plan, plan_steps):
    """Train the diffusion model on data/processed. Resumes an interrupted run of the same configuration
    (params, data, resolved precision and training code) from models/checkpoint.pt; Ctrl-C, SIGTERM or SIGHUP
    (a closed terminal; not under nohup) stops at the end of the optimizer step with a checkpoint. Multi-GPU/CPU:
    `.venv/bin/torchrun --nproc_per_node N stages/train.py` from the project root. Before training it checks
    that the disk can hold the run (refused in one line otherwise); `--plan` shows the whole plan."""
    if not plan:  # first: a SIGTERM while torch and MONAI load is noted, not fatal (voxdiff.runtime.stopping)
        from voxdiff.runtime import stopping

        stopping.defer()
    root, params = _resolve(root, params_path)
    if plan:
        from voxdiff.pipeline.plan import run_plan

        run_plan(params, root, steps=plan_steps, echo=click.echo)
        return
    from voxdiff.pipeline.train import run_training

    run_training(params, root, progress=progress, restart=restart)


@main.command()
@_root_option
@_params_option
@user_errors
def evaluate(root, params_path):
    """Sample volumes for the validation label maps with the EMA weights (DDIM) and write
    metrics/eval_detail.json (metrics/eval.json: the few figures for `dvc exp show`) and montages; logs into
    the training's MLflow run."""
    from voxdiff.pipeline.evaluate import run_evaluate

    root, params = _resolve(root, params_path)
    run_evaluate(params, root)


@main.command()
@_root_option
@_params_option
@user_errors
def doctor(root, params_path):
    """Print what a bug report needs: device, the precision `auto` picks and why, threads, versions of
    torch/MONAI/MLflow/DVC, and the MLflow tracking URI in force and whether it answers."""
    from voxdiff.doctor import print_report
    from voxdiff.runtime.fsutil import repo_root
    from voxdiff.params import load

    root = (root or repo_root()).resolve()
    path = params_path or root / "params.yaml"
    print_report(root, load(path) if path.is_file() else None, echo=click.echo)


SUMMARY_ROWS = (
    ("train.json", "effective_batch_size", "effective batch (micro x accumulate x world)"),
    ("train.json", "total_samples", "samples seen"),
    ("train.json", "total_steps", "optimizer steps"),
    ("train.json", "final_val_loss", "val loss (EMA, fixed draws)"),
    ("train.json", "best_val_loss", "best val loss (lowest validation)"),
    ("train.json", "own_best_val_loss", "lowest {window}-validation mean (early stopping)"),
    ("train.json", "own_best_step", "  at optimizer step"),
    ("train.json", "val_flattening", "val-loss flattening (last / first quarter's gain)"),
    ("train.json", "final_train_loss", "train loss (last 10% of steps)"),
    ("train.json", "gns", "gradient noise scale B_simple"),
    ("train.json", "samples_per_s", "training samples/s"),
    ("train.json", "total_wall_time", "training wall time (s)"),
    ("train.json", "peak_memory_mb", "peak memory (MB)"),
    ("eval.json", "eval_ssim", "SSIM to the real volume (brain)"),
    ("eval.json", "eval_psnr", "PSNR (dB, brain)"),
    ("eval.json", "eval_mae", "MAE (brain)"),
    ("eval.json", "eval_msssim_samples", "MS-SSIM between samples (diversity)"),
    ("eval.json", "eval_msssim_real", "MS-SSIM between real volumes"),
    ("eval.json", "eval_beats_floors", "beats both floors on SSIM, PSNR, MAE (1/0)"),
    ("eval.json", "eval_contrast_order_ok", "tissue contrast order kept (1/0)"),
    ("eval.json", "eval_contrast_order_fraction", "samples keeping the contrast order"),
    ("eval.json", "eval_dice_fidelity_mean", "label-fidelity Dice (real-trained segmenter)"),
    ("eval.json", "eval_dice_tstr_ratio", "Dice trained on synthetic / on real"),
    ("eval.json", "eval_seconds_per_volume", "sampling s/volume"),
)


@main.command()
@_root_option
def metrics(root):
    """Print the main figures of the last run (metrics/train_detail.json and metrics/eval_detail.json,
    which hold every field); `dvc exp show --only-changed` compares experiments on the few figures of
    metrics/train.json and metrics/eval.json."""
    from voxdiff.analysis.convergence import BEST_WINDOW
    from voxdiff.runtime.fsutil import repo_root
    from voxdiff.tracking import dvc_metrics

    root = (root or repo_root()).resolve()
    loaded = {f"{name}.json": dvc_metrics.read(root, name) for name in ("train", "eval")}
    if not any(loaded.values()):
        click.echo("no metrics yet: run `make demo` (or `dvc repro` with .venv activated)", err=True)
        sys.exit(1)
    for name, key, label in SUMMARY_ROWS:
        value = loaded[name].get(key)
        if value is None or value == "":
            continue
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        floors = [loaded[name].get(f"{key}_floor_{f}") for f in ("noise", "tissue_mean")]
        if None not in floors:
            shown += f"   (floors: noise {floors[0]:.4g}, tissue-mean {floors[1]:.4g})"
        if key.startswith("eval_dice_"):  # the Dice figures' own references (evaluation/segmenter.py)
            from voxdiff.evaluation.segmenter import references

            shown += references(key, loaded[name])
        click.echo(f"  {label.format(window=BEST_WINDOW):<45} {shown}")
    note = loaded["train.json"].get("gns_note")
    if note:
        click.echo(f"  ({note})")


def _register_optional() -> None:
    """Commands that live in their own modules. An import error there is a real bug: let it surface."""
    from voxdiff.advise.command import advise_command
    from voxdiff.evaluation.sample import sample_command
    from voxdiff.report.compare import compare_command, export_command

    for name, command in (("compare", compare_command), ("export", export_command), ("sample", sample_command),
                          ("advise", advise_command)):
        command.callback = user_errors(command.callback)  # one-line errors, as every other command
        main.add_command(command, name)


_register_optional()


if __name__ == "__main__":
    main()
