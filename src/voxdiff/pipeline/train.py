"""Stage `train`: resume or start, loop with progress, checkpoints, MLflow, metrics files."""

from __future__ import annotations

import csv
import io
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from voxdiff.data.cache import open_cache
from voxdiff.params import Params
from voxdiff.pipeline import plan
from voxdiff.report import plots
from voxdiff.runtime import stopping
from voxdiff.runtime.codehash import training_code_hash
from voxdiff.runtime.distributed import Runtime, configure_backends, init_runtime, shutdown
from voxdiff.runtime.errors import VoxdiffError, echo
from voxdiff.runtime.fsutil import write_json, write_text
from voxdiff.tracking import dvc_metrics
from voxdiff.tracking.runs import RunTracker
from voxdiff.tracking.views import publish_training_view
from voxdiff.training import checkpoint, posthoc_ema
from voxdiff.training.schedule import crosses, due_in_samples, ema_rampup_end
from voxdiff.training.trainer import Trainer, due

TRAIN_COLUMNS = ("step", "samples_seen", "wall_time", "train_loss", "lr", "grad_norm", "clip_fraction", "gns",
                 "ema_halflife", "samples_per_s")
VAL_COLUMNS = ("step", "samples_seen", "wall_time", "val_loss")


def paths(root: Path) -> dict[str, Path]:
    return {
        "checkpoint": root / "models" / "checkpoint.pt",
        "kept": root / "models" / "kept",  # train.keep_checkpoints_at_samples's copies (not a DVC output)
        "metrics": root / "metrics" / "train.json",  # the DVC metrics: a few figures (tracking/dvc_metrics.py)
        "detail": root / "metrics" / "train_detail.json",  # every field of the summary
        "checkpoint_id": root / "metrics" / "checkpoint.json",  # evaluate's DVC link to the model
        "train_curve": root / "metrics" / "train_curve.tsv",
        "val_curve": root / "metrics" / "val_curve.tsv",
        "plot": root / "plots" / "convergence.png",
    }


def say(rt: Runtime, msg: str) -> None:
    if rt.is_main:
        echo(f"[voxdiff train] {msg}")  # a gone stderr must not end the run before its save


def run_training(params: Params, root: Path, progress: bool | None = None, restart: bool = False) -> dict:
    """Train to the budget in params.yaml, resuming an unfinished run of the same configuration.
    restart (or VOXDIFF_RESTART=1): train from scratch whatever models/checkpoint.pt holds.
    SIGTERM, SIGHUP and Ctrl-C are deferred from the start (voxdiff.runtime.stopping; the stage entry and the CLI
    defer them earlier still, before the heavy imports) and honoured at a window boundary."""
    stopping.defer()
    try:
        if stopping.requested() is not None:  # before anything started: nothing to save, no MLflow run
            echo("[voxdiff train] stopped before training started: nothing to save")
            raise KeyboardInterrupt
        rt = init_runtime(params.train.device, params.train.precision)
        try:
            configure_backends(rt.device, params.train.tf32, params.train.deterministic)  # before any CUDA matmul
            return _run(params, Path(root), rt, progress, restart or os.environ.get("VOXDIFF_RESTART") == "1")
        except torch.OutOfMemoryError as e:  # past plan.check_gpu_memory's estimate: one line, no traceback
            raise VoxdiffError(
                f"{rt.device}: out of memory in training at train.batch_size {params.train.batch_size} "
                f"({str(e).splitlines()[0][:160]}); lower train.batch_size (raise train.accumulate_every to keep "
                "the effective batch) or set model.activation_checkpointing: true; `voxdiff train --plan` shows "
                "the estimate; the last checkpoint is kept") from None
        finally:
            shutdown()
    finally:
        stopping.restore()


def _run(params: Params, root: Path, rt: Runtime, progress: bool | None, restart: bool = False) -> dict:
    out = paths(root)
    cache = open_cache(root / "data" / "processed")
    if rt.device.type == "cuda":  # before any weight is on the GPU: a step that cannot fit is refused in one line
        plan.check_gpu_memory(params, rt.device, cache.num_classes, rt.world_size, rt.precision)
    trainer = Trainer(params, root, rt, cache)
    state, changed = resume(trainer, out, rt, restart)
    if state is not None and state.get("finished"):
        return rewrite_finished(trainer, state, changed, out, root)
    if rt.is_main:  # up front and cheap (arithmetic and statvfs): refuse a run the disk cannot hold
        plan.check_disk(plan.disk_needs(params, root, plan.network_sizes(trainer.net),
                                        plan.count_events(params.train, rt.world_size, trainer.counters.step),
                                        fresh_start=state is None))
    announce(trainer)
    tracker = start_tracker(trainer, cache, state, root) if rt.is_main else None

    def save(finished: bool, keep: bool = False) -> None:
        if rt.is_main:
            state = trainer.state(finished, tracker.run_id if tracker else None)
            if keep:  # the copy first: a kill between the two leaves the older checkpoint, whose resume writes it again
                kept = out["kept"] / f"samples-{trainer.counters.samples_seen:08d}.pt"
                checkpoint.save(kept, state)
                say(rt, f"kept a copy of the checkpoint at {trainer.counters.samples_seen} samples: "
                        f"{kept.relative_to(root)}")
            checkpoint.save(out["checkpoint"], state)
            if tracker:
                tracker.log_history(trainer.counters.history)

    train_to_budget(trainer, cache, tracker, save, resumed=state is not None, progress=progress)
    try:
        save(finished=True)
        summary = summarize(trainer, params, rt, tracker) if rt.is_main else {}  # validation ran on rank 0 only
        if rt.is_main:
            write_outputs(out, trainer, summary)
            if tracker:
                log_final(tracker, trainer, summary, out, root)
    except BaseException as e:  # e.g. ENOSPC writing the outputs: the run must not stay RUNNING
        if tracker:
            tracker.finish(RunTracker.status_for(e))
        raise
    if rt.is_main:
        say(rt, f"done: val_loss {summary['final_val_loss']:.4f}, {summary['total_samples']} samples in "
                f"{summary['total_wall_time']:.0f} s ({summary['samples_per_s']:.2f} samples/s)")
    return summary


def resume(trainer: Trainer, out: dict[str, Path], rt: Runtime, restart: bool) -> tuple[dict | None, list[str]]:
    """The checkpoint's state when it holds this configuration's run (None: start fresh), restored into the
    trainer, and the measurement keys that changed since (they never touch the weights). Refuses, in one line
    naming what changed, rather than train over an unfinished run of other settings."""
    state, why = checkpoint.resumable(out["checkpoint"], trainer.fingerprint_parts(), restart)
    say(rt, why)
    changed = []
    if state is not None:
        trainer.restore(state)
        changed = sorted(k for k, v in trainer.measurement().items() if state["measurement"].get(k) != v)
        if changed:
            # The weights stand (these keys never touch them); what was measured before differs.
            trainer.counters.measurement_changes.append({"step": trainer.counters.step, "keys": changed})
            say(rt, f"measurement settings changed since the checkpoint ({', '.join('train.' + k for k in changed)}): "
                    f"the run goes on; curves before and after step {trainer.counters.step} were measured differently")
        if "phema_sigma_rels" in changed:
            kept = (state["phema"] or {}).get("sigma_rels") or []
            say(rt, "train.phema_sigma_rels: the run keeps the post-hoc EMA profiles it started with "
                    f"({', '.join(f'{s:g}' for s in kept) or 'none'}): each must span the run from its first step; "
                    "the new list applies to a run from scratch")
    if rt.is_main:
        check_kept_copies(trainer, out["kept"], fresh_start=state is None)
    if trainer.phema is not None and rt.is_main:
        # Only this run's snapshots: others removed, a missing one refused (a finished run only warns).
        lost = trainer.phema.claim(out["checkpoint"], finished=bool(state and state.get("finished")))
        if lost:
            say(rt, lost)
            # models/phema is a declared DVC output that the DVC cache does not hold (a finished run
            # pulled or applied elsewhere): an empty folder lets the stage finish as "nothing to train".
            trainer.phema.folder.mkdir(parents=True, exist_ok=True)
    return state, changed


def check_kept_copies(trainer: Trainer, folder: Path, fresh_start: bool) -> None:
    """train.keep_checkpoints_at_samples before the run goes on: a fresh start removes the previous run's copies
    (the checkpoint they were copied from is being replaced too), any start removes a copy's write cut short by a
    kill, and a point this run will never cross (past its budget, or behind a resumed run without its copy) is said."""
    stale = sorted(folder.glob("samples-*.pt")) if fresh_start else []
    for copy in stale:
        copy.unlink()
    if stale:
        say(trainer.rt, f"removed {len(stale)} kept copies of the previous run's checkpoint from {folder.name}/")
    for tmp in folder.glob(".samples-*.tmp") if folder.is_dir() else ():
        shutil.rmtree(tmp, ignore_errors=True)
    points, seen, budget = trainer.p.train.keep_checkpoints_at_samples, trainer.counters.samples_seen, trainer.budget
    have = [int(n) for n in (p.stem.removeprefix("samples-") for p in folder.glob("samples-*.pt")) if n.isdigit()]
    # a copy is named after the samples seen at the end of the step that crossed its point
    behind = [n for n in points if n <= seen and not any(n <= x < n + budget.effective_batch for x in have)]
    past = [n for n in points if n > budget.total_samples]
    if behind:
        say(trainer.rt, f"train.keep_checkpoints_at_samples: {', '.join(map(str, behind))} already behind this run "
                        f"({seen} samples seen): no copy is kept there now")
    if past:
        say(trainer.rt, f"train.keep_checkpoints_at_samples: {', '.join(map(str, past))} past this run's budget "
                        f"({budget.total_samples} samples): no copy is kept there")


def rewrite_finished(trainer: Trainer, state: dict, changed: list[str], out: dict[str, Path], root: Path) -> dict:
    """DVC reran the stage for a change that does not touch training (e.g. another stage's code, or tracking):
    the finished model stands; the stage's other outputs are rewritten from it."""
    rt, params = trainer.rt, trainer.p
    say(rt, f"nothing to train: outputs rewritten from it (delete {out['checkpoint'].relative_to(root)} "
            "to train this configuration again)")
    redrawn = bool({"val_seed", "val_draws"} & set(changed))
    summary = summarize(trainer, params, rt, None, run_id=state.get("mlflow_run_id", ""),
                        revalidate=state["measurement"] if redrawn else None)
    if rt.is_main:
        write_outputs(out, trainer, summary)
        tracker = RunTracker.reopen(params, root, summary["mlflow_run_id"])
        if tracker:  # an MLflow outage may have kept steps, the summary or the end from it
            log_final(tracker, trainer, summary, out, root)
    return summary


def announce(trainer: Trainer) -> None:
    """What is about to run: device, batch arithmetic, budget, why no noise scale, the EMA's ramp-up."""
    rt, params, budget = trainer.rt, trainer.p, trainer.budget
    say(rt, f"device {rt.device}, precision {rt.precision}, world size {rt.world_size}; micro-batch "
            f"{budget.micro_batch} x accumulate_every {budget.accumulate_every} x {rt.world_size} = effective "
            f"batch {budget.effective_batch}; {budget.total_steps} steps, {budget.total_samples} samples")
    if trainer.gns_reason:
        say(rt, trainer.gns_reason)
    ramp = ema_rampup_end(params.train)
    say(rt, f"EMA half-life {params.train.ema_halflife_samples:g} samples, reached after {ramp:.0f} samples "
            f"({100 * ramp / budget.total_samples:.0f} % of the budget)" + (
            "; raise train.ema_rampup_ratio or lower train.ema_halflife_samples: the ramp-up is most of the run"
            if ramp > budget.total_samples / 2 else ""))


def start_tracker(trainer: Trainer, cache, state: dict | None, root: Path) -> RunTracker | None:
    """The MLflow run (rank 0): a new one, or the checkpoint's reopened on resume; None during an outage."""
    rt, params, budget, adam = trainer.rt, trainer.p, trainer.budget, trainer.adam
    return RunTracker.start(
        params, root, resume_run_id=state["mlflow_run_id"] if state else "",
        tags={"voxdiff.data_fingerprint": cache.fingerprint, "voxdiff.device": str(rt.device),
              "voxdiff.code_hash": training_code_hash(),
              "voxdiff.world_size": rt.world_size, "voxdiff.precision": rt.precision},
        extra_params={"effective_batch_size": budget.effective_batch, "world_size": rt.world_size,
                      "effective_lr": adam.lr, "effective_adam_beta1": adam.betas[0],
                      "effective_adam_beta2": adam.betas[1], "effective_adam_eps": adam.eps,
                      "ema_rampup_end_samples": ema_rampup_end(params.train),
                      "precision_resolved": rt.precision, "device_resolved": str(rt.device)})


def train_to_budget(trainer: Trainer, cache, tracker: RunTracker | None, save, resumed: bool,
                    progress: bool | None) -> None:
    """The loop, in optimizer steps to the budget (or an early stop), saving every train.checkpoint_every steps.
    Every way out but the budget's end ends the MLflow run (KILLED or FAILED) and re-raises."""
    rt, params, budget, c = trainer.rt, trainer.p, trainer.budget, trainer.counters
    first_step = c.step  # a stop before this process's first step has nothing new to save
    monitor = bar = None
    interrupt = GracefulInterrupt()  # bound before the try: its except reads interrupt.at_boundary
    try:  # from here on every way out ends the MLflow run (FINISHED, KILLED or FAILED)
        if tracker:
            publish_training_view(tracker.client, tracker.run_id)  # the MLflow UI's comparison (tracking/views.py)
            # Its input data, also on resume (a crash during an MLflow outage may have kept it out; sent once)
            tracker.log_dataset(f"voxdiff-processed-{params.data.source}", cache.fingerprint,
                                {"data.source": params.data.source, "path": "data/processed",
                                 "subjects": len(cache.subjects), "shape": "x".join(map(str, trainer.shape)),
                                 "label_values": list(cache.label_values)})
            if params.mlflow.system_metrics:
                monitor = tracker.start_system_metrics(params.mlflow.system_metrics_interval_s)
        if rt.is_main and stopping.requested() is None and catch_up_events(trainer) and tracker:
            tracker.resend_from(c.step)  # the step's record now holds what the stop had left to this run
        bar = make_bar(rt, budget.total_steps, c.step, progress)
        with interrupt:
            if interrupt.requested(rt):  # noted while the process started up: stop before the first step
                raise KeyboardInterrupt
            while c.step < budget.total_steps:
                interrupt.at_boundary = False
                before = c.samples_seen
                record = trainer.train_step()
                record["timestamp"] = time.time()
                last = c.step == budget.total_steps
                if rt.is_main:  # the EMA weights agree on every rank
                    # before the checkpoint below; a stop requested during the step skips what can wait
                    run_sample_counted_events(trainer, record, before, last, stop_requested=interrupt.flag)
                c.history.append(record)
                report_progress(rt, bar, record, budget)
                kept_now = crosses(before, c.samples_seen, params.train.keep_checkpoints_at_samples)
                if kept_now:
                    save(finished=False, keep=True)
                if stops_early(trainer, rt, before, last):
                    say(rt, f"early stop at step {c.step} ({c.samples_seen} samples): "
                            f"{params.train.early_stop_patience_samples} samples past the best point "
                            f"(step {trainer.best.mark.step if trainer.best.mark else '?'})")
                    break
                if due(c.step, params.train.checkpoint_every, budget.total_steps) and not last and not kept_now:
                    save(finished=False)
                if interrupt.requested(rt):
                    interrupt.at_boundary = True
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        # Saved only at a window boundary with the step's record kept (GracefulInterrupt defers the
        # first Ctrl-C, SIGTERM or SIGHUP), so the resumed run continues exactly where this one stopped. A
        # KeyboardInterrupt raised anywhere else (a second Ctrl-C) may fall between the optimizer's step
        # and the counters': saving then would write new weights under old counters over the last good
        # checkpoint, so that one is kept.
        try:
            if interrupt.at_boundary and c.step == first_step:
                say(rt, "stopped before this process's first step: nothing new to save" + (
                    f" (the checkpoint at step {c.step} stands)" if resumed else " (nothing trained yet)"))
            elif interrupt.at_boundary:
                save(finished=False)
                say(rt, f"interrupted: checkpoint saved at step {c.step}; rerun the stage to resume")
            else:
                say(rt, "interrupted mid-step (a second Ctrl-C): nothing saved, the last checkpoint is kept; "
                        "rerun the stage to resume from it")
        finally:  # a checkpoint that cannot be written (ENOSPC) still ends the run
            if tracker:
                tracker.finish("KILLED")
        raise
    except BaseException as e:  # divergence, OOM, ENOSPC, a CUDA error, SystemExit: the run ends with the training
        if tracker:
            tracker.finish(RunTracker.status_for(e))
        raise
    finally:
        if bar is not None:
            bar.close()
        if monitor is not None:
            monitor.finish()


def log_final(tracker: RunTracker, trainer: Trainer, summary: dict, out: dict[str, Path], root: Path) -> None:
    """A finished training's run: steps, summary, files, EMA model, then FINISHED (each retried by the
    tracker while MLflow is away). From a finished checkpoint, only what the run still lacks is sent."""
    tracker.log_history(trainer.counters.history)
    tracker.log_summary(
        {k: v for k, v in summary.items()
         if k.startswith(("final_", "total_", "effective_", "peak_", "val_flattening", "phema_", "ema_sigma",
                          "clip_fraction", "plateau_", "own_best_", "compile_", "best_checkpoint_",
                          "stopped_early", "data_"))},
        artifacts=[out["detail"], out["plot"], root / "params.yaml", root / "data" / "processed" / "preview.png"],
        tags={"voxdiff.checkpoint_sha256": summary["checkpoint_sha256"],
              "voxdiff.checkpoint_path": str(out["checkpoint"].relative_to(root)),
              # MLflow cannot drop the curve figures it has: the tag says which draws each was measured on
              **({"voxdiff.revalidated": summary["val_draws_note"]} if summary.get("val_draws_note") else {})})
    tracker.log_model(trainer.ema.module, model_metadata(trainer))
    tracker.finish()


def run_sample_counted_events(trainer: Trainer, record: dict, before: int, last: bool,
                              stop_requested: bool = False) -> None:
    """Validation, post-hoc EMA snapshots and the bucket noise-scale probe, each when it is due in
    samples (schedule.due_in_samples; snapshots: posthoc_ema.snapshot_due) after the step that took samples
    seen from `before` to now.

    stop_requested: a stop was requested during the step. The validation and the probe are then left to the
    resumed run (record["deferred"]; catch_up_events runs them at the same weights): at 128^3 they take
    tens of seconds to minutes, and SIGKILL follows SIGTERM after ~30 s under torchrun and SLURM. The
    snapshot is taken (a checkpoint must not predate its snapshots)."""
    tr, now = trainer.p.train, trainer.counters.samples_seen
    deferred = []
    if due_in_samples(before, now, tr.val_every_samples, last):
        if stop_requested:
            deferred.append("validation")
        else:
            record["val_loss"] = trainer.validation_loss()
    if trainer.phema is not None and posthoc_ema.snapshot_due(before, now, trainer.budget.total_samples,
                                                              tr.phema_snapshots):
        trainer.phema.snapshot()  # a checkpoint must not predate its snapshots
    if due_in_samples(before, now, tr.gns_buckets_every_samples, last):
        if stop_requested:
            deferred.append("probe")
        else:
            record.update(trainer.bucket_noise_scale())
    if deferred:
        record["deferred"] = deferred


def catch_up_events(trainer: Trainer) -> list[str]:
    """What a stop left to this resumed run (run_sample_counted_events: record["deferred"]), run now at the
    restored weights, which are that step's own (EMA for the validation, raw for the probe): the step's
    record ends as an uninterrupted run's. Returns what ran."""
    history = trainer.counters.history
    deferred = history[-1].pop("deferred", []) if history else []
    if "validation" in deferred:
        history[-1]["val_loss"] = trainer.validation_loss()
        trainer.best.observe(history)  # the best point as the step would have judged it
    if "probe" in deferred:
        history[-1].update(trainer.bucket_noise_scale())
    return deferred


def stops_early(trainer: Trainer, rt: Runtime, before: int, last: bool) -> bool:
    """After a step that validated: keep the EMA weights if this is the run's best point yet, and say whether
    early stopping (train.early_stop_patience_samples) ends the run here. Rank 0 validates, so it decides and
    every rank follows (all ranks know when a validation was due)."""
    tr, c = trainer.p.train, trainer.counters
    if not due_in_samples(before, c.samples_seen, tr.val_every_samples, last):
        return False
    stop = False
    if rt.is_main and "validation" not in c.history[-1].get("deferred", ()):  # a deferred one decides on resume
        trainer.best.observe(c.history)
        stop = not last and trainer.best.should_stop(c.samples_seen)
    if rt.world_size > 1:
        from voxdiff.runtime.distributed import all_reduce_sum

        stop = all_reduce_sum([float(stop)], rt)[0] > 0
    return stop


def model_metadata(trainer: Trainer) -> dict:
    """What a user of the logged model needs besides its weights: inputs are the noisy image plus the
    one-hot label map of these label values, on this grid, preprocessed and noised like this."""
    raw = trainer.p.raw
    return {"label_values": list(trainer.cache.label_values), "num_classes": trainer.num_classes,
            "shape": list(trainer.shape), "preprocess": raw["preprocess"], "diffusion": raw["diffusion"],
            "model": raw["model"], "input": "concat(noisy image [B,1,D,H,W], one_hot(labels) [B,C,D,H,W])",
            "weights": "EMA", "samples_seen": trainer.counters.samples_seen}


# Figures read off the val_loss curve: measured on the draws in force during training.
CURVE_FIGURES = ("best_val_loss", "val_flattening", "plateau_change", "plateau_reached", "plateau_past_best",
                 "plateau_val_loss",
                 "own_best_val_loss", "own_best_step", "own_best_samples", "own_best_at_end",
                 "best_checkpoint_val_loss")


def summarize(trainer: Trainer, params: Params, rt: Runtime, tracker, run_id: str = "",
              revalidate: dict | None = None) -> dict:
    """The run's figures (metrics/train_detail.json; train.json holds a few). revalidate: the measurement
    settings the run was trained with, when its validation draws (train.val_seed / val_draws) changed
    after training: the final val loss is measured again with the draws in force now."""
    from voxdiff.runtime.fsutil import sha256_file

    c, b = trainer.counters, trainer.budget
    val = [h for h in c.history if h["val_loss"] is not None]
    window_means = [h["train_loss"] for h in c.history[-max(1, len(c.history) // 10):]]
    final_val = trainer.validation_loss() if revalidate and rt.is_main else val[-1]["val_loss"]
    summary = {
        "final_val_loss": final_val, "best_val_loss": min(h["val_loss"] for h in val),
        "val_flattening": flattening([h["samples_seen"] for h in val], [h["val_loss"] for h in val]),
        **plateau_figures([h["step"] for h in val], [h["val_loss"] for h in val]),
        **own_best_figures(val),
        **best_checkpoint_figures(trainer),
        "data_train_subjects": len(trainer.train_rows),  # data.train_subjects, resolved
        **{f"data_pairwise_dice_label{v}": d for v, d in trainer.cache.pairwise_dice(trainer.train_rows).items()},
        "final_train_loss": sum(window_means) / len(window_means),
        "total_steps": c.step, "total_samples": c.samples_seen, "total_wall_time": c.wall_time,
        "samples_per_s": c.samples_seen / max(c.wall_time, 1e-9),
        "peak_memory_mb": max(h["peak_memory_mb"] for h in c.history),
        "effective_batch_size": b.effective_batch, "micro_batch": b.micro_batch,
        "accumulate_every": b.accumulate_every, "world_size": rt.world_size,
        "effective_lr": trainer.adam.lr,
        "skipped_steps": c.skipped_steps, "ema_updates": c.ema_updates,
        "clip_fraction": c.clipped_steps / max(c.step, 1),
        "measurement_changed_at_steps": [m["step"] for m in c.measurement_changes],
        "gns": trainer.gns.value if trainer.gns_reason is None else None,
        "gns_note": trainer.gns_reason or "", "device": str(rt.device), "precision": rt.precision,
        "compile_seconds": trainer.compile_seconds,  # train.compile: this process's compile (first step less the second)
        "mlflow_run_id": tracker.run_id if tracker else run_id,
        "checkpoint_sha256": sha256_file(paths(trainer.root)["checkpoint"]) if rt.is_main else "",
        **(trainer.posthoc_val_losses() if rt.is_main else {}),
    }
    if revalidate:
        # final_val_loss and phema_* are on the new draws, the curve on the old ones: a best_val_loss beside
        # a final_val_loss of other draws would read as a rise or a fall that is only the draws. Left out.
        tr, shown = trainer.p.train, [k for k in CURVE_FIGURES if k in summary]
        summary.update(dict.fromkeys(shown))
        summary["val_draws_note"] = (
            f"final_val_loss and phema_* measured again on val_seed {tr.val_seed}, val_draws {tr.val_draws} (changed "
            f"after training); the val_loss curve and {', '.join(shown)} are on the training's draws (val_seed "
            f"{revalidate['val_seed']}, val_draws {revalidate['val_draws']}), left out of the summary")
    return summary


def plateau_figures(steps: list[int], losses: list[float]) -> dict:
    """The plateau criterion (convergence.py): the val loss's relative change over the last quarter of
    the run's optimizer steps, the verdict (plateau_reached 1 only at a plateau: a run past its best, risen
    or settled above its own best, is plateau_past_best 1 and never at a plateau), and the level."""
    from voxdiff.analysis import convergence

    change, level = convergence.plateau_change(steps, losses), convergence.plateau_level(steps, losses)
    verdict = convergence.judge_plateau(change, level, losses)
    known = verdict is not None
    return {"plateau_change": change,
            "plateau_reached": int(verdict == convergence.PLATEAU) if known else None,
            "plateau_past_best": int(verdict == convergence.PAST_BEST) if known else None,
            "plateau_val_loss": level}


def own_best_figures(val: list[dict]) -> dict:
    """Where early stopping would have kept the run (convergence.best_point, the figure of compare's
    own-best table): the lowest mean of consecutive validations, the step and samples at its centre, and
    1 when that window is the last (still at its lowest at the end: the level is an upper bound). None
    with fewer validations than the window."""
    from voxdiff.analysis import convergence

    best = convergence.best_point([h["val_loss"] for h in val])
    if best is None:
        return dict.fromkeys(("own_best_val_loss", "own_best_step", "own_best_samples", "own_best_at_end"))
    at = val[best.index]
    return {"own_best_val_loss": best.level, "own_best_step": at["step"], "own_best_samples": at["samples_seen"],
            "own_best_at_end": int(best.at_end)}


def best_checkpoint_figures(trainer: Trainer) -> dict:
    """Where the kept best EMA weights were taken (training/best.py: the centre of the lowest window, the
    point own_best_* names), and whether early stopping ended the run."""
    mark = trainer.best.mark
    return {"best_checkpoint_step": mark.step if mark else None,
            "best_checkpoint_samples": mark.samples_seen if mark else None,
            "best_checkpoint_val_loss": mark.window_mean if mark else None,
            "stopped_early": int(trainer.counters.step < trainer.budget.total_steps)}


def flattening(samples: list[int], losses: list[float]) -> float | None:
    """Val-loss improvement over the last quarter of the samples divided by the improvement over the
    first quarter (from the first validation): near 0 = the curve has flattened, 1 = still falling as
    fast as at the start. None with fewer than 3 validations or no first-quarter improvement."""
    import numpy as np

    if len(samples) < 3:
        return None
    total = samples[-1]
    at = lambda s: float(np.interp(s, samples, losses))  # noqa: E731
    first, last = losses[0] - at(total / 4), at(3 * total / 4) - losses[-1]
    return last / first if first > 0 else None


def write_outputs(out: dict[str, Path], trainer: Trainer, summary: dict) -> None:
    history = trainer.counters.history
    write_json(out["detail"], summary)
    write_json(out["metrics"], dvc_metrics.train_figures(summary))
    write_json(out["checkpoint_id"], dvc_metrics.checkpoint_id(summary))
    write_text(out["train_curve"], tsv(history, TRAIN_COLUMNS))
    write_text(out["val_curve"], tsv([h for h in history if h["val_loss"] is not None], VAL_COLUMNS))
    plots.convergence(history, out["plot"], title=f"micro-batch {summary['micro_batch']} x accumulate "
                      f"{summary['accumulate_every']} x {summary['world_size']} = {summary['effective_batch_size']}")


def tsv(rows: list[dict], columns: tuple[str, ...]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, delimiter="\t", lineterminator="\n")
    w.writerow(columns)
    for r in rows:
        w.writerow(["" if r.get(k) is None else (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in columns])
    return buf.getvalue()


class GracefulInterrupt:
    """Defers the first Ctrl-C (SIGINT), SIGTERM (what `dvc queue kill`, SLURM and Kubernetes send) or SIGHUP
    (a closed terminal; not under `nohup`) to the end of the current optimizer step.

    The handler only sets a flag; the loop checks it after the step's record and checkpoint are done
    and then raises KeyboardInterrupt, so the saved state is a clean window boundary (`at_boundary`).
    A second Ctrl-C acts at once (the previous handler is back), wherever the step is, so nothing is saved
    then. A repeated SIGTERM only repeats the request: launchers send it more than once (a process-group
    SIGTERM reaches a torchrun worker directly and again as torchrun forwards it; SLURM signals every
    process of the step), and acting on the second one killed the process before its save; the grace ends
    with the launcher's SIGKILL. A stop noted while the process started up (voxdiff.runtime.stopping) counts as
    requested. Under DDP the flag is summed over ranks, so all ranks stop at the same step.
    """

    def __init__(self):
        self.flag = False
        self.previous: dict = {}   # the handlers replaced, put back on exit
        self.immediate: dict = {}  # what a second Ctrl-C runs: the handler before start-up's noting one
        self.at_boundary = True  # False while a step is under way (the loop sets it)

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in stopping.stop_signals():
                previous = self.previous[sig] = signal.signal(sig, self._handler)
                self.immediate[sig] = stopping.original(sig) if previous is stopping._note else previous
        self.flag = self.flag or stopping.requested() is not None  # a stop asked for during start-up
        return self

    def _handler(self, signum, frame):
        import signal

        self.flag = True
        if signum == signal.SIGINT:  # a second Ctrl-C acts at once; a repeated SIGTERM or SIGHUP is the same request
            signal.signal(signum, self.immediate.get(signum) or signal.default_int_handler)

    def requested(self, rt: Runtime) -> bool:
        if rt.world_size == 1:
            return self.flag
        from voxdiff.runtime.distributed import all_reduce_sum

        return all_reduce_sum([float(self.flag)], rt)[0] > 0

    def __exit__(self, *exc):
        """Put back what was replaced: start-up's noting handler where run_training deferred the stop signals,
        so that a SIGTERM repeated while the stop's checkpoint is written is noted, not fatal (run_training
        restores the originals at its end). A first Ctrl-C already put the immediate handler in place: kept."""
        import signal

        for sig, handler in self.previous.items():
            if signal.getsignal(sig) == self._handler:  # (a bound method: equal, never the same object)
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        return False


def make_bar(rt: Runtime, total: int, start: int, progress: bool | None):
    """A tqdm bar on a terminal; plain log lines otherwise (CI, DVC queue logs)."""
    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty() if progress is None else progress
    if not rt.is_main or not interactive:
        return None
    return tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, desc="train")  # ETA: tqdm's own


def report_progress(rt: Runtime, bar, record: dict, budget) -> None:
    """tqdm bar (step, samples, loss, val loss, samples/s, ETA) on a terminal; a plain line at each
    validation otherwise (DVC queue logs, CI), with the same fields."""
    if not rt.is_main:
        return
    post = {"samples": record["samples_seen"], "loss": f"{record['train_loss']:.4f}",
            "samples/s": f"{record['samples_per_s']:.2f}"}
    if record["val_loss"] is not None:
        post["val"] = f"{record['val_loss']:.4f}"
    if bar is not None:
        bar.set_postfix(post, refresh=False)
        bar.update(1)
    elif record["val_loss"] is not None:
        rate = record["samples_seen"] / max(record["wall_time"], 1e-9)  # training time only, over the run
        left = (budget.total_samples - record["samples_seen"]) / max(rate, 1e-9)
        post["eta"] = f"{int(left // 60)}m{int(left % 60):02d}s"
        say(rt, f"step {record['step']}/{budget.total_steps} " + " ".join(f"{k} {v}" for k, v in post.items()))
