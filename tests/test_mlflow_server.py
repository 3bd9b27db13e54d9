"""A real `mlflow server` (SQLite backend, loopback port) as users scale out: a queued DVC grid logs to
it, and its REST API finds the runs by param, reads their val_loss histories, and the logged model loads."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from test_e2e_dvc import make_repo, run_queue, sh

pytestmark = pytest.mark.slow


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(base: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=data,
                                 headers={"Content-Type": "application/json"}, method="POST" if body else "GET")
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


class MlflowServer:
    """`mlflow server` on a free loopback port with a SQLite store and artifacts under `store`; stop()
    then start() brings it back on the same port and store, as an operator restarting it would."""

    def __init__(self, store: Path):
        self.store, self.port = store, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        store.mkdir(parents=True, exist_ok=True)

    def start(self, timeout: float = 120) -> None:
        # Without job execution the server starts in ~4 s instead of ~13 s on two busy cores, and
        # leaves no huey consumer processes behind when stopped.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        log = self.store / "server.log"  # a file, not a pipe: a full pipe would block the server
        with open(log, "ab") as err:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                 f"sqlite:///{self.store / 'mlflow.db'}", "--artifacts-destination", str(self.store / "artifacts"),
                 "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1"],
                cwd=self.store, env=env, stdout=subprocess.DEVNULL, stderr=err,
                start_new_session=True)  # its own process group: stop() reaches the uvicorn worker too
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2)
                return
            except OSError:
                if self.proc.poll() is not None:
                    pytest.fail(f"mlflow server exited: {log.read_text(errors='replace')[-2000:]}")
                time.sleep(0.2)
        self.stop()
        pytest.fail(f"mlflow server did not answer /health within {timeout:.0f} s")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server's process group (SIGKILL: as a crash would)."""
        if self.proc is None:
            return
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, s)
                self.proc.wait(timeout=20)
                break
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None
        deadline = time.time() + 20  # the worker may outlive the CLI process by a moment: wait for the port
        while time.time() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.1)


@pytest.fixture
def server(tmp_path):
    srv = MlflowServer(tmp_path / "server")
    srv.start()
    yield srv.url
    srv.stop()


def test_queued_grid_through_a_real_mlflow_server(tmp_path, server, monkeypatch):
    repo = make_repo(tmp_path / "proj", {"mlflow.tracking_uri": server, "mlflow.experiment": "grid",
                                         "mlflow.system_metrics_interval_s": 1.0})
    sh(repo, "dvc", "repro", "preprocess")
    sh(repo, "git", "add", "-A")
    sh(repo, "git", "commit", "-qm", "data")
    run_queue(repo, "train.accumulate_every=1,2", jobs=1)
    assert not (repo / "mlflow.db").exists()  # everything went to the server

    exp = api(server, "experiments/get-by-name?experiment_name=grid")["experiment"]
    for k in ("1", "2"):
        found = api(server, "runs/search", {"experiment_ids": [exp["experiment_id"]],
                                            "filter": f"params.`train.accumulate_every` = '{k}'"})["runs"]
        assert len(found) == 1, found
        run = found[0]
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert params["effective_batch_size"] == k and run["info"]["status"] == "FINISHED"
        history = api(server, f"metrics/get-history?run_id={run['info']['run_id']}&metric_key=val_loss")["metrics"]
        assert len(history) >= 2 and all(m["value"] > 0 for m in history)
        metrics = {m["key"] for m in run["data"]["metrics"]}
        assert any(key.startswith("system/cpu_utilization") for key in metrics), sorted(metrics)
        inputs = run["inputs"]["dataset_inputs"]
        assert inputs and inputs[0]["dataset"]["name"].startswith("voxdiff-processed")

    # The logged EMA model loads back through the server's artifact proxy and runs.
    import mlflow
    import torch

    # mlflow.set_tracking_uri also sets MLFLOW_TRACKING_URI in os.environ: monkeypatch restores it after
    # the test, so later tests (and their subprocesses) do not talk to this stopped server.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(server)
    net = mlflow.pytorch.load_model(f"runs:/{found[0]['info']['run_id']}/ema_model")
    info = mlflow.models.get_model_info(f"runs:/{found[0]['info']['run_id']}/ema_model")
    meta = info.metadata
    assert meta["label_values"] == [0, 1, 2, 3] and meta["weights"] == "EMA"
    shape = meta["shape"]
    x = torch.zeros(1, 1 + meta["num_classes"], *shape)
    assert net(x, timesteps=torch.zeros(1, dtype=torch.long)).shape == (1, 1, *shape)
    mlflow.set_tracking_uri("")  # and MLflow's in-process default back to its own
