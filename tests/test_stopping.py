"""No way for a SIGTERM to end a training before its save (issue 36 item 11): a stop noted while the process
starts up, a repeated SIGTERM, a stderr whose reader is gone. With DVC and a slow step: test_stopping_dvc.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_params
from voxdiff.pipeline.train import run_training
from voxdiff.training.trainer import Trainer

TESTS = Path(__file__).resolve().parent


def checkpoint(root: Path) -> dict:
    return torch.load(root / "models" / "checkpoint.pt", weights_only=True)


# --- item 11: every way a SIGTERM could end the process before its save ----------------------------------
def test_a_gone_stderr_does_not_end_training_before_its_save(tiny_root, monkeypatch):
    """stderr is a pipe whose reader is gone (`dvc repro train | tee log` with its process group stopped: tee
    dies at once): a progress line after the SIGTERM raised BrokenPipeError and the run ended without saving."""
    read, write = os.pipe()
    os.close(read)
    broken = os.fdopen(write, "w")
    cfg = {"train.max_samples": 16, "train.batch_size": 1, "train.accumulate_every": 2,
           "train.val_every_samples": 2, "train.checkpoint_every": 100}
    real_step = Trainer.train_step

    def terminated(self):
        out = real_step(self)
        if self.counters.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # after the step: its validation and progress line still run
        return out

    monkeypatch.setattr(Trainer, "train_step", terminated)
    monkeypatch.setattr(sys, "stderr", broken)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_training(make_params(cfg), tiny_root, progress=False)
    finally:
        monkeypatch.undo()
        try:
            broken.close()
        except BrokenPipeError:
            pass
    stopped = checkpoint(tiny_root)
    assert stopped["step"] == 2 and not stopped["finished"]


def signal_after_step(monkeypatch, at: int, sig: int = signal.SIGHUP) -> None:
    """Send `sig` to this process right after optimizer step `at` (SIGHUP: the terminal closed)."""
    real_step = Trainer.train_step

    def signalled(self):
        out = real_step(self)
        if self.counters.step == at:
            os.kill(os.getpid(), sig)
        return out

    monkeypatch.setattr(Trainer, "train_step", signalled)


HUP_CFG = {"train.max_samples": 12, "train.batch_size": 1, "train.accumulate_every": 2, "train.checkpoint_every": 100}


def test_a_closed_terminal_stops_at_a_boundary_with_its_save(tiny_root, monkeypatch):
    """SIGHUP (an ssh session dropped) took its default action: the process ended at once, its MLflow run left
    RUNNING, the steps since the last checkpoint lost. It is now a stop request like SIGTERM."""
    from mlflow import MlflowClient

    previous = signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the default that ends the process (pytest may run under nohup)
    try:
        signal_after_step(monkeypatch, 2)
        with pytest.raises(KeyboardInterrupt):
            run_training(make_params(HUP_CFG), tiny_root, progress=False)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_DFL  # put back
    finally:
        signal.signal(signal.SIGHUP, previous)
    stopped = checkpoint(tiny_root)
    assert stopped["step"] == 2 and not stopped["finished"]
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("voxdiff").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]


def test_a_sigterm_repeated_while_the_stop_is_saved_is_noted_not_fatal(tiny_root, monkeypatch):
    """A launcher repeats SIGTERM (torchrun forwards the group's, SLURM signals every process): one that arrived
    while the stop's checkpoint was written took SIGTERM's default action, the loop's handler being gone by
    then, and ended the process mid-save with its MLflow run RUNNING."""
    from mlflow import MlflowClient

    from voxdiff.training import checkpoint as ckpt

    real_save = ckpt.save
    sent = []

    def save_under_a_repeated_sigterm(path, state):
        if not state["finished"] and state["step"] == 2 and not sent:
            sent.append(os.kill(os.getpid(), signal.SIGTERM))  # the launcher's second SIGTERM, mid-save
        return real_save(path, state)

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signal_after_step(monkeypatch, 2, signal.SIGTERM)  # the stop
    monkeypatch.setattr(ckpt, "save", save_under_a_repeated_sigterm)
    with pytest.raises(KeyboardInterrupt):
        run_training(make_params(HUP_CFG), tiny_root, progress=False)
    assert sent and checkpoint(tiny_root)["step"] == 2
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("voxdiff").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the original handler is back after the training


def test_a_run_under_nohup_keeps_ignoring_a_closed_terminal(tiny_root, monkeypatch):
    """`nohup voxdiff train &`: SIGHUP ignored from the start stays ignored; the run trains to its end."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        signal_after_step(monkeypatch, 2)
        run_training(make_params(HUP_CFG), tiny_root, progress=False)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    done = checkpoint(tiny_root)
    assert done["finished"] and done["step"] == 6


STOPPED_RUN = r"""
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from conftest import make_params
from voxdiff.pipeline import train
from voxdiff.training.trainer import Trainer

when = sys.argv[3]
real_init, real_step = Trainer.__init__, Trainer.train_step

def init(self, *a, **k):
    real_init(self, *a, **k)
    if when == "start-up":  # while the trainer is built: before the loop's handler
        os.kill(os.getpid(), signal.SIGTERM)

def step(self):
    if when == "twice" and self.counters.step == 1:
        os.kill(os.getpid(), signal.SIGTERM)  # the process group's
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)  # and the launcher's forwarded copy
    return real_step(self)

Trainer.__init__, Trainer.train_step = init, step
params = make_params({"train.max_samples": 12, "train.checkpoint_every": 100})
try:
    train.run_training(params, sys.argv[2], progress=False)
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("when", ["twice", "start-up"])
def test_sigterm_never_ends_the_process_before_its_save(tiny_root, when):
    """twice: a second SIGTERM (torchrun forwards the group's; SLURM signals every process) took SIGTERM's
    default action mid-step: killed, no checkpoint. start-up: a SIGTERM before the loop's handler killed the
    process without a line, its MLflow run left RUNNING. Both now stop at a boundary, exit 130, and say what
    they saved."""
    from mlflow import MlflowClient

    out = subprocess.run([sys.executable, "-c", STOPPED_RUN, str(TESTS), str(tiny_root), when],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 130, (out.returncode, out.stderr[-2000:])
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    runs = client.search_runs([client.get_experiment_by_name("voxdiff").experiment_id])
    assert [r.info.status for r in runs] == ["KILLED"]
    if when == "twice":
        assert checkpoint(tiny_root)["step"] == 2
        assert "[voxdiff train] interrupted: checkpoint saved at step 2" in out.stderr
    else:
        assert not (tiny_root / "models" / "checkpoint.pt").exists()
        assert "[voxdiff train] stopped before this process's first step: nothing new to save" in out.stderr


def test_a_stop_noted_before_anything_started_is_honoured_at_once(tiny_root):
    """The stage entry and `voxdiff train` defer SIGTERM before the heavy imports (voxdiff.runtime.stopping); one that
    arrived there ends the run before anything starts."""
    from voxdiff.runtime import stopping

    stopping.defer()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stopping.requested() == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            run_training(make_params(), tiny_root, progress=False)
    finally:
        stopping.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and stopping.requested() is None
    assert not (tiny_root / "models").exists() and not (tiny_root / "mlflow.db").exists()
