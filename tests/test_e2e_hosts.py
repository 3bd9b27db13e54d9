"""A grid on several hosts with existing tools only: git, DVC, one `mlflow server` (README, *Run a grid on
several machines*). Three clones of the project on this machine stand in for three hosts; they share a bare
git remote, a DVC remote that is a folder, and a real `mlflow server` on loopback (SQLite backend).

Host A prepares the data, pushes it (`dvc push`) and the baseline (`git push`), then runs its half of the grid
as a SLURM array task would (`dvc exp run -S ... && dvc exp push origin <name>`). Host B clones, `dvc pull`s
the data (so both hosts train on byte-identical data and neither repeats preprocessing; on a cluster the
processed cache is the large part) and runs its half through the queue (`dvc exp run --queue`, `dvc queue
start`, `dvc exp push origin`). The analysis host clones, pulls every experiment from the git remote and
compares them: DVC's view (`dvc exp show`) from git refs, MLflow's view (`voxdiff compare`) from the server.

The grid is made once for the module (grid_on_hosts); a second test reads the same runs back through the
server's REST API: found by param, their val_loss histories, system metrics and dataset, and the logged model
loaded through the server's artifact proxy.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from test_e2e_dvc import make_repo, run_queue, sh
from mlflow_server import MlflowServer, api

pytestmark = pytest.mark.slow

HOSTS = {"a": "1", "b": "2"}  # host -> its train.accumulate_every


def exp_names(repo: Path, *remote: str) -> set[str]:
    out = sh(repo, "dvc", "exp", "list", "--all-commits", "--name-only", *remote).stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def cache_file(repo: Path, md5: str) -> Path:
    return repo / ".dvc" / "cache" / "files" / "md5" / md5[:2] / md5[2:]


def exp_commit(repo: Path, name: str) -> str:
    """The commit of experiment `name` (its git ref: refs/exps/<baseline sha in parts>/<name>)."""
    refs = sh(repo, "git", "for-each-ref", "--format=%(refname) %(objectname)", "refs/exps").stdout.split("\n")
    (sha,) = [line.split()[1] for line in refs if line.split(" ")[0].endswith(f"/{name}")]
    return sha


def locked_md5(repo: Path, name: str, path: str) -> str:
    """The md5 that experiment `name`'s dvc.lock records for the output `path`."""
    lock = yaml.safe_load(sh(repo, "git", "show", f"{exp_commit(repo, name)}:dvc.lock").stdout)
    for stage in lock["stages"].values():
        for out in stage.get("outs", []):
            if out["path"] == path:
                return out["md5"]
    raise AssertionError(f"{path} not in {name}'s dvc.lock")


@dataclass
class Grid:
    """The grid as the analysis host sees it: the server, the three clones, and each host's experiment."""
    url: str
    host_a: Path
    host_b: Path
    host_c: Path
    names: dict  # host -> its DVC experiment's name


@pytest.fixture(scope="module")
def grid_on_hosts(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hosts")
    server = MlflowServer(tmp_path / "server")
    server.start()
    try:
        yield make_grid(tmp_path, server.url)
    finally:
        server.stop()


def make_grid(tmp_path: Path, url: str) -> Grid:
    origin = tmp_path / "origin.git"
    sh(tmp_path, "git", "init", "-q", "--bare", "-b", "main", str(origin))

    # Host A: the project with the server in params.yaml, a DVC remote, the data made once and pushed.
    host_a = make_repo(tmp_path / "host-a", {"mlflow.tracking_uri": url, "mlflow.experiment": "hosts",
                                             "mlflow.system_metrics_interval_s": 1.0})
    sh(host_a, "dvc", "remote", "add", "-d", "store", str(tmp_path / "dvc-remote"))
    sh(host_a, "dvc", "repro", "preprocess")
    sh(host_a, "git", "add", "-A")
    sh(host_a, "git", "commit", "-qm", "data and remotes")
    sh(host_a, "dvc", "push")
    sh(host_a, "git", "remote", "add", "origin", str(origin))
    sh(host_a, "git", "push", "-q", "origin", "main")

    # Host B: a clone; the data comes from the DVC remote, not from running prepare/preprocess again.
    host_b = tmp_path / "host-b"
    sh(tmp_path, "git", "clone", "-q", str(origin), str(host_b))
    # Plain `dvc pull` fetches the data too but exits 1: the baseline never trained, so train's and
    # evaluate's outputs have no hash to check out. Pull the data stages only.
    sh(host_b, "dvc", "pull", "--with-deps", "preprocess")
    assert (host_b / "data/processed/images.npy").read_bytes() == (host_a / "data/processed/images.npy").read_bytes()

    # Each host runs its half of the grid and pushes it: A as one array task would, B through the queue.
    out = sh(host_a, "dvc", "exp", "run", "-S", f"train.accumulate_every={HOSTS['a']}")
    assert "Running stage 'train'" in out.stdout and "Running stage 'preprocess'" not in out.stdout
    (name_a,) = exp_names(host_a)
    sh(host_a, "dvc", "exp", "push", "origin", name_a)
    run_queue(host_b, f"train.accumulate_every={HOSTS['b']}", jobs=1)
    (name_b,) = exp_names(host_b)
    sh(host_b, "dvc", "exp", "push", "origin")  # every experiment of the current commit
    names = {"a": name_a, "b": name_b}
    assert name_a != name_b

    # The analysis host: a fresh clone sees both experiments on the git remote and pulls them.
    host_c = tmp_path / "host-c"
    sh(tmp_path, "git", "clone", "-q", str(origin), str(host_c))
    assert exp_names(host_c) == set()
    assert exp_names(host_c, "origin") == set(names.values())
    sh(host_c, "dvc", "exp", "pull", "origin", *names.values())
    assert exp_names(host_c) == set(names.values())

    return Grid(url, host_a, host_b, host_c, names)


def test_grid_on_two_hosts_compared_on_a_third(grid_on_hosts):
    url, host_c, names = grid_on_hosts.url, grid_on_hosts.host_c, grid_on_hosts.names
    # `dvc exp show` has each experiment's param and metrics (git refs: no data or model needed for them).
    table = sh(host_c, "dvc", "exp", "show", "--csv").stdout
    rows = {r["Experiment"]: r for r in csv.DictReader(io.StringIO(table)) if r["Experiment"]}
    for host, name in names.items():
        assert name in rows, table
        row = rows[name]
        assert row["train.accumulate_every"] == HOSTS[host], table
        assert float(row["val_loss"]) > 0 and float(row["samples"]) == 16, table
        assert 0 < float(row["ssim"]) <= 1, table  # evaluate ran on the host and its metrics came along too

    # `dvc exp pull` brought every cached output of each experiment into the analysis host's DVC cache: the
    # trained model, the samples and the data (models/phema, `cache: false`, stays on the host that trained;
    # a queued run's is gone with its temp dir). `dvc exp apply` then puts exactly the model the
    # experiment's metrics describe into the workspace.
    for host, name in names.items():
        for path in ("models/checkpoint.pt", "samples", "data/processed"):
            assert cache_file(host_c, locked_md5(host_c, name, path)).is_file(), f"{name}: {path} not pulled"
    sh(host_c, "dvc", "exp", "apply", names["b"])
    ckpt = (host_c / "models/checkpoint.pt").read_bytes()
    applied = json.loads((host_c / "metrics/checkpoint.json").read_text())["checkpoint"]
    assert hashlib.sha256(ckpt).hexdigest()[:10] == applied
    detail = json.loads((host_c / "metrics/train_detail.json").read_text())

    # The server holds one FINISHED run per experiment, named after it, with the host's setting.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(url)
    exp = client.get_experiment_by_name("hosts")
    runs = client.search_runs([exp.experiment_id], filter_string="tags.`voxdiff.kind` = 'train'")
    by_name = {r.info.run_name: r for r in runs}
    assert sorted(by_name) == sorted(names.values()), [r.info.run_name for r in runs]
    for host, name in names.items():
        run = by_name[name]
        assert run.info.status == "FINISHED"
        assert run.data.tags["voxdiff.dvc_exp_name"] == name
        assert run.data.params["train.accumulate_every"] == HOSTS[host]
        assert run.data.params["effective_batch_size"] == HOSTS[host]  # batch_size 1, one process
        assert float(rows[name]["val_loss"]) == pytest.approx(run.data.metrics["final_val_loss"], rel=1e-6)
        assert "eval_ssim" in run.data.metrics
    assert detail["mlflow_run_id"] == by_name[names["b"]].info.run_id
    assert len({r.data.tags["voxdiff.data_fingerprint"] for r in runs}) == 1  # one dataset on both hosts

    # `voxdiff compare` on the analysis host reads every run from the server (params.yaml's tracking_uri).
    out = sh(host_c, "voxdiff", "compare", "--out", "reports/compare.md")
    report = (host_c / "reports/compare.md").read_text()
    assert f"Source: MLflow store `{url}`" in report
    assert "2 finished training run(s) in 2 group(s)" in report
    for host, name in names.items():
        setting = f"| train.accumulate_every={HOSTS[host]} |"
        assert setting in report
        assert any(setting in line and name in line and by_name[name].info.run_id in line
                   for line in report.splitlines()), report  # the runs table: setting, run, DVC experiment
    assert f"{url}/#/experiments/{exp.experiment_id}/runs" in out.stdout


def test_the_server_holds_every_run_and_serves_its_history_and_model(grid_on_hosts, monkeypatch):
    """A queued run (host B) and a plain `dvc exp run` (host A) both log to the server and nowhere else; its REST
    API finds each by param, with its val_loss history, system metrics and dataset; the logged EMA model loads
    back through the server's artifact proxy and runs."""
    url = grid_on_hosts.url
    for host in (grid_on_hosts.host_a, grid_on_hosts.host_b):
        assert not (host / "mlflow.db").exists() and not (host / "mlruns").exists()  # everything went to the server

    exp = api(url, "experiments/get-by-name?experiment_name=hosts")["experiment"]
    for k in HOSTS.values():
        found = api(url, "runs/search", {"experiment_ids": [exp["experiment_id"]],
                                         "filter": f"params.`train.accumulate_every` = '{k}'"})["runs"]
        assert len(found) == 1, found
        run = found[0]
        params = {p["key"]: p["value"] for p in run["data"]["params"]}
        assert params["effective_batch_size"] == k and run["info"]["status"] == "FINISHED"
        history = api(url, f"metrics/get-history?run_id={run['info']['run_id']}&metric_key=val_loss")["metrics"]
        assert len(history) >= 2 and all(m["value"] > 0 for m in history)
        metrics = {m["key"] for m in run["data"]["metrics"]}
        assert any(key.startswith("system/cpu_utilization") for key in metrics), sorted(metrics)
        inputs = run["inputs"]["dataset_inputs"]
        assert inputs and inputs[0]["dataset"]["name"].startswith("voxdiff-processed")

    import mlflow
    import torch

    # mlflow.set_tracking_uri also sets MLFLOW_TRACKING_URI in os.environ: monkeypatch restores it after
    # the test, so later tests (and their subprocesses) do not talk to this stopped server.
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    mlflow.set_tracking_uri(url)
    try:
        net = mlflow.pytorch.load_model(f"runs:/{run['info']['run_id']}/ema_model")
        meta = mlflow.models.get_model_info(f"runs:/{run['info']['run_id']}/ema_model").metadata
    finally:
        mlflow.set_tracking_uri("")  # and MLflow's in-process default back to its own
    assert meta["label_values"] == [0, 1, 2, 3] and meta["weights"] == "EMA"
    shape = meta["shape"]
    x = torch.zeros(1, 1 + meta["num_classes"], *shape)
    assert net(x, timesteps=torch.zeros(1, dtype=torch.long)).shape == (1, 1, *shape)
