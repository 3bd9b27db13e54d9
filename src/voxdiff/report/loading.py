"""Runs for `voxdiff compare`: read from an MLflow store, or from an archive of JSON files (one per run)."""

from __future__ import annotations

import dataclasses
import functools
import math
from pathlib import Path

import numpy as np

from voxdiff.analysis import convergence
from voxdiff.runtime.errors import VoxdiffError
from voxdiff.tracking.runs import METRIC_KEYS

TRAIN_KIND = "train"
ARCHIVE_FORMAT = "voxdiff-run/1"
CURVE_KEYS = ("val_loss", "samples_seen", "wall_time", "gns", "peak_memory_mb")
MARGINAL_KEYS = ("gns_marginal", "gns_marginal_lo", "gns_marginal_hi")  # the precise probe, with its interval
ADAM_KEYS = ("gns_marginal_adam", "gns_marginal_adam_lo", "gns_marginal_adam_hi")  # the same in Adam's coordinates
# Per-step metrics (tracking.runs.METRIC_KEYS, all but the val loss) that an archive keeps only at the
# steps of the other histories (thin_histories) once a run is longer than THIN_ABOVE_ROWS steps: a 16,384-
# step run's file would otherwise hold 16,384 rows of each (6-9 MB; thinned 2 MB); the study's archive:
# 64 -> 20 MB. The train loss and the noise scale stay whole (see thin_histories).
KEPT_WHOLE = ("train_loss", "gns")
THINNED = tuple(k for k in METRIC_KEYS if k not in KEPT_WHOLE + ("val_loss",))
THIN_ABOVE_ROWS = 512
SYSTEM_PREFIX = "system/"  # MLflow's system metrics count their own steps, not optimizer steps


@dataclasses.dataclass
class RunData:
    run_id: str
    params: dict[str, str]
    tags: dict[str, str]
    metrics: dict[str, float]  # latest value of every metric
    val_steps: np.ndarray
    val_loss: np.ndarray
    val_samples: np.ndarray    # samples seen at each validation
    val_wall: np.ndarray       # wall time (s) at each validation, NaN when not logged
    gns_samples: np.ndarray
    gns: np.ndarray
    peak_memory_mb: float
    start_time: int = 0        # ms since the epoch: runs are listed in start order (ties: run id)
    # noise scale per timestep bucket: "gns_t0" -> (samples seen, values) at each probe
    bucket_gns: dict = dataclasses.field(default_factory=dict)
    # the precise probe, marginal over timesteps: (steps, B_simple, interval lo, hi) at each probe; a bound
    # the probe could not resolve is NaN
    marginal_gns: tuple = (np.array([]),) * 4
    # the same probe in Adam's whitened coordinates (gns_marginal_adam), logged since it existed
    marginal_adam: tuple = (np.array([]),) * 4

    def val_loss_at(self, steps: np.ndarray) -> np.ndarray:
        """The val loss interpolated at optimizer steps (log-linear between validations; NaN outside them)."""
        if len(self.val_steps) == 0:
            return np.full(len(steps), np.nan)
        inside = (steps >= self.val_steps[0]) & (steps <= self.val_steps[-1])
        return np.where(inside, np.exp(np.interp(steps, self.val_steps, np.log(self.val_loss))), np.nan)

    @property
    def has_val(self) -> bool:
        return len(self.val_loss) > 0

    @functools.cached_property
    def plateau_change(self) -> float | None:
        """The val loss's relative change over the last quarter of the run's steps (convergence.plateau_change),
        worked out once for the runs table, the group summaries and the critical-batch section."""
        return convergence.plateau_change(self.val_steps, self.val_loss) if self.has_val else None

    @functools.cached_property
    def plateau_verdict(self) -> str | None:
        """convergence.plateau_verdict: at its plateau, still falling or past its best (never 'plateau' then)."""
        return convergence.judge_plateau(self.plateau_change, self.plateau_level, self.val_loss) if self.has_val else None

    @functools.cached_property
    def plateau_level(self) -> float | None:
        """The mean val loss over the last quarter of the run's steps (convergence.plateau_level), once."""
        return convergence.plateau_level(self.val_steps, self.val_loss) if self.has_val else None

    @property
    def final_val_loss(self) -> float:
        return self.metrics.get("final_val_loss", float(self.val_loss[-1]))

    def smoothed(self, window: int = 1) -> np.ndarray:
        """The val losses as a causal rolling mean of `window` validations (the first ones over those there
        are): what a run had shown by each validation, less its jitter. window 1: the validations themselves."""
        if window <= 1 or not self.has_val:
            return self.val_loss
        sums = np.cumsum(np.r_[0.0, self.val_loss])
        ends = np.arange(1, len(self.val_loss) + 1)
        starts = np.maximum(0, ends - window)
        return (sums[ends] - sums[starts]) / (ends - starts)

    def first_reaching(self, target: float, smooth: int = 1) -> int | None:
        """Index of the first validation at or below target (of the curve smoothed over `smooth` validations)."""
        hits = np.flatnonzero(self.smoothed(smooth) <= target)
        return int(hits[0]) if len(hits) else None

    def crossing(self, target: float, x: np.ndarray, smooth: int = 1) -> float | None:
        """Where (in x: steps, samples or seconds) the val curve (smoothed over `smooth` validations, causally)
        first reaches target, linearly interpolated between the two validations around the crossing: a
        sparser validation cadence would otherwise round the answer up to its next validation."""
        curve = self.smoothed(smooth)
        i = self.first_reaching(target, smooth)
        if i is None:
            return None
        if i == 0 or curve[i - 1] == curve[i] or math.isnan(x[i - 1]):
            return float(x[i])  # NaN when x is unknown there (e.g. no wall time logged)
        frac = (curve[i - 1] - target) / (curve[i - 1] - curve[i])
        return float(x[i - 1] + frac * (x[i] - x[i - 1]))


def open_client(tracking_uri: str):
    """An MlflowClient, refusing to create an empty SQLite database where none exists."""
    from voxdiff.tracking.uri import sqlite_path

    db = sqlite_path(tracking_uri)
    if db is not None:
        if not db.is_file():
            raise VoxdiffError(f"no MLflow database at {db} (tracking URI {tracking_uri}); "
                               "train first or pass --tracking-uri")
    from mlflow import MlflowClient  # slow import: only when needed

    return MlflowClient(tracking_uri)


def find_training_runs(client, experiment: str, filter_string: str | None, tracking_uri: str):
    """Finished training runs of the experiment, and a message about unfinished ones left out."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise VoxdiffError(f"MLflow experiment {experiment!r} not found at {tracking_uri}")
    query = f"tags.`voxdiff.kind` = '{TRAIN_KIND}'" + (f" and {filter_string}" if filter_string else "")
    runs, token = [], None
    try:
        while True:
            page = client.search_runs([exp.experiment_id], query, order_by=["attributes.start_time ASC"],
                                      page_token=token)
            runs.extend(page)
            token = page.token
            if not token:
                break
    except MlflowException as e:
        raise VoxdiffError(f"invalid --filter {filter_string!r}: {str(e).splitlines()[0]}") from None
    # A running or failed run has a partial curve: its "final" numbers would mislead.
    finished = [r for r in runs if r.info.status == "FINISHED"]
    unfinished = [f"{r.info.run_id[:8]} ({r.info.status})" for r in runs if r.info.status != "FINISHED"]
    if not finished:
        where = f" matching {filter_string!r}" if filter_string else ""
        raise VoxdiffError(f"no finished training runs in MLflow experiment {experiment!r}{where} "
                           f"at {tracking_uri}")
    note = (f"left out {len(unfinished)} unfinished run(s): {', '.join(unfinished)}" if unfinished else None)
    return exp, finished, note


def _history(client, run_id: str, key: str) -> dict[int, float]:
    by_step: dict[int, float] = {}
    for m in sorted(client.get_metric_history(run_id, key), key=lambda m: (m.step, m.timestamp)):
        by_step[m.step] = m.value  # the last value logged at a step wins (a resumed run re-logs it)
    return by_step


def _at_steps(curve: tuple[np.ndarray, np.ndarray], steps: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    xs, ys = curve
    return np.interp(steps, xs, ys) if len(xs) else fallback


def _curve(by_step: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    steps = sorted(by_step)
    return np.array(steps, float), np.array([by_step[s] for s in steps], float)


def run_data(run_id: str, params: dict, tags: dict, metrics: dict, histories: dict[str, dict[int, float]],
             start_time: int = 0) -> RunData:
    """RunData from a run's params, tags, latest metrics and per-step histories (whatever the source)."""
    hist = {k: _curve(histories.get(k, {})) for k in CURVE_KEYS}
    batch = as_float(params.get("effective_batch_size"))  # samples per step where samples_seen was not logged
    buckets = {}
    for key in sorted(k for k in histories if k.startswith("gns_t") and k[5:].isdigit()):
        b_steps, b_values = _curve(histories[key])
        buckets[key] = (_at_steps(hist["samples_seen"], b_steps, b_steps * batch), b_values)
    steps, val = hist["val_loss"]
    gns_steps, gns = hist["gns"]
    memory = hist["peak_memory_mb"][1]
    return RunData(
        run_id=run_id, params=dict(params), tags=dict(tags), metrics=dict(metrics),
        val_steps=steps, val_loss=val,
        val_samples=_at_steps(hist["samples_seen"], steps, steps * batch),
        val_wall=_at_steps(hist["wall_time"], steps, np.full(len(steps), np.nan)),
        gns_samples=_at_steps(hist["samples_seen"], gns_steps, gns_steps * batch), gns=gns,
        peak_memory_mb=float(memory.max()) if len(memory) else math.nan, start_time=int(start_time or 0),
        bucket_gns=buckets, marginal_gns=_probe(histories, MARGINAL_KEYS), marginal_adam=_probe(histories, ADAM_KEYS))


def _probe(histories: dict, keys: tuple) -> tuple:
    """(steps, value, lo, hi) of one probe's history; a bound it could not resolve is NaN."""
    steps, value = _curve(histories.get(keys[0], {}))
    bounds = [np.array([histories.get(k, {}).get(int(t), np.nan) for t in steps], float) for k in keys[1:]]
    return (steps, value, *bounds)


def load_run(client, run) -> RunData:
    rid, logged = run.info.run_id, run.data.metrics
    keys = [k for k in logged if k in CURVE_KEYS + MARGINAL_KEYS + ADAM_KEYS or (k.startswith("gns_t") and k[5:].isdigit())]
    histories = {k: _history(client, rid, k) for k in keys}
    return run_data(rid, run.data.params, run.data.tags, logged, histories, run.info.start_time)


# --- the archive: one JSON file per run, small text for git ------------------------------------------
def shareable_tags(tags: dict) -> dict:
    """voxdiff's own tags and the run name: MLflow's source/user tags name the machine and the user."""
    return {k: v for k, v in sorted(tags.items()) if k.startswith("voxdiff.") or k == "mlflow.runName"}


def thin_histories(histories: dict[str, list], max_rows: int | None = THIN_ABOVE_ROWS) -> dict[str, list]:
    """Archive rows ([step, samples, wall, value]) with each per-step metric of THINNED that has more than
    max_rows rows (None: never) kept only at the anchors, the steps at which anything that is not a
    per-step metric was logged (validations, probes) and step 0 (the summary's figures), and at its own
    first and last row. The reports read those metrics only there: samples and wall time at each
    validation and probe (so their interpolation stays exact; samples seen, linear in the step, also in
    between and from the first step on, where the noise scale is plotted), the peak memory's maximum (the
    summary logs it at step 0). Kept whole: the train loss, whose per-step values are single draws (one
    timestep each) that only a mean over every step of a stretch reads (is a run fitting its training
    set?), and the noise scale, which the reports plot; everything else is logged at anchors or is
    MLflow's system metrics (every 10 s, on their own step count)."""
    if max_rows is None:
        return histories
    per_step = set(THINNED + KEPT_WHOLE)
    anchors = {0} | {row[0] for key, rows in histories.items()
                     if key not in per_step and not key.startswith(SYSTEM_PREFIX) for row in rows}
    return {key: [row for i, row in enumerate(rows) if row[0] in anchors or i in (0, len(rows) - 1)]
            if key in THINNED and len(rows) > max_rows else rows for key, rows in histories.items()}


def export_record(client, run, experiment: str, max_rows: int | None = THIN_ABOVE_ROWS) -> dict:
    """One run as an archive record: params as dotted keys, tags, latest metrics, and every metric
    history as [step, samples_seen, wall_time, value] rows (samples_seen/wall_time at that step, or null),
    the per-step ones of a long run thinned (thin_histories)."""
    rid = run.info.run_id
    histories = {k: _history(client, rid, k) for k in sorted(run.data.metrics)}
    samples, wall = histories.get("samples_seen", {}), histories.get("wall_time", {})
    rows = {k: [[step, samples.get(step), wall.get(step), value] for step, value in sorted(h.items())]
            for k, h in histories.items()}
    return {
        "format": ARCHIVE_FORMAT, "run_id": rid, "run_name": run.info.run_name, "experiment": experiment,
        "status": run.info.status, "start_time": run.info.start_time, "params": dict(sorted(run.data.params.items())),
        "tags": shareable_tags(run.data.tags), "metrics": dict(sorted(run.data.metrics.items())),
        "histories": thin_histories(rows, max_rows),
        "thinned_above_rows": max_rows,  # per-step metrics thinned past it (None: every row kept)
    }


def import_record(client, experiment_id: str, record: dict, skip_prefixes: tuple[str, ...] = (SYSTEM_PREFIX,)) -> str:
    """Log an archived run (export_record) into a store as a finished run: its params, tags and every
    metric history at its own steps, each point timestamped start_time + wall_time (so MLflow's time axes
    read training time), plus the x-axis metrics of the MLflow comparison view (tracking/views.py) that
    archives written before it lack. Returns the new run's id. For screenshots and sharing a study; the
    archive stays the record (`voxdiff compare --runs` reads it directly)."""
    from mlflow.entities import Metric, Param

    from voxdiff.tracking.views import val_axis_metrics

    start = int(record.get("start_time") or 0)
    run = client.create_run(experiment_id, start_time=start or None, run_name=record.get("run_name"),
                            tags={k: str(v) for k, v in record["tags"].items()})
    rid = run.info.run_id
    params = [Param(k, str(v)) for k, v in record["params"].items()]
    for i in range(0, len(params), 100):
        client.log_batch(rid, params=params[i:i + 100])
    histories = {k: rows for k, rows in record["histories"].items() if not k.startswith(skip_prefixes)}
    points = []
    for key, rows in histories.items():
        points += [(key, step, wall, value) for step, _, wall, value in rows]
    if "val_samples_seen" not in histories:
        for step, samples, wall, value in histories.get("val_loss", []):
            extra = val_axis_metrics({"val_loss": value, "samples_seen": samples, "wall_time": wall})
            points += [(k, step, wall, v) for k, v in extra.items()]
    metrics = [Metric(k, float(v), start + int(1000 * (wall or 0)), int(step)) for k, step, wall, v in points
               if v is not None and math.isfinite(v)]
    for i in range(0, len(metrics), 1000):
        client.log_batch(rid, metrics=metrics[i:i + 1000])
    wall_end = max((w for _, _, w, _ in points if w is not None), default=0.0)
    client.set_terminated(rid, record.get("status", "FINISHED"), end_time=start + int(1000 * wall_end) or None)
    return rid


def record_to_run(record: dict) -> RunData:
    histories = {k: {int(row[0]): float(row[3]) for row in rows} for k, rows in record["histories"].items()}
    return run_data(record["run_id"], record["params"], record["tags"], record["metrics"], histories,
                    record.get("start_time", 0))


RUN_ID = "attributes.run_id"  # a filter key: the archived run's id (its value a set of ids)


def _matches(record: dict, filter_params: dict) -> bool:
    for key, want in filter_params.items():
        have = record["run_id"] if key == RUN_ID else record["params"].get(key)
        if (have not in want) if isinstance(want, frozenset) else (have != want):
            return False
    return True


def read_archive(folder: Path, filter_params: dict | None = None) -> tuple[list[RunData], str]:
    """Finished training runs from an archive folder (sorted by run id), and the experiment they name;
    `filter_params`: param -> value, and RUN_ID -> a set of run ids (compare.parse_param_filter)."""
    import json

    folder = Path(folder)
    files = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not files:
        raise VoxdiffError(f"{folder}: no archived runs (*.json); write them with `voxdiff export --out {folder}`")
    runs, experiments = [], set()
    for f in files:
        try:
            record = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise VoxdiffError(f"{f}: not a readable run archive ({type(e).__name__})") from None
        if not isinstance(record, dict) or record.get("format") != ARCHIVE_FORMAT:
            raise VoxdiffError(f"{f}: not a voxdiff run archive (format {ARCHIVE_FORMAT} expected)")
        if record["status"] != "FINISHED" or record["tags"].get("voxdiff.kind") != TRAIN_KIND:
            continue
        if filter_params and not _matches(record, filter_params):
            continue
        runs.append(record_to_run(record))
        experiments.add(record["experiment"])
    if not runs:
        raise VoxdiffError(f"{folder}: no finished training runs" + (" matching the filter" if filter_params else ""))
    return sorted(runs, key=lambda r: (r.start_time, r.run_id)), "/".join(sorted(experiments))


def archive_text(record: dict) -> str:
    """JSON with one line per key and per history row: diffs stay readable and files small."""
    import json

    dump = lambda v: json.dumps(v, separators=(", ", ": "))  # noqa: E731
    lines = ["{"]
    for i, (k, v) in enumerate(record.items()):
        end = "," if i < len(record) - 1 else ""
        if k == "histories":
            keys = list(v)
            lines.append('  "histories": {')
            for j, key in enumerate(keys):
                rows = ",\n".join(f"    {dump(r)}" for r in v[key])
                lines.append(f'   {dump(key)}: [\n{rows}\n   ]' + ("," if j < len(keys) - 1 else ""))
            lines.append("  }" + end)
        else:
            lines.append(f"  {dump(k)}: {dump(v)}{end}")
    return "\n".join(lines + ["}"]) + "\n"


def write_archive(client, experiment: str, filter_string: str | None, tracking_uri: str, folder: Path,
                  max_rows: int | None = THIN_ABOVE_ROWS) -> list[Path]:
    """Export every finished training run of the experiment to folder/<run id>.json (atomically)."""

    from voxdiff.runtime.fsutil import write_text

    _, runs, _ = find_training_runs(client, experiment, filter_string, tracking_uri)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for run in runs:
        path = folder / f"{run.info.run_id}.json"
        write_text(path, archive_text(export_record(client, run, experiment, max_rows)))
        written.append(path)
    return written


def as_float(s) -> float:
    try:
        return float(s)
    except (TypeError, ValueError):
        return math.nan
