"""An MLflow store that goes away mid-run: a real `mlflow server` (SQLite store, loopback port) stopped
during a tiny training and started again on the same port and store. Afterwards the run has every step,
its summary and FINISHED; a store still away at the end is caught up by running the finished stage
again; and a training that dies (an exception in a step, a full disk at the end) ends its run FAILED."""

from __future__ import annotations

import csv
import errno
import signal
import warnings

import pytest

from conftest import make_params
from mlflow_server import MlflowServer, api
from voxdiff.tracking.runs import RunTracker
from voxdiff.training import checkpoint
from voxdiff.pipeline.train import run_training
from voxdiff.training.trainer import Trainer

pytestmark = pytest.mark.slow

# 1 sample per step, validation every 2 samples, a checkpoint (= a logging point) every 2 steps; no
# noise-scale probe or post-hoc EMA (most of a tiny run's time at its end).
CFG = {"train.batch_size": 1, "train.accumulate_every": 1, "train.checkpoint_every": 2,
       "train.gns_buckets_every_samples": 0, "train.phema_sigma_rels": [], "mlflow.system_metrics": False}


def steps_of(url: str, run_id: str, key: str) -> list[int]:
    history = api(url, f"metrics/get-history?run_id={run_id}&metric_key={key}&max_results=1000")
    return sorted(m["step"] for m in history.get("metrics", []))


def only_run(url: str) -> dict:
    exp = api(url, "experiments/get-by-name?experiment_name=voxdiff")["experiment"]
    runs = api(url, "runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]
    assert len(runs) == 1, runs
    return runs[0]


def val_steps(root) -> list[int]:
    with open(root / "metrics" / "val_curve.tsv") as fh:
        return [int(r["step"]) for r in csv.DictReader(fh, delimiter="\t")]


def assert_complete(url: str, run_id: str, root, steps: int) -> None:
    run = only_run(url)
    assert run["info"]["run_id"] == run_id
    assert steps_of(url, run_id, "train_loss") == list(range(1, steps + 1))
    assert steps_of(url, run_id, "val_loss") == val_steps(root) and len(val_steps(root)) == steps // 2
    metrics = {m["key"] for m in run["data"]["metrics"]}
    assert {"final_val_loss", "total_samples"} <= metrics
    assert run["inputs"]["dataset_inputs"], "the dataset input is missing"
    assert run["info"]["status"] == "FINISHED"


def with_events(monkeypatch, events: dict) -> None:
    """Run events[step]() right after optimizer step `step` (before its checkpoint and logging)."""
    original = Trainer.train_step

    def train_step(self):
        record = original(self)
        if self.counters.step in events:
            events[self.counters.step]()
        return record

    monkeypatch.setattr(Trainer, "train_step", train_step)


def mlflow_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("MLflow")]


def test_server_down_mid_training_then_back(tiny_root, tmp_path, monkeypatch):
    """Down after step 5, back at step 10 of 16: caught up at the next checkpoint, complete at the end.
    Before the fix the first failed call ended tracking: steps 1-4 only, no summary, RUNNING."""
    server = MlflowServer(tmp_path / "server")
    server.start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        seen = {}
        with_events(monkeypatch, {5: lambda: server.stop(signal.SIGKILL), 10: server.start,
                                  14: lambda: seen.update(at_14=steps_of(server.url, run_id(), "train_loss"))})
        run_id = lambda: only_run(server.url)["info"]["run_id"]  # noqa: E731
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = run_training(make_params({**CFG, "train.max_samples": 16}), tiny_root, progress=False)
        assert_complete(server.url, summary["mlflow_run_id"], tiny_root, 16)
        assert seen["at_14"] == list(range(1, 13))  # steps 5-12 sent at the checkpoints after the restart
        lines = mlflow_warnings(caught)
        assert len(lines) == 1, lines  # one line for the outage, not one per checkpoint
        assert "metrics of steps 5-6 not logged yet, retried" in lines[0]
    finally:
        server.stop()


def test_server_still_down_at_the_end_is_caught_up_by_the_next_run(tiny_root, tmp_path, monkeypatch):
    """Down from step 5 of 8 until after the training (its end waits 1 s here): the stage succeeds and
    says the run is incomplete; once the server is back, the finished checkpoint run again ("nothing
    to train") sends the missing steps, summary and model and ends the run FINISHED."""
    server = MlflowServer(tmp_path / "server")
    server.start()
    try:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
        monkeypatch.setattr(RunTracker, "end_wait_s", 1.0, raising=False)  # (absent before the fix)
        with_events(monkeypatch, {5: lambda: server.stop(signal.SIGKILL)})
        params = make_params({**CFG, "train.max_samples": 8})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            summary = run_training(params, tiny_root, progress=False)
        lines = mlflow_warnings(caught)
        assert any("is incomplete" in line and "metrics of steps 5-8" in line for line in lines), lines
        server.start()
        run = only_run(server.url)
        assert run["info"]["status"] == "RUNNING" and steps_of(server.url, run["info"]["run_id"], "train_loss")[-1] == 4
        again = run_training(params, tiny_root, progress=False)
        assert again["mlflow_run_id"] == summary["mlflow_run_id"]
        assert_complete(server.url, summary["mlflow_run_id"], tiny_root, 8)
        assert only_run(server.url)["outputs"]["model_outputs"], "the EMA model is missing"
        end = only_run(server.url)["info"]["end_time"]
        run_training(params, tiny_root, progress=False)  # a complete run is left as it is
        assert only_run(server.url)["info"]["end_time"] == end
    finally:
        server.stop()


def sqlite_run(root):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{root / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("voxdiff").experiment_id])
    assert len(runs) == 1
    return runs[0]


def test_exception_in_a_step_ends_the_run_failed(tiny_root, monkeypatch):
    """Any exception out of the loop (here what a CUDA fault raises) ends the run FAILED, with the
    steps its checkpoints covered; before the fix only TrainingDiverged and Ctrl-C ended it."""
    def fault():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    with_events(monkeypatch, {5: fault})
    with pytest.raises(RuntimeError, match="CUDA error"):
        run_training(make_params({**CFG, "train.max_samples": 8}), tiny_root, progress=False)
    run = sqlite_run(tiny_root)
    assert run.info.status == "FAILED"
    assert run.data.metrics["samples_seen"] == 4  # the last checkpointed step before the fault


def test_disk_full_after_training_ends_the_run_failed(tiny_root, monkeypatch):
    """ENOSPC writing the final checkpoint after the last step: the run ends FAILED, not RUNNING."""
    save = checkpoint.save

    def full_at_the_end(path, state):
        if state["finished"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        save(path, state)

    monkeypatch.setattr(checkpoint, "save", full_at_the_end)
    with pytest.raises(OSError, match="No space left"):
        run_training(make_params({**CFG, "train.max_samples": 4}), tiny_root, progress=False)
    assert sqlite_run(tiny_root).info.status == "FAILED"
