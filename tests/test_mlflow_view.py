"""The MLflow UI's comparison (tracking/views.py): the view's x-axis metrics logged with each validation,
the saved view a training publishes and the one `voxdiff compare` saves for exactly the runs it compared,
and the archive import that `make ui-shot` builds its store with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow import MlflowClient

from conftest import make_params
from voxdiff.report.compare import compare_runs
from voxdiff.report.loading import import_record, read_archive
from voxdiff.tracking import views

FIXTURE = Path(__file__).parent / "fixtures" / "archive" / "runs"


def saved_state(client, experiment_id: str, key: str) -> tuple[str, dict]:
    envelope = json.loads(client.get_experiment(experiment_id).tags[views.SHARED_VIEW_TAG + key])
    assert isinstance(envelope["createdAt"], int) and isinstance(envelope["state"], str)  # the UI's envelope
    return envelope["name"], json.loads(envelope["state"])


def chart_axes(state: dict) -> list[tuple[str, str, str]]:
    return [(c["metricKey"], c["xAxisKey"], c["selectedXAxisMetricKey"]) for c in state["compareRunCharts"]]


def history(client, run_id: str, key: str) -> dict[int, float]:
    return {m.step: m.value for m in client.get_metric_history(run_id, key)}


def test_val_axis_metrics_only_on_validation_steps():
    assert views.val_axis_metrics({"val_loss": None, "samples_seen": 4, "wall_time": 1.0}) == {}
    assert views.val_axis_metrics({"val_loss": 0.3, "samples_seen": 8, "wall_time": 2.5}) == {
        "val_samples_seen": 8, "val_wall_time": 2.5}


def test_training_logs_the_view_axes_and_publishes_the_view(tiny_root):
    """val_samples_seen / val_wall_time at exactly the val_loss steps (what MLflow's grouped charts need),
    and the experiment's standing view, whose filter finds the run."""
    from voxdiff.pipeline.train import run_training

    summary = run_training(make_params({"train.batch_size": 1, "train.accumulate_every": 2,
                                        "mlflow.system_metrics": False}), tiny_root, progress=False)
    client = MlflowClient(f"sqlite:///{tiny_root / 'mlflow.db'}")
    rid = summary["mlflow_run_id"]
    val, samples, wall = (history(client, rid, k) for k in ("val_loss", "samples_seen", "wall_time"))
    assert sorted(history(client, rid, "val_samples_seen")) == sorted(val) and len(val) == 4
    assert history(client, rid, "val_samples_seen") == {s: samples[s] for s in val}
    assert history(client, rid, "val_wall_time") == pytest.approx({s: wall[s] for s in val})
    exp_id = client.get_run(rid).info.experiment_id
    name, state = saved_state(client, exp_id, views.TRAINING_VIEW)
    assert "accumulate_every" in name
    assert state["groupBy"]["groupByKeys"] == [{"mode": "param", "groupByData": "train.accumulate_every"}]
    assert chart_axes(state)[:2] == [("val_loss", "metric", "val_samples_seen"), ("val_loss", "metric", "val_wall_time")]
    assert [r.info.run_id for r in client.search_runs([exp_id], state["searchFilter"])] == [rid]
    # The DVC metrics keep a few figures, the detail every field (tracking/dvc_metrics.py).
    compact = json.loads((tiny_root / "metrics" / "train.json").read_text())
    detail = json.loads((tiny_root / "metrics" / "train_detail.json").read_text())
    assert set(detail) == set(summary) and detail["mlflow_run_id"] == rid
    assert set(compact) == {"val_loss", "plateau", "samples", "samples/s"}
    assert compact["val_loss"] == detail["final_val_loss"] and compact["samples"] == detail["total_samples"] == 8
    # ... and evaluate's DVC link to the trained model, a short prefix of the checkpoint's sha256.
    link = json.loads((tiny_root / "metrics" / "checkpoint.json").read_text())["checkpoint"]
    assert len(link) == 10 and detail["checkpoint_sha256"].startswith(link)


@pytest.fixture
def imported(tmp_path):
    """The committed archive fixture imported into a fresh SQLite store, as `make ui-shot` does."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp_id = client.create_experiment("fixture", artifact_location=(tmp_path / "art").as_uri())
    ids = {}
    for f in sorted(FIXTURE.glob("*.json")):
        record = json.loads(f.read_text())
        ids[record["run_id"]] = import_record(client, exp_id, record)
    return uri, client, exp_id, ids


def test_import_keeps_every_history_at_its_steps(imported):
    uri, client, exp_id, ids = imported
    for f in sorted(FIXTURE.glob("*.json")):
        record = json.loads(f.read_text())
        new = ids[record["run_id"]]
        run = client.get_run(new)
        assert run.info.status == "FINISHED" and run.data.params == record["params"]
        assert {k: run.data.tags[k] for k in record["tags"]} == record["tags"]
        for key in ("val_loss", "train_loss", "samples_seen"):
            assert history(client, new, key) == {row[0]: row[3] for row in record["histories"][key]}
        rows = record["histories"]["val_loss"]
        assert history(client, new, "val_samples_seen") == {step: samples for step, samples, _, _ in rows}
        stamps = {m.step: m.timestamp for m in client.get_metric_history(new, "val_loss")}
        assert stamps == {step: record["start_time"] + int(1000 * wall) for step, _, wall, _ in rows}


def test_compare_saves_the_view_of_exactly_its_runs_grouped_the_same_way(imported, tmp_path):
    """voxdiff compare and the MLflow view agree: the view's filter finds the runs the report compared,
    the view groups by the same param and plots against samples seen; the report from the imported
    store is the report from the archive."""
    uri, client, exp_id, ids = imported
    result = compare_runs(uri, "fixture", tmp_path / "store" / "compare.md")
    key = views.compare_key("train.accumulate_every")
    assert result.view_url == "http://127.0.0.1:5000" + views.view_path(exp_id, key)
    assert result.view_server.endswith(f"mlflow ui --backend-store-uri {uri}")
    _, state = saved_state(client, exp_id, key)
    compared = {rid for g in result.groups for rid in g.run_ids}
    assert len(compared) == 9
    assert {r.info.run_id for r in client.search_runs([exp_id], state["searchFilter"])} == compared
    assert state["groupBy"]["groupByKeys"] == [{"mode": "param", "groupByData": result.group_by}]
    groups = {client.get_run(r).data.params[result.group_by] for r in compared}
    assert groups == {g.key.split("=")[-1] for g in result.groups}
    assert ("val_loss", "metric", "val_samples_seen") in chart_axes(state)
    archived = compare_runs(None, None, tmp_path / "archive" / "compare.md", runs_dir=FIXTURE, log=False)
    text = archived.report_path.read_text()
    for old, new in ids.items():  # the imported runs have new ids
        text = text.replace(old, new)
    body = lambda t: [line for line in t.splitlines() if not line.startswith("Source: ")]  # noqa: E731
    assert body(result.report_path.read_text()) == body(text)
    # Saved again unchanged: the tag is left as it is (created time kept).
    before = client.get_experiment(exp_id).tags[views.SHARED_VIEW_TAG + key]
    views.save_view(client, exp_id, key, "voxdiff compare: train.accumulate_every", state)
    assert client.get_experiment(exp_id).tags[views.SHARED_VIEW_TAG + key] == before


def test_a_run_list_too_long_for_a_tag_keeps_the_filter(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp_id = client.create_experiment("many")
    state = views.view_state("seed", [f"{i:032x}" for i in range(700)], "params.`train.batch_size` = '1'")
    views.save_view(client, exp_id, "k", "many", state)
    _, saved = saved_state(client, exp_id, "k")
    assert saved["searchFilter"] == views.TRAIN_FILTER + " and params.`train.batch_size` = '1'"
    assert len(client.get_experiment(exp_id).tags[views.SHARED_VIEW_TAG + "k"]) <= views.MAX_TAG_CHARS


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs Debian's chromium (make ui-shot installs it)")
def test_ui_shot_renders_the_grouped_view_in_a_real_browser(tmp_path):
    """make ui-shot end to end on the archive fixture: a real `mlflow server`, headless Chromium, a PNG
    with one val-loss curve per group and chart."""
    import subprocess
    import sys

    import matplotlib.image

    out = tmp_path / "shot.png"
    res = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "docs" / "ui_shot.py"), "--runs", str(FIXTURE),
                          "--filter", "", "--experiment", "fixture", "--out", str(out), "--size", "1400x900"],
                         capture_output=True, text=True, timeout=480)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "3 groups of train.accumulate_every" in res.stdout
    assert matplotlib.image.imread(out).shape[:2] == (900, 1400)
    assert len(read_archive(FIXTURE)[0]) == 9
