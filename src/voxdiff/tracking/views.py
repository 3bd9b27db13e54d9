"""The MLflow UI's answer to the question: val loss against samples seen (and against training time) for
runs grouped by `train.accumulate_every`, as a saved view of the experiment's Runs page.

MLflow 3's Runs page, in chart mode, plots a metric against another logged metric (a line chart's
x-axis "Metric") and groups runs by a param (one line per group: the mean across its runs, with a
min-max band). Its saved views are experiment tags `mlflow.sharedViewState.<key>` holding the page state
as JSON in an envelope {name, createdAt, updatedAt, state} (MLflow 3.17's format, as its UI bundle reads
it; checked in headless Chromium, docs/ui_shot.py). The Runs page lists them in its *Views* menu (top
right; a view chosen there keeps the table mode, the chart button then shows its charts), and
`<ui>/#/experiments/<id>/runs?compareRunsMode=CHART&viewStateShareKey=<key>` opens one on its charts.
The UI fills whatever the state leaves out with its defaults, and adds its own chart for every other
metric, here in a folded section.

voxdiff writes two: `voxdiff-equal-samples` when a training starts (every finished training run,
grouped by train.accumulate_every), and `voxdiff-compare-<param>` from `voxdiff compare` (exactly the
runs it compared, re-runs left out, grouped by its --group-by): the report and the view then show the
same runs, the same groups and the same equal-samples axis.

Why `val_samples_seen` and `val_wall_time` (logged at the validation steps only, RunTracker.log_history)
rather than `samples_seen` and `wall_time` (logged at every step): with grouped runs and a metric
x-axis, MLflow 3.17 pairs the y metric's points with the x metric's by their rank among the distinct x
values of each (the aggregation drops the steps), which lines up only when both were logged at the same
steps; against `samples_seen` a val-loss curve of 24 points was drawn over the first 24 samples.
Ungrouped charts pair by step and are right either way.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import warnings

SHARED_VIEW_TAG = "mlflow.sharedViewState."
TRAINING_VIEW = "voxdiff-equal-samples"
SECTION = "voxdiff-equal-samples"
MAX_TAG_CHARS = 20000  # MLflow's limit on an experiment tag value
TRAIN_FILTER = "tags.`voxdiff.kind` = 'train' and attributes.status = 'FINISHED'"

# x-axis metrics of the view: logged with each validation, at its step (val_axis_metrics).
VAL_AXES = {"val_samples_seen": "samples_seen", "val_wall_time": "wall_time"}


def val_axis_metrics(record: dict) -> dict[str, float]:
    """The view's x-axis metrics for one step's record: samples seen and training wall time at the
    step's validation, {} on a step without one."""
    if record.get("val_loss") is None:
        return {}
    return {k: record[src] for k, src in VAL_AXES.items() if record.get(src) is not None}


def compare_key(group_by: str) -> str:
    return "voxdiff-compare-" + "".join(c if c.isalnum() else "-" for c in group_by)


def _line(uuid: str, metric: str, x_metric: str, title: str, smoothing: int = 0) -> dict:
    """A line chart of `metric` against the logged metric `x_metric` (MLflow's RunsChartsLineCardConfig)."""
    return {"uuid": uuid, "type": "LINE", "runsCountToCompare": 100, "metricSectionId": SECTION,
            "deleted": False, "isGenerated": False, "displayName": title, "metricKey": metric,
            "selectedMetricKeys": [metric], "lineSmoothness": smoothing, "xAxisScaleType": "linear",
            "scaleType": "linear", "range": {}, "xAxisKey": "metric", "selectedXAxisMetricKey": x_metric,
            "yAxisKey": "metric", "yAxisExpressions": [], "ignoreOutliers": False,
            "useGlobalXaxisKey": False, "useGlobalLineSmoothing": False}


def view_state(group_by: str = "train.accumulate_every", run_ids: list[str] | None = None,
               filter_string: str | None = None) -> dict:
    """The Runs page state of the comparison: training runs (exactly `run_ids` when given, else every
    finished one matching filter_string), grouped by the param `group_by` (mean line, min-max band),
    sorted by it, with three charts first (chart mode itself is the address's compareRunsMode, view_path):
    val loss against samples seen, val loss against training wall time, train loss against samples seen.
    MLflow's own per-metric charts follow, folded."""
    search = TRAIN_FILTER + (f" and {filter_string}" if filter_string else "")
    if run_ids:
        search += " and attributes.run_id IN (" + ", ".join(f"'{r}'" for r in run_ids) + ")"
    name = group_by.rpartition(".")[2]
    return {
        "searchFilter": search, "orderByKey": f"params.`{group_by}`", "orderByAsc": True,
        "startTime": "ALL", "lifecycleFilter": "Active",
        "compareRunCharts": [
            _line("voxdiff-val-samples", "val_loss", "val_samples_seen", f"val loss vs samples seen, by {name}"),
            # Seeds' validations fall at different times: a grouped curve alternates between them, smoothed.
            _line("voxdiff-val-wall", "val_loss", "val_wall_time", f"val loss vs training time (s), by {name}",
                  smoothing=60),
            _line("voxdiff-train-samples", "train_loss", "samples_seen", f"train loss vs samples seen, by {name}",
                  smoothing=90)],
        "compareRunSections": [
            {"uuid": SECTION, "name": f"{group_by} at equal samples (voxdiff)", "display": True,
             "isReordered": True, "columns": 3, "cardHeight": 400},
            {"uuid": "voxdiff-model-metrics", "name": "Model metrics", "display": False, "isReordered": False},
            {"uuid": "voxdiff-system-metrics", "name": "System metrics", "display": False, "isReordered": False}],
        "isAccordionReordered": True,
        "groupBy": {"aggregateFunction": "average", "groupByKeys": [{"mode": "param", "groupByData": group_by}]},
        "groupsExpanded": {}, "useGroupedValuesInCharts": True, "runsHiddenMode": "SHOW_ALL",
        "hideEmptyCharts": True, "viewMaximized": False, "runListHidden": False,
        "globalLineChartConfig": {"xAxisKey": "metric", "selectedXAxisMetricKey": "val_samples_seen",
                                  "lineSmoothness": 0},
    }


def envelope(name: str, state: dict, created_ms: int | None = None) -> str:
    now = int(time.time() * 1000)
    return json.dumps({"name": name, "createdAt": created_ms or now, "updatedAt": now,
                       "state": json.dumps(state, separators=(",", ":"))}, separators=(",", ":"))


def save_view(client, experiment_id: str, key: str, name: str, state: dict) -> str:
    """Write the saved view `key` (unless it already holds this state); returns the key. A state too
    long for a tag (a run list of some 500 runs) keeps its filter and loses the run list."""
    tag = SHARED_VIEW_TAG + key
    old = client.get_experiment(experiment_id).tags.get(tag)
    created = None
    if old:
        try:
            previous = json.loads(old)
            if json.loads(previous["state"]) == state and previous.get("name") == name:
                return key
            created = int(previous["createdAt"])
        except (ValueError, KeyError, TypeError):
            pass
    value = envelope(name, state, created)
    if len(value) > MAX_TAG_CHARS and " and attributes.run_id IN (" in state["searchFilter"]:
        state = {**state, "searchFilter": state["searchFilter"].split(" and attributes.run_id IN (")[0]}
        value = envelope(name, state, created)
    client.set_experiment_tag(experiment_id, tag, value)
    return key


def view_path(experiment_id: str, key: str) -> str:
    """The view's address below the UI's root (http://127.0.0.1:5000 for `mlflow ui`)."""
    query = urllib.parse.urlencode({"compareRunsMode": "CHART", "workflowType": "machine_learning",
                                    "viewStateShareKey": key})
    return f"/#/experiments/{experiment_id}/runs?{query}"


def publish_training_view(client, run_id: str) -> None:
    """The standing view of the run's experiment (every finished training run by train.accumulate_every);
    a failure only warns: the view is a convenience, training must not depend on it."""
    try:
        experiment_id = client.get_run(run_id).info.experiment_id
        save_view(client, experiment_id, TRAINING_VIEW, "accumulate_every at equal samples (voxdiff)",
                  view_state("train.accumulate_every"))
    except Exception as e:  # noqa: BLE001 - any store problem
        warnings.warn(f"MLflow: could not save the comparison view ({type(e).__name__}: {str(e)[:160]})",
                      stacklevel=2)
