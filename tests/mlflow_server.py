"""A real `mlflow server` (SQLite backend, loopback port) for the tests that need one: the grid on several hosts
(test_e2e_hosts.py, which also reads the runs back through the server's REST API) and the outages
(test_tracking_outage.py)."""

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
