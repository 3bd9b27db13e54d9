"""MLflow: one run per training, resumed with the training, logged at checkpoints.

Metrics are buffered in memory and sent in batches when a checkpoint is written, in the training's own
thread (milliseconds per checkpoint with a reachable store), so every logged step is covered by a
checkpoint: a resumed run never logs a step twice. An MLflow failure after the start never stops the
training: what did not go through stays pending and is sent, with backoff, at the following checkpoints
and when the run ends (`finish`, which waits a little for the store), and a finished checkpoint that is
run again catches up what is still missing. We use MlflowClient with explicit run ids (no global active
run, which is safe under DVC's queue workers); only `log_model` needs MLflow's active run, briefly.
"""

from __future__ import annotations

import math
import os
import subprocess
import time
import warnings
from pathlib import Path
from typing import Callable

from voxdiff import __version__
from voxdiff.runtime.errors import VoxdiffError, echo
from voxdiff.params import Params
from voxdiff.tracking.uri import local_artifacts_dir, resolve_tracking_uri, sqlite_path
from voxdiff.tracking.views import val_axis_metrics

# An unreachable server should fail the start-up check in seconds, not after MLflow's default
# minutes of retries; users can still override both. Mid-run, RunTracker retries on its own schedule.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

METRIC_KEYS = ("train_loss", "val_loss", "grad_norm", "lr", "samples_seen", "wall_time", "samples_per_s",
               "peak_memory_mb", "gns", "gns_grad_sq", "gns_trace", "ema_halflife")


def is_probe_key(key: str) -> bool:
    """The noise-scale probe's history keys: gns_t<bucket>... and gns_marginal...; the digit keeps
    METRIC_KEYS' gns_trace out (a bare `gns_t` prefix matched it, and it was sent twice each step)."""
    return key.startswith("gns_marginal") or (key.startswith("gns_t") and key[5:6].isdigit())

# MLflow error codes that the same request will get again (a rejected value, a deleted run): retrying
# them would block everything queued behind. A SQLite store's OperationalError (locked, disk full)
# arrives as TEMPORARILY_UNAVAILABLE and a lost connection as INTERNAL_ERROR: both are retried.
REFUSED = frozenset({"BAD_REQUEST", "INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "INVALID_STATE",
                     "RESOURCE_ALREADY_EXISTS"})

# The order pending items are sent in: the run's end last, the metrics before the summary that ends them.
ORDER = ("params", "dataset", "metrics", "summary", "files", "model", "end")


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def _refused(e: BaseException) -> bool:
    return getattr(e, "error_code", None) in REFUSED


def ensure_experiment(uri: str, name: str, root: Path) -> str:
    """Create the store's schema and the experiment (absolute artifact location) if missing.

    Done once, up front and under a file lock for a SQLite store: parallel queue workers facing a
    missing database otherwise race on creating its tables ("table ... already exists"), and an
    experiment first created inside a queue temp dir would point its artifacts at a directory DVC deletes.
    """
    db = sqlite_path(uri)
    if db is not None:
        from filelock import FileLock

        if not db.parent.is_dir():
            raise VoxdiffError(f"MLflow tracking store {uri}: directory {db.parent} does not exist")
        with FileLock(str(db) + ".lock", timeout=120):
            return _ensure_experiment(uri, name)
    return _ensure_experiment(uri, name)


def _ensure_experiment(uri: str, name: str) -> str:
    try:
        client = _client(uri)
        exp = client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        # A SQLite store's artifacts beside its database, absolute (tracking.uri.local_artifacts_dir)
        artifacts = local_artifacts_dir(uri).as_uri() if sqlite_path(uri) is not None else None
        try:
            return client.create_experiment(name, artifact_location=artifacts)
        except Exception:
            exp = client.get_experiment_by_name(name)  # another worker created it first
            if exp is None:
                raise
            return exp.experiment_id
    except VoxdiffError:
        raise
    except Exception as e:
        raise VoxdiffError(f"MLflow tracking store {uri} is not usable: {_first_line(e)}") from None


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


class RunTracker:
    """The MLflow run of one training (rank 0 only).

    After start, an MLflow failure is per call: the training goes on, one warning line names what is
    not logged yet (at most one every `warn_every_s` while the store stays away), and it is sent again
    at the next logging call once a backoff (`retry_first_s`, doubling to `retry_max_s`) has passed:
    metrics of every step since `logged_through`, params and dataset of a partial start, the summary,
    the model. `finish(status)` sends what is left and ends the run, retrying for up to `end_wait_s`.
    A value MLflow refuses outright (REFUSED) is dropped with a warning instead of retried.
    """

    retry_first_s = 2.0
    retry_max_s = 120.0
    warn_every_s = 300.0
    end_wait_s = 30.0        # finish("FINISHED"): a finished training waits this long for the store
    end_wait_failed_s = 10.0  # any other ending: a dying process should not linger

    def __init__(self, uri: str, run_id: str, retrying: bool = True):
        self.uri, self.run_id = uri, run_id
        self.client = _client(uri)
        self.logged_through = 0  # last optimizer step whose metrics MLflow has
        self.retrying = retrying  # False: a failed call is dropped with its warning (evaluate's tracker)
        self.lost: list[str] = []  # what was dropped for good (refused, or not retrying)
        self._history: list[dict] = []
        self._pending: dict[str, tuple[str, Callable[[], None]]] = {}
        self._delay = 0.0
        self._next_try = 0.0
        self._failing_since: float | None = None
        self._last_warn = -math.inf
        self._no_wait = False  # a Ctrl-C cut a wait short: later endings try once, without waiting
        self._sent = False  # anything sent by this tracker (a reopened, complete run is left untouched)
        self.ended: str | None = None  # the status MLflow has from finish()
        self._present: dict | None = None  # what a reopened or resumed run already had

    @property
    def failed(self) -> bool:
        """Something MLflow should have is not there (yet): pending, or dropped."""
        return bool(self.lost) or bool(self._describe())

    # --- start / resume / reopen ------------------------------------------------------------------
    @classmethod
    def start(cls, params: Params, root: Path, *, resume_run_id: str, tags: dict, extra_params: dict) -> "RunTracker":
        uri = resolve_tracking_uri(params, root)
        exp_id = ensure_experiment(uri, params.mlflow.experiment, root)
        client = _client(uri)
        flat = {**params.flat(), **extra_params}
        if resume_run_id:
            try:
                run = client.get_run(resume_run_id)
                if run.info.experiment_id == exp_id and run.info.lifecycle_stage == "active":
                    tracker = cls(uri, resume_run_id)
                    tracker._adopt(run, datasets_only=True)
                    client.set_terminated(resume_run_id, status="RUNNING")
                    missing = {k: v for k, v in flat.items() if k not in run.data.params}
                    if missing:  # the start of the interrupted process did not get them all through
                        tracker._queue("params", "params", lambda: tracker._log_params(missing))
                    return tracker
            except Exception as e:
                if not _refused(e):  # a store that fails now must not fork a second run of this training
                    raise VoxdiffError(f"MLflow tracking store {uri}: could not reopen run {resume_run_id} "
                                       f"({_first_line(e)})") from None
                # the run is gone (deleted, other store): start a new one
        exp_name = os.environ.get("DVC_EXP_NAME", "")
        name = exp_name or f"k{params.train.accumulate_every}-b{params.train.batch_size}-seed{params.seed}"
        all_tags = {
            "voxdiff.kind": "train", "voxdiff.version": __version__,
            "voxdiff.dvc_exp_name": exp_name,
            "voxdiff.dvc_baseline_rev": os.environ.get("DVC_EXP_BASELINE_REV", ""),
            "voxdiff.git_commit": git_commit(root), **tags,
        }
        try:
            # Tag values must be strings over the REST API (a SQLite store would take ints).
            run = client.create_run(exp_id, run_name=name, tags={k: str(v) for k, v in all_tags.items()})
        except Exception as e:
            raise VoxdiffError(f"MLflow tracking store {uri}: could not create a run ({_first_line(e)})") from None
        tracker = cls(uri, run.info.run_id)
        # The run exists now: params that fail are retried like everything else, not a reason to stop.
        tracker._queue("params", "params", lambda: tracker._log_params(flat))
        return tracker

    @classmethod
    def reopen(cls, params: Params, root: Path, run_id: str) -> "RunTracker | None":
        """A finished training's run, to catch up what an MLflow outage kept from it (steps, summary,
        model, its end); log_* and finish then send only what it lacks. None when there is no run id,
        the run is gone, or the store cannot be reached now (with a warning)."""
        if not run_id:
            return None
        uri = resolve_tracking_uri(params, root)
        if (db := sqlite_path(uri)) is not None and not db.is_file():
            return None  # opening a SQLite store creates it: no store, no run to complete
        try:
            tracker = cls(uri, run_id)
            run = tracker.client.get_run(run_id)
            if run.info.lifecycle_stage != "active":
                return None
            tracker._adopt(run)
            return tracker
        except Exception as e:
            if getattr(e, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                warnings.warn(f"MLflow run {run_id} not checked at {uri} ({_first_line(e)}); if an outage cut it "
                              "short, running `voxdiff train` again once the store is back completes it", stacklevel=2)
            return None

    def _adopt(self, run, datasets_only: bool = False) -> None:
        """Take over what `run` has: its last logged step, and (reopen) its summary, model and status."""
        history = self.client.get_metric_history(self.run_id, "samples_seen")  # finite at every step
        self.logged_through = max((m.step for m in history), default=0)
        outputs = getattr(run, "outputs", None)
        datasets = {d.dataset.digest for d in run.inputs.dataset_inputs} if run.inputs else set()
        # A resumed training logs its own summary and model later: only its dataset may be there already.
        self._present = {"status": "RUNNING", "metrics": {}, "tags": {}, "model": False, "datasets": datasets} \
            if datasets_only else {
            "status": run.info.status, "metrics": dict(run.data.metrics), "tags": dict(run.data.tags),
            "model": bool(outputs and outputs.model_outputs), "datasets": datasets}

    def _log_params(self, flat: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    # --- pending items, retries -------------------------------------------------------------------
    def _queue(self, name: str, what: str, send: Callable[[], None]) -> None:
        self._pending[name] = (what, send)
        self._flush()

    def _metrics_pending(self) -> bool:
        return bool(self._history) and self._history[-1]["step"] > self.logged_through

    def _items(self):
        for name in ORDER:
            if name == "metrics":
                if self._metrics_pending():
                    yield name, f"metrics of steps {self.logged_through + 1}-{self._history[-1]['step']}", \
                        self._send_metrics
            elif name in self._pending:
                yield (name, *self._pending[name])

    def _describe(self) -> str:
        return ", ".join(what for _, what, _ in self._items())

    def _flush(self, force: bool = False) -> bool:
        """Send what is pending, in ORDER; True when nothing is left. Inside a backoff only when forced."""
        if not self._describe():
            return True
        if not force and time.monotonic() < self._next_try:
            return False
        for name, what, send in list(self._items()):
            try:
                send()
            except Exception as e:
                if self.retrying and not _refused(e):
                    self._backoff(e)
                    return False  # the store is away: the items behind this one would fail the same way
                self._drop(name, what, e)
                continue
            self._sent = True
            self._pending.pop(name, None)
        if self._failing_since is not None:
            away = time.monotonic() - self._failing_since
            echo(f"[voxdiff] MLflow at {self.uri} reachable again after {away:.0f} s: what it missed is logged now")
        self._failing_since, self._delay, self._next_try = None, 0.0, 0.0
        return True

    def _backoff(self, e: Exception) -> None:
        now = time.monotonic()
        self._delay = min(self.retry_max_s, 2 * self._delay if self._delay else self.retry_first_s)
        self._next_try = now + self._delay
        new_outage = self._failing_since is None
        if new_outage:
            self._failing_since = now
        if new_outage or now - self._last_warn >= self.warn_every_s:  # not one line per checkpoint
            self._last_warn = now
            warnings.warn(f"MLflow at {self.uri} failed ({_first_line(e)}): {self._describe()} not logged yet, "
                          f"retried from the next checkpoint on (backoff {self._delay:.0f} s) and when the run ends; "
                          "training continues and the DVC metrics files stay complete", stacklevel=4)

    def _drop(self, name: str, what: str, e: Exception) -> None:
        self.lost.append(what)
        if name == "metrics":
            self.logged_through = self._history[-1]["step"]
        else:
            self._pending.pop(name, None)
        why = "refused it" if _refused(e) else "failed"
        warnings.warn(f"MLflow at {self.uri} {why} ({_first_line(e)}): {what} not logged" +
                      ("; training continues and the DVC metrics files stay complete" if self.retrying else ""),
                      stacklevel=4)

    # --- during training --------------------------------------------------------------------------
    def log_history(self, history: list[dict]) -> None:
        """Send the steps of `history` that MLflow does not have yet (call right after a checkpoint),
        with whatever else is pending."""
        self._history = history
        self._flush()

    def resend_from(self, step: int) -> None:
        """Send the records of `step` on again at the next logging call: a record completed after it was
        logged (the validation and probe a stop left to the resumed run). MLflow's store keeps one copy of
        a metric point sent twice with the same value, step and time."""
        self.logged_through = min(self.logged_through, step - 1)

    def _send_metrics(self) -> None:
        from mlflow.entities import Metric

        batch, last = [], self.logged_through
        for h in self._history:
            if h["step"] <= self.logged_through:
                continue
            ts = int(1000 * h.get("timestamp", 0)) or 0  # the record's time: a resend is the same point
            metrics = [Metric(key, float(h[key]), ts, int(h["step"]))
                       for key in METRIC_KEYS + tuple(k for k in h if is_probe_key(k))
                       if h.get(key) is not None and math.isfinite(h[key])]
            metrics += [Metric(k, float(v), ts, int(h["step"])) for k, v in val_axis_metrics(h).items()]  # views.py
            if batch and len(batch) + len(metrics) > 1000:  # MLflow accepts at most 1000 metrics per batch
                self.client.log_batch(self.run_id, metrics=batch)
                self.logged_through, batch = last, []  # whole steps per batch: progress survives a failure
            batch += metrics
            last = h["step"]
        if batch:
            self.client.log_batch(self.run_id, metrics=batch)
        self.logged_through = last

    def log_summary(self, values: dict, artifacts: list[Path] = (), tags: dict | None = None) -> None:
        """End figures (at step 0) and tags in one batch, then the files; a reopened run gets only what
        it lacks. Two items: an artifact store that fails must not hold back the figures."""
        from mlflow.entities import Metric, RunTag

        ts = int(time.time() * 1000)  # fixed now: a resend after a failure is the same point
        metrics = [Metric(k, float(v), ts, 0) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        tags = {k: str(v) for k, v in (tags or {}).items()}
        files = [str(p) for p in artifacts if Path(p).is_file()]
        resend = self._present is None or not self._has_summary(metrics, tags)
        if resend:
            self._queue("summary", "the summary", lambda: self.client.log_batch(
                self.run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()]))
        if files and not resend:  # a changed summary rewrites its files too (same names: overwritten)
            files = [f for f in files if Path(f).name not in self._artifact_names()]
        if files:
            self._queue("files", "the summary files", lambda: [self.client.log_artifact(self.run_id, f) for f in files])

    def _has_summary(self, metrics: list, tags: dict) -> bool:
        """The reopened run has this summary already. The batch is one request, so a run with its tags has
        all of it, unless a value differs (a finished run re-validated on other draws: its figures change
        under the same tags); keys a later voxdiff adds to the summary do not make an old complete run
        incomplete."""
        have_m, have_t = self._present["metrics"], self._present["tags"]
        if not tags:
            return {m.key for m in metrics} <= set(have_m)
        return all(have_t.get(k) == v for k, v in tags.items()) and all(
            math.isclose(have_m[m.key], m.value, rel_tol=1e-9) for m in metrics if m.key in have_m)

    def _artifact_names(self) -> set[str]:
        try:
            return {Path(a.path).name for a in self.client.list_artifacts(self.run_id)}
        except Exception:
            return set()  # not known now: send them (a resend overwrites with the same files)

    def log_dataset(self, name: str, digest: str, source: dict, context: str = "training") -> None:
        """Record the processed data as the run's input (MLflow datasets): `digest` is the cache's
        fingerprint, so runs on identical data show the same dataset; `source` names where it came from."""
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        if self._present is not None and digest[:36] in self._present["datasets"]:
            return

        def send():
            dataset = MetaDataset(CodeDatasetSource({k: str(v) for k, v in source.items()}), name=name,
                                  digest=digest[:36])
            self.client.log_inputs(self.run_id, datasets=[DatasetInput(
                dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])

        self._queue("dataset", "the dataset", send)

    def start_system_metrics(self, interval_s: float = 10.0):
        """MLflow's system metrics (CPU, memory, disk, network; GPU when pynvml finds one) sampled every
        interval_s in a background thread into this run; returns the monitor (None if it cannot start)."""
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        try:
            monitor = SystemMetricsMonitor(self.run_id, sampling_interval=interval_s, resume_logging=True,
                                           tracking_uri=self.uri)
            monitor.start()
            return monitor
        except Exception as e:
            warnings.warn(f"MLflow system metrics not started ({type(e).__name__}: {str(e)[:120]})", stacklevel=2)
            return None

    def log_model(self, net, metadata: dict, name: str = "ema_model") -> None:
        """The EMA network as an MLflow PyTorch model (mlflow.pytorch.load_model loads it back), with
        what a user needs to run it in its metadata: label values, preprocessing, diffusion settings.
        What is pickled is a CPU copy of plain MONAI/torch modules (model.portable_network): the
        requirements below are all it needs, voxdiff included nowhere."""
        import einops
        import mlflow
        import monai
        import torch

        from voxdiff.diffusion.model import portable_network

        if self._present is not None and self._present["model"]:
            return
        net = portable_network(net)  # now: the caller's network goes on training after this call

        def send():
            mlflow.set_tracking_uri(self.uri)
            # The active run gives the logged model its experiment; leaving the block ends the run
            # (FINISHED), which finish() then sets to its own status.
            with mlflow.start_run(run_id=self.run_id):
                # Explicit requirements: MLflow would otherwise infer them by importing the model (slow).
                # Pickle, not MLflow 3's default 'pt2' (a traced export that needs an input example
                # and would fix the grid): the network takes any grid its levels divide.
                # einops: MONAI's attention blocks hold its Rearrange layer, and MONAI does not require it.
                mlflow.pytorch.log_model(net, name=name, metadata=metadata, serialization_format="pickle",
                                         pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                                           f"monai=={monai.__version__}",
                                                           f"einops=={einops.__version__}"])

        self._queue("model", "the EMA model", send)

    # --- the end ----------------------------------------------------------------------------------
    @staticmethod
    def status_for(exc: BaseException | None) -> str:
        """The MLflow status for a training that ends with `exc`: a signal or Ctrl-C (KeyboardInterrupt,
        SystemExit) KILLED, any other exception (divergence, OOM, ENOSPC, a CUDA error) FAILED."""
        if exc is None:
            return "FINISHED"
        return "KILLED" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else "FAILED"

    def finish(self, status: str = "FINISHED", wait_s: float | None = None) -> bool:
        """Send everything still pending and end the run with `status`, retrying with backoff for up to
        wait_s (default end_wait_s for FINISHED, end_wait_failed_s otherwise); never raises, except that a
        Ctrl-C during the wait stops it. True when MLflow has it all. Once an ending reached MLflow,
        later calls do nothing, so every `except`/`finally` on the way out may call it."""
        if self.ended:
            return True
        if self._present is not None and self._present["status"] == status and not self._sent \
                and not self._describe():
            self.ended = status  # a reopened run that lacked nothing: keep its end time
            return True

        def end():
            self.client.set_terminated(self.run_id, status=status)
            self.ended = status

        self._pending["end"] = (f"the run's end ({status})", end)
        wait = wait_s if wait_s is not None else (self.end_wait_s if status == "FINISHED" else self.end_wait_failed_s)
        try:
            if self._flush(force=True) or self._wait(wait):
                return True
            if "end" in self._pending:  # whatever holds the rest back must not leave the run RUNNING
                try:
                    self._pending["end"][1]()
                    self._pending.pop("end")
                except Exception:
                    pass
        except KeyboardInterrupt:  # the user does not want to wait: later endings try once, at once
            self._no_wait = True
            raise
        if self.retrying:
            warnings.warn(f"MLflow run {self.run_id} at {self.uri} is incomplete: {self._describe()} not logged "
                          f"after {wait:.0f} s of retries; running `voxdiff train` again once the store is back "
                          "completes it (from a finished checkpoint it trains nothing)", stacklevel=2)
        return False

    def _wait(self, wait_s: float) -> bool:
        if self._no_wait or wait_s <= 0 or not self.retrying:
            return False
        echo(f"[voxdiff] waiting up to {wait_s:.0f} s for MLflow at {self.uri} to log {self._describe()} "
             "(Ctrl-C stops waiting)")
        deadline, delay = time.monotonic() + wait_s, 1.0
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(delay, left))
            delay = min(2 * delay, 8.0)
            if self._flush(force=True):
                return True
        return False


def open_existing(params: Params, root: Path, run_id: str) -> RunTracker | None:
    """The training's run, for evaluate to log into; None (with a warning) when it cannot be reached.
    Its calls are not retried: a failure warns and what it carried is dropped."""
    if not run_id:
        return None
    uri = resolve_tracking_uri(params, root)
    try:
        tracker = RunTracker(uri, run_id, retrying=False)
        tracker.client.get_run(run_id)
        return tracker
    except Exception as e:
        warnings.warn(f"MLflow run {run_id} not reachable at {uri} ({type(e).__name__}); evaluation is not logged there")
        return None


def end_with_batch(client, run_id: str, files, **batch) -> str:
    """Log one batch (metrics, params, tags: MlflowClient.log_batch's keywords) and the files as artifacts to an open
    run, then end it: FINISHED, or FAILED when either fails (the error is raised). The run of `voxdiff compare`
    and of `voxdiff advise`. Returns run_id."""
    try:
        client.log_batch(run_id, **batch)
        for f in files:
            client.log_artifact(run_id, str(f))
    except Exception:
        client.set_terminated(run_id, "FAILED")
        raise
    client.set_terminated(run_id, "FINISHED")
    return run_id
