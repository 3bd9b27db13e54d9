"""What a checkpoint stands for, and how a run ends: the fingerprint holds the training code and the
resolved precision, measurement-only keys keep a run, an unreadable checkpoint is refused, SIGTERM
stops at a window boundary, fp16 cannot skip forever, the clip fraction is counted, min-SNR needs L2.
Each test has the control that shows it can fail."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch

from conftest import make_params, uninterrupted_run
from voxdiff.runtime import codehash
from voxdiff.data.cache import open_cache
from voxdiff.runtime.errors import ParamsError, TrainingDiverged, VoxdiffError
from voxdiff.runtime.distributed import init_runtime
from voxdiff.pipeline.train import run_training
from voxdiff.training.trainer import MEASUREMENT_KEYS, Trainer

SHORT = {"train.max_samples": 8, "train.batch_size": 1, "train.accumulate_every": 2, "train.checkpoint_every": 1,
         "train.val_every_samples": 4}


def checkpoint(root):
    return torch.load(root / "models" / "checkpoint.pt", weights_only=True)


def trainer_for(root, overrides=None, precision="fp32"):
    p = make_params({**SHORT, **(overrides or {})})
    return Trainer(p, root, init_runtime("cpu", precision), open_cache(root / "data" / "processed"))


# --- item 1: a code fix retrains -----------------------------------------------------------------------
def clear_code_cache():
    for name in ("training_code_hash", "training_code_hashes"):
        getattr(getattr(codehash, name, None), "cache_clear", lambda: None)()


@pytest.fixture
def code_copy(tiny_root, monkeypatch):
    """The package's source copied under tiny_root and hashed from there (codehash.SRC), so a test can edit it."""
    import shutil

    src = tiny_root / "src"
    shutil.copytree(codehash.SRC / "voxdiff", src / "voxdiff", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(codehash, "SRC", src)
    clear_code_cache()
    yield src / "voxdiff"
    clear_code_cache()


def edit(path, change):
    path.write_text(change(path.read_text()))
    clear_code_cache()


def test_fingerprint_follows_the_training_codes_syntax_not_its_bytes(tiny_root, code_copy):
    """issue 36 item 1: a comment, a docstring or a reformatting cannot change what training computes, so it
    keeps the fingerprint (the hash is over the syntax tree, docstrings stripped); a statement changes it;
    recording code is left out."""
    tr = trainer_for(tiny_root)
    before = tr.fingerprint()
    recording = code_copy / "tracking" / "runs.py"
    edit(recording, lambda s: s + "\nX = 1\n")
    assert tr.fingerprint() == before  # recording code is left out
    objective = code_copy / "diffusion" / "objective.py"
    edit(objective, lambda s: s + "\n# x\n")
    edit(objective, lambda s: s.replace('"""', '"""Reworded. ', 1))  # the module docstring
    edit(objective, lambda s: s.replace("\n\n\ndef ", "\n\n\n\n# a note\ndef ", 1).replace(", ", " ,  ", 3))
    assert tr.fingerprint() == before
    edit(objective, lambda s: s + "\nX = 1\n")
    assert tr.fingerprint() != before


def test_library_patch_upgrade_is_not_a_change(tiny_root, monkeypatch):
    """torch / MONAI enter the fingerprint as major.minor: a patch release (bug fixes, no new numerics by
    policy) keeps a run resumable, a minor release does not."""
    import monai

    tr = trainer_for(tiny_root)
    before = tr.fingerprint()
    major, minor, *_ = torch.__version__.split("+")[0].split(".")
    try:
        monkeypatch.setattr(torch, "__version__", f"{major}.{minor}.99+cpu")
        monkeypatch.setattr(monai, "__version__", monai.__version__ + ".post1")
        clear_code_cache()
        assert tr.fingerprint() == before
        monkeypatch.setattr(torch, "__version__", f"{major}.{int(minor) + 1}.0")
        clear_code_cache()
        assert tr.fingerprint() != before
    finally:
        monkeypatch.undo()
        clear_code_cache()


def interrupted_at_step_2(root, cfg, monkeypatch):
    real_step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: (_ for _ in ()).throw(KeyboardInterrupt)
                        if self.counters.step == 2 else real_step(self))
    with pytest.raises(KeyboardInterrupt):
        run_training(make_params(cfg), root, progress=False)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert checkpoint(root)["step"] == 2


def test_issue_reproduction_comment_resumes_code_change_is_refused_in_one_line(tiny_root, code_copy, monkeypatch,
                                                                              capsys):
    """The issue's reproduction: interrupt at step 2, append `# x` to diffusion/objective.py, rerun: the run
    resumes. A change of what it computes is refused with one line naming the file and the way to restart;
    the checkpoint is kept. It never says "starting fresh" over the unfinished run."""
    interrupted_at_step_2(tiny_root, SHORT, monkeypatch)
    stamp = (tiny_root / "models" / "checkpoint.pt").read_bytes()
    objective = code_copy / "diffusion" / "objective.py"
    edit(objective, lambda s: s + "\nX = 1\n")
    capsys.readouterr()
    with pytest.raises(VoxdiffError) as refused:
        run_training(make_params(SHORT), tiny_root, progress=False)
    line = str(refused.value)
    assert "\n" not in line and "unfinished run" in line and "diffusion/objective.py" in line and "--restart" in line
    assert (tiny_root / "models" / "checkpoint.pt").read_bytes() == stamp
    edit(objective, lambda s: s.replace("\nX = 1\n", "\n# x\n"))
    summary = run_training(make_params(SHORT), tiny_root, progress=False)
    err = capsys.readouterr().err
    assert "resuming from" in err and "at step 2" in err and "starting fresh" not in err
    assert summary["total_steps"] == 4 and checkpoint(tiny_root)["finished"]


def test_changed_training_key_refuses_an_unfinished_run_naming_it(tiny_root, monkeypatch):
    interrupted_at_step_2(tiny_root, SHORT, monkeypatch)
    with pytest.raises(VoxdiffError, match=r"unfinished run \(step 2\).*train\.lr 0\.001 -> 0\.002.*--restart"):
        run_training(make_params({**SHORT, "train.lr": 2e-3}), tiny_root, progress=False)
    assert checkpoint(tiny_root)["step"] == 2
    run_training(make_params({**SHORT, "train.lr": 2e-3}), tiny_root, progress=False, restart=True)  # deliberately
    assert checkpoint(tiny_root)["finished"]


def test_finished_checkpoint_is_retrained_only_for_what_shapes_training(tiny_root, code_copy, capsys):
    p = make_params(SHORT)
    run_training(p, tiny_root, progress=False)
    first = checkpoint(tiny_root)
    # Same params, same code, a comment added: nothing to train, the file stays byte for byte.
    stamp = (tiny_root / "models" / "checkpoint.pt").read_bytes()
    edit(code_copy / "diffusion" / "objective.py", lambda s: s + "\n# x\n")
    run_training(p, tiny_root, progress=False)
    assert (tiny_root / "models" / "checkpoint.pt").read_bytes() == stamp
    # The training code changed (what DVC reruns the stage for): a new run, and the log says why.
    edit(code_copy / "diffusion" / "objective.py", lambda s: s + "\nX = 1\n")
    capsys.readouterr()
    run_training(p, tiny_root, progress=False)
    err = capsys.readouterr().err
    second = checkpoint(tiny_root)
    assert second["fingerprint"] != first["fingerprint"] and second["mlflow_run_id"] != first["mlflow_run_id"]
    assert "finished run" in err and "diffusion/objective.py" in err and "starting fresh" in err


def test_checkpoint_without_fingerprint_parts_is_refused_in_one_line(tiny_root):
    """A checkpoint from before the fingerprint recorded its parts still loads; it cannot say what differs,
    so it is refused (one line naming the fingerprints), never trained over."""
    from voxdiff.training import checkpoint as ckpt_mod

    run_training(make_params(SHORT), tiny_root, progress=False)
    path = tiny_root / "models" / "checkpoint.pt"
    old = {k: v for k, v in ckpt_mod.load(path).items() if k not in ("fingerprint_parts", "format_version")}
    old["fingerprint"] = "0123456789abcdef"
    ckpt_mod.save(path, old)
    stamp = path.read_bytes()
    with pytest.raises(VoxdiffError) as refused:
        run_training(make_params(SHORT), tiny_root, progress=False)
    line = str(refused.value)
    assert "\n" not in line and "0123456789abcdef" in line and "fingerprint" in line and "--restart" in line
    assert path.read_bytes() == stamp


def test_resumable_names_each_part_that_differs(tmp_path):
    """checkpoint.resumable on real files: every part of the fingerprint is named when it differs (world
    size, libraries, data, a params key, code files), an unfinished run is refused and a finished one
    retrained, and a precision-only difference is refused for either."""
    from voxdiff.training import checkpoint as ckpt_mod

    parts = {"train.lr": "0.001", "data fingerprint": "abc", "world size": "2", "precision": "bf16",
             "code voxdiff/diffusion/objective.py": "h1", "libraries": "torch 2.13, monai 1.6"}
    path = tmp_path / "checkpoint.pt"

    def saved(finished, **theirs):
        ckpt_mod.save(path, {"fingerprint": "x", "fingerprint_parts": {**parts, **theirs}, "finished": finished,
                             "step": 3, "samples_seen": 6})

    saved(False)
    state, why = ckpt_mod.resumable(path, parts)
    assert state["step"] == 3 and why.startswith("resuming")
    saved(False, **{"world size": "1", "libraries": "torch 2.12, monai 1.6", "data fingerprint": "abd"})
    named = r"data fingerprint abd -> abc.*world size 1 -> 2.*torch 2\.12, monai 1\.6 -> torch 2\.13"
    with pytest.raises(VoxdiffError, match=named):
        ckpt_mod.resumable(path, parts)
    saved(True, **{"code voxdiff/diffusion/objective.py": "h0", "train.lr": "0.002"})
    state, why = ckpt_mod.resumable(path, parts)
    assert state is None and "train.lr 0.002 -> 0.001" in why and "diffusion/objective.py" in why
    for finished in (False, True):
        saved(finished, precision="fp32")
        with pytest.raises(VoxdiffError, match=r"trained in fp32.*resolves to bf16.*train.precision: fp32"):
            ckpt_mod.resumable(path, parts)
    state, why = ckpt_mod.resumable(path, parts, restart=True)
    assert state is None and "--restart" in why


def test_finished_run_in_another_precision_is_refused(tiny_root):
    """A finished bf16 model brought to a machine where train.precision auto resolves to fp32 is refused, not
    retrained over (the precision guard covered unfinished runs only)."""
    run_training(make_params({**SHORT, "train.precision": "bf16"}), tiny_root, progress=False)
    stamp = (tiny_root / "models" / "checkpoint.pt").read_bytes()
    with pytest.raises(VoxdiffError, match="finished run trained in bf16.*resolves to fp32.*train.precision: bf16"):
        run_training(make_params({**SHORT, "train.precision": "fp32"}), tiny_root, progress=False)
    assert (tiny_root / "models" / "checkpoint.pt").read_bytes() == stamp


def test_recording_code_is_not_in_the_training_hash():
    files = {f.name for f in codehash.training_sources()}
    assert "runs.py" not in files and "plots.py" not in files and "trainer.py" in files


# --- item 2: measurement-only keys keep the run ---------------------------------------------------------
@pytest.mark.parametrize("key,value", [("train.val_seed", 99), ("train.gns_bucket_samples", 5),
                                       ("train.phema_eval_sigma_rels", [0.05, 0.1]), ("train.val_every_samples", 2),
                                       ("train.phema_snapshots", 5), ("train.phema_sigma_rels", [0.05, 0.2])])
def test_measurement_keys_do_not_change_the_fingerprint(tiny_root, key, value):
    assert key.split(".")[1] in MEASUREMENT_KEYS
    assert trainer_for(tiny_root).fingerprint() == trainer_for(tiny_root, {key: value}).fingerprint()


def test_trajectory_keys_change_the_fingerprint(tiny_root):
    base = trainer_for(tiny_root).fingerprint()
    for key, value in (("train.lr", 2e-3), ("seed", 3), ("train.lr_schedule", "cosine"), ("train.grad_clip", 0.5)):
        assert trainer_for(tiny_root, {key: value}).fingerprint() != base, key


def test_changed_val_seed_keeps_a_finished_run_and_revalidates(tiny_root):
    run_training(make_params(SHORT), tiny_root, progress=False)
    first = checkpoint(tiny_root)
    summary = run_training(make_params({**SHORT, "train.val_seed": 99}), tiny_root, progress=False)
    after = checkpoint(tiny_root)
    assert all(torch.equal(first["model"][k], after["model"][k]) for k in first["model"])  # not retrained
    assert summary["mlflow_run_id"] == first["mlflow_run_id"]
    # The final val loss is measured again with the new draws (the weights did not change).
    assert summary["final_val_loss"] != first["history"][-1]["val_loss"]


def test_changed_measurement_key_resumes_and_is_recorded(tiny_root, monkeypatch):
    real_step = Trainer.train_step
    calls = {"n": 0}

    def stop_after_two(self):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", stop_after_two)
    with pytest.raises(KeyboardInterrupt):
        run_training(make_params(SHORT), tiny_root, progress=False)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert checkpoint(tiny_root)["step"] == 2
    summary = run_training(make_params({**SHORT, "train.val_draws": 3}), tiny_root, progress=False)
    done = checkpoint(tiny_root)
    assert done["finished"] and done["measurement_changes"] == [{"step": 2, "keys": ["val_draws"]}]
    assert summary["measurement_changed_at_steps"] == [2] and summary["total_steps"] == 4


def test_changed_gns_smoothing_is_applied_after_a_resume(tiny_root, monkeypatch):
    """issue 36 item 3: the resumed run's noise-scale EMA uses the train.gns_smoothing in force (the change
    is recorded as applied), not the checkpoint's."""
    real_step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: (_ for _ in ()).throw(KeyboardInterrupt)
                        if self.counters.step == 2 else real_step(self))
    with pytest.raises(KeyboardInterrupt):
        run_training(make_params({**SHORT, "train.gns_smoothing": 0.9}), tiny_root, progress=False)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    assert checkpoint(tiny_root)["gns"]["beta"] == 0.9
    run_training(make_params({**SHORT, "train.gns_smoothing": 0.5}), tiny_root, progress=False)
    done = checkpoint(tiny_root)
    assert done["finished"] and done["measurement_changes"] == [{"step": 2, "keys": ["gns_smoothing"]}]
    assert done["gns"]["beta"] == 0.5


def test_revalidated_finished_run_updates_mlflow_and_does_not_mix_draws(tiny_root):
    """issue 36 item 7: a finished run re-validated on other draws (train.val_seed changed) sends its new
    final_val_loss to its MLflow run (the real SQLite store), although the run already has the checkpoint's
    tags; and its summary does not set best_val_loss (and the other figures read off the val_loss curve,
    measured on the training's draws) beside a final_val_loss measured on the new ones. The run is tagged
    with what was measured on which draws."""
    from mlflow.tracking import MlflowClient

    first = run_training(make_params(SHORT), tiny_root, progress=False)
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    assert client.get_run(first["mlflow_run_id"]).data.metrics["final_val_loss"] == first["final_val_loss"]
    again = run_training(make_params({**SHORT, "train.val_seed": 99}), tiny_root, progress=False)
    assert again["mlflow_run_id"] == first["mlflow_run_id"] and again["final_val_loss"] != first["final_val_loss"]
    run = client.get_run(first["mlflow_run_id"])
    assert run.data.metrics["final_val_loss"] == again["final_val_loss"]
    assert run.info.status == "FINISHED"
    for key in ("best_val_loss", "own_best_val_loss", "plateau_change", "val_flattening"):
        assert first[key] is not None or key != "best_val_loss"
        assert again[key] is None, key
    note = run.data.tags["voxdiff.revalidated"]
    assert "val_seed 99" in note and "val_seed 1234" in note and "best_val_loss" in note
    assert again["val_draws_note"] == note
    detail = json.loads((tiny_root / "metrics" / "train_detail.json").read_text())
    assert detail["best_val_loss"] is None and detail["final_val_loss"] == again["final_val_loss"]


def test_changed_phema_settings_resume_the_run_with_its_own_profiles(tiny_root, tmp_path, monkeypatch):
    """issue 36 item 4: lowering train.phema_snapshots (what the disk-full message advises) or changing
    train.phema_sigma_rels resumes the run, recorded as a measurement change. The run keeps the profiles it
    started with (a profile added at step 2 would not span the run, which EDM2's reconstruction assumes); the
    snapshots folder holds exactly the snapshots the checkpoint lists, taken at the new cadence from the resume
    on; the weights are those of an uninterrupted run."""
    cfg = {**SHORT, "train.phema_sigma_rels": [0.05, 0.1], "train.phema_snapshots": 4}
    ref = uninterrupted_run(tiny_root, tmp_path / "ref", make_params(cfg))

    interrupted_at_step_2(tiny_root, cfg, monkeypatch)
    stopped = checkpoint(tiny_root)
    assert stopped["phema"]["snapshots"] == [1, 2]  # 4 per run: every 2 samples
    summary = run_training(make_params({**cfg, "train.phema_sigma_rels": [0.05, 0.1, 0.2],
                                        "train.phema_snapshots": 2}), tiny_root, progress=False)
    done = checkpoint(tiny_root)
    assert done["finished"] and done["mlflow_run_id"] == stopped["mlflow_run_id"]
    assert done["measurement_changes"] == [{"step": 2, "keys": ["phema_sigma_rels", "phema_snapshots"]}]
    assert done["phema"]["sigma_rels"] == [0.05, 0.1] and done["phema"]["snapshots"] == [1, 2, 4]  # 2 per run: 4, 8
    folder = tiny_root / "models" / "phema"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"{i}.{s}.{done['phema']['run']}.pt" for s in (1, 2, 4) for i in range(2))
    assert all(torch.equal(ref["model"][k], done["model"][k]) for k in ref["model"])
    assert summary["phema_best_val_loss"] is not None


# --- item 9: a resume cannot switch precision -----------------------------------------------------------
def test_resume_in_another_precision_is_refused(tiny_root, monkeypatch):
    bf16 = trainer_for(tiny_root, precision="bf16")
    fp32 = trainer_for(tiny_root, precision="fp32")
    assert bf16.fingerprint() != fp32.fingerprint() and fp32.fingerprint("bf16") == bf16.fingerprint()
    real_step = Trainer.train_step
    monkeypatch.setattr(Trainer, "train_step", lambda self: (_ for _ in ()).throw(KeyboardInterrupt)
                        if self.counters.step == 2 else real_step(self))
    with pytest.raises(KeyboardInterrupt):
        run_training(make_params({**SHORT, "train.precision": "bf16"}), tiny_root, progress=False)
    monkeypatch.setattr(Trainer, "train_step", real_step)
    with pytest.raises(VoxdiffError, match="trained in bf16.*resolves to fp32.*train.precision: bf16"):
        run_training(make_params({**SHORT, "train.precision": "fp32"}), tiny_root, progress=False)
    assert checkpoint(tiny_root)["step"] == 2  # kept
    run_training(make_params({**SHORT, "train.precision": "bf16"}), tiny_root, progress=False)
    assert checkpoint(tiny_root)["finished"]  # resumed in its own precision


# --- item 12: an unreadable checkpoint is refused, not trained over --------------------------------------
def test_unreadable_checkpoint_is_refused_and_kept(tiny_root):
    ckpt = tiny_root / "models" / "checkpoint.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"half a checkpoint")
    with pytest.raises(VoxdiffError, match=r"checkpoint.pt: not a readable.*--restart"):
        run_training(make_params(SHORT), tiny_root, progress=False)
    assert ckpt.read_bytes() == b"half a checkpoint"
    run_training(make_params(SHORT), tiny_root, progress=False, restart=True)
    assert checkpoint(tiny_root)["finished"]


def test_checkpoints_are_fsynced(tiny_root, monkeypatch):
    from voxdiff.runtime import fsutil

    synced = []
    real = fsutil.fsync_path
    monkeypatch.setattr(fsutil, "fsync_path", lambda p: (synced.append(str(p)), real(p)))
    run_training(make_params(SHORT), tiny_root, progress=False)
    assert any(s.endswith("checkpoint.pt") for s in synced) and str(tiny_root / "models") in synced


# --- item 11: SIGTERM stops at the end of the step, with a checkpoint ----------------------------------
def test_sigterm_saves_at_the_window_boundary_and_resumes_exactly(tiny_root, tmp_path, monkeypatch):
    cfg = {**SHORT, "train.max_samples": 12, "train.checkpoint_every": 100}  # no periodic checkpoints at all
    ref = uninterrupted_run(tiny_root, tmp_path / "ref", make_params(cfg))

    real_step = Trainer.train_step

    def terminated(self):
        if self.counters.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # lands inside the step
        return real_step(self)

    monkeypatch.setattr(Trainer, "train_step", terminated)
    with pytest.raises(KeyboardInterrupt):
        run_training(make_params(cfg), tiny_root, progress=False)
    stopped = checkpoint(tiny_root)
    assert stopped["step"] == 3 and not stopped["finished"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored
    monkeypatch.setattr(Trainer, "train_step", real_step)
    run_training(make_params(cfg), tiny_root, progress=False)
    done = checkpoint(tiny_root)
    assert all(torch.equal(ref["model"][k], done["model"][k]) for k in ref["model"])


# --- item 13: fp16 cannot skip forever ------------------------------------------------------------------
def test_fp16_stops_after_too_many_skipped_steps(tiny_root, monkeypatch):
    tr = trainer_for(tiny_root, {"train.precision": "fp16", "train.fp16_max_skipped_steps": 3,
                                 "train.max_samples": 40}, precision="fp16")
    # An overflow on every step: the scaler finds inf gradients and skips each one (a diverged fp16 run).
    real_unscale = tr.scaler.unscale_

    def overflowing_unscale(opt):
        for q in tr.net.parameters():
            if q.grad is not None:
                q.grad.fill_(float("inf"))
        return real_unscale(opt)

    monkeypatch.setattr(tr.scaler, "unscale_", overflowing_unscale)
    with pytest.raises(TrainingDiverged, match="skipped 3 steps in a row.*fp16_max_skipped_steps"):
        for _ in range(10):
            tr.train_step()
    assert tr.counters.step == 2 and tr.counters.skipped_steps == 3


# --- clip fraction (issue 20) ----------------------------------------------------------------------------
def test_clip_fraction_counts_the_steps_whose_norm_was_clipped(tiny_root):
    clipped = trainer_for(tiny_root, {"train.grad_clip": 1e-6, "train.max_samples": 8})
    free = trainer_for(tiny_root, {"train.grad_clip": 0.0, "train.max_samples": 8})
    loose = trainer_for(tiny_root, {"train.grad_clip": 1e6, "train.max_samples": 8})
    for tr in (clipped, free, loose):
        records = [tr.train_step() for _ in range(tr.budget.total_steps)]
        tr.last = records[-1]["clip_fraction"]
    assert clipped.last == 1.0 and free.last == 0.0 and loose.last == 0.0


# --- item 4: min-SNR weighting needs the squared error ---------------------------------------------------
def test_min_snr_with_l1_is_refused_naming_the_key():
    with pytest.raises(ParamsError, match="diffusion.min_snr_gamma.*diffusion.loss: l2"):
        make_params({"diffusion.min_snr_gamma": 5.0, "diffusion.loss": "l1"})
    make_params({"diffusion.min_snr_gamma": 5.0, "diffusion.loss": "l2"})  # the supported case
