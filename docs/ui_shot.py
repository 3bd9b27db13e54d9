"""make ui-shot: the MLflow UI's comparison of runs at equal samples (src/voxdiff/tracking/views.py) as a
user sees it, served by a real `mlflow server` and rendered by headless Chromium into a PNG.

    .venv/bin/python docs/ui_shot.py          # the study's micro-batch 1 x accumulate_every 1/2/4/8 runs
    .venv/bin/python docs/ui_shot.py --db mlflow.db --experiment voxdiff --filter ""   # your own runs

1. Without --db, the runs archived in --runs (docs/study/runs, `voxdiff export`) that match --filter
   are imported into a temporary SQLite store (voxdiff.report.loading.import_record: every history at
   its own steps). With --db, that store is used as it is.
2. `voxdiff compare` runs on the store (report into a temporary folder): it saves the MLflow view of
   exactly the runs it compared, grouped as it groups them, and gives its address.
3. `mlflow server` on a free loopback port; Chromium, driven over the DevTools protocol, opens that
   address, waits until the charts are drawn, closes the assistant panel and the shared-view banner,
   takes the screenshot; both are stopped. Bounded: server start 60 s, page 120 s.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
STUDY_FILTER = "params.`train.batch_size` = '1' and params.`train.lr_scaling` = 'none'"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                  "--disable-quic"]
# What "drawn" means: the traces plotted in the view's own section, the same number for 3 s running.
COUNT_TRACES = "document.querySelectorAll('.js-plotly-plot .scatterlayer .trace').length"
TIDY = """(() => { const hit = [];
  for (const label of ['Close', 'Hide banner']) {
    const b = document.querySelector(`button[aria-label="${label}"]`); if (b) { b.click(); hit.push(label); } }
  return hit.join(','); })()"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, then SIGKILL if `proc` is still there after `grace_s`."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            sys.exit(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    sys.exit(f"{what or url} did not answer within {timeout_s:.0f} s")


def import_study(runs_dir: Path, filter_string: str, db: Path, experiment: str) -> int:
    from mlflow import MlflowClient

    from voxdiff.report.compare import parse_param_filter
    from voxdiff.report.loading import ARCHIVE_FORMAT, import_record

    wanted = parse_param_filter(filter_string)
    client = MlflowClient(f"sqlite:///{db}")
    exp_id = client.create_experiment(experiment)
    n = 0
    for f in sorted(runs_dir.glob("*.json")):
        record = json.loads(f.read_text())
        if record.get("format") != ARCHIVE_FORMAT or record.get("tags", {}).get("voxdiff.kind") != "train":
            continue
        if all(record["params"].get(k) == v for k, v in wanted.items()):
            import_record(client, exp_id, record)
            n += 1
    if not n:
        sys.exit(f"{runs_dir}: no archived training runs match {filter_string!r}")
    return n


class DevTools:
    """The few DevTools-protocol calls we need, over one page's websocket (aiohttp)."""

    def __init__(self, ws):
        self.ws, self.next_id, self.pending = ws, 0, {}

    async def read(self):
        async for msg in self.ws:
            data = json.loads(msg.data)
            fut = self.pending.pop(data.get("id"), None)
            if fut is not None and not fut.done():
                fut.set_result(data)

    async def call(self, method: str, **params):
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        await self.ws.send_str(json.dumps({"id": self.next_id, "method": method, "params": params}))
        reply = await asyncio.wait_for(fut, 60)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply["result"]

    async def js(self, expression: str):
        reply = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return reply["result"].get("value")


async def screenshot(url: str, out: Path, width: int, height: int, timeout_s: float) -> int:
    import aiohttp

    port, profile = free_port(), tempfile.mkdtemp(prefix="voxdiff-chromium-")
    log = open(Path(profile) / "chromium.log", "w")
    browser = subprocess.Popen([shutil.which("chromium") or "chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
                                f"--remote-debugging-port={port}", "about:blank"], stdout=log, stderr=log)
    try:
        wait_http(f"http://127.0.0.1:{port}/json/version", 30, browser, "chromium")
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://127.0.0.1:{port}/json/list") as r:
                page = next(p for p in await r.json() if p["type"] == "page")
            async with session.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                dt = DevTools(ws)
                reader = asyncio.create_task(dt.read())
                await dt.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1,
                              mobile=False)
                await dt.call("Page.navigate", url=url)
                deadline, last, stable, tidied = time.time() + timeout_s, -1, 0, False
                while time.time() < deadline and stable < 3:
                    await asyncio.sleep(1)
                    n = await dt.js(COUNT_TRACES)
                    stable = stable + 1 if n and n == last else 0
                    last = n
                    if stable == 3 and not tidied:
                        await dt.js(TIDY)  # the charts reflow into the freed width: wait until still again
                        tidied, stable = True, 0
                if stable < 3:
                    sys.exit(f"the charts were not drawn within {timeout_s:.0f} s ({last} traces): {url}")
                shot = await dt.call("Page.captureScreenshot", format="png")
                out.write_bytes(base64.b64decode(shot["data"]))
                reader.cancel()
                return last
    finally:
        stop(browser, 10)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=Path, default=ROOT / "docs" / "study" / "runs", help="archive folder to import")
    ap.add_argument("--db", type=Path, help="an existing SQLite store instead of importing --runs")
    ap.add_argument("--experiment", default="voxdiff-study")
    ap.add_argument("--filter", default=STUDY_FILTER, help="MLflow filter on the runs (params terms for --runs)")
    ap.add_argument("--group-by", default="train.accumulate_every")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "mlflow-compare.png")
    ap.add_argument("--size", default="1600x1000", help="browser window, WIDTHxHEIGHT")
    a = ap.parse_args()
    os.environ.setdefault("GIT_PYTHON_REFRESH", "quiet")
    from voxdiff.report.compare import compare_runs

    width, height = (int(v) for v in a.size.split("x"))
    with tempfile.TemporaryDirectory(prefix="voxdiff-ui-shot-") as tmp:
        if a.db is None:
            db = Path(tmp) / "mlflow.db"
            n = import_study(a.runs, a.filter, db, a.experiment)
            print(f"imported {n} archived runs from {a.runs} into a temporary store", file=sys.stderr)
        else:
            db = a.db.resolve()
            if not db.is_file():
                sys.exit(f"no MLflow store at {db}: train first (make demo, make study)")
        uri = f"sqlite:///{db}"
        result = compare_runs(uri, a.experiment, Path(tmp) / "report" / "compare.md", a.group_by, a.filter or None)
        from mlflow import MlflowClient

        from voxdiff.tracking import views

        exp_id = MlflowClient(uri).get_experiment_by_name(a.experiment).experiment_id
        path = views.view_path(exp_id, views.compare_key(a.group_by))  # what compare saved (result.view_url)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host",
                                   "127.0.0.1", "--port", str(port), "--workers", "1"],
                                  stdout=subprocess.DEVNULL, stderr=open(Path(tmp) / "server.log", "w"))
        try:
            wait_http(f"http://127.0.0.1:{port}/health", 60, server, "mlflow server")
            url = f"http://127.0.0.1:{port}{path}"
            traces = asyncio.run(screenshot(url, a.out, width, height, 120))
        finally:
            stop(server, 15)
    print(f"wrote {a.out} ({traces} curves drawn; {len(result.groups)} groups of {a.group_by}) from {url}")


if __name__ == "__main__":
    main()
