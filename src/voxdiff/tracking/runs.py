"""MLflow: one run per training, resumed with the training, logged off the hot path.

Metrics are buffered in memory and sent in batches when a checkpoint is written, so every logged
step is covered by a checkpoint: a resumed run never logs a step twice. We use MlflowClient with
explicit run ids (no global active run), which is safe under DVC's queue workers.
"""

from __future__ import annotations

import math
import os
import subprocess
import warnings
from pathlib import Path

from voxdiff import __version__
from voxdiff.errors import VoxdiffError
from voxdiff.params import Params
from voxdiff.tracking.uri import resolve_tracking_uri

# An unreachable server should fail the start-up check in seconds, not after MLflow's default
# minutes of retries; users can still override both.
os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")

METRIC_KEYS = ("train_loss", "val_loss", "grad_norm", "lr", "samples_seen", "wall_time", "samples_per_s",
               "peak_memory_mb", "gns", "gns_grad_sq", "gns_trace", "ema_halflife")


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def ensure_experiment(uri: str, name: str, root: Path) -> str:
    """Create the store's schema and the experiment (absolute artifact location) if missing.

    Done once, up front and under a file lock for a SQLite store: parallel queue workers facing a
    missing database otherwise race on creating its tables ("table ... already exists"), and an
    experiment first created inside a queue temp dir would point its artifacts at a directory DVC deletes.
    """
    if uri.startswith("sqlite:///"):
        from filelock import FileLock

        db = Path(uri[len("sqlite:///"):])
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
        artifacts = None
        if uri.startswith("sqlite:///"):
            artifacts = (Path(uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
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
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VoxdiffError(f"MLflow tracking store {uri} is not usable: {first[:200]}") from None


def git_commit(root: Path) -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


class RunTracker:
    """The MLflow run of one training (rank 0 only). Failures after start only warn."""

    def __init__(self, uri: str, run_id: str):
        self.uri, self.run_id = uri, run_id
        self.client = _client(uri)
        self.logged_through = 0  # last optimizer step whose metrics MLflow has
        self.failed = False

    # --- start / resume ---------------------------------------------------------------------------
    @classmethod
    def start(cls, params: Params, root: Path, *, resume_run_id: str, tags: dict, extra_params: dict) -> "RunTracker":
        uri = resolve_tracking_uri(params, root)
        exp_id = ensure_experiment(uri, params.mlflow.experiment, root)
        client = _client(uri)
        if resume_run_id:
            try:
                run = client.get_run(resume_run_id)
                if run.info.experiment_id == exp_id:
                    tracker = cls(uri, resume_run_id)
                    history = client.get_metric_history(resume_run_id, "train_loss")
                    tracker.logged_through = max((m.step for m in history), default=0)
                    client.set_terminated(resume_run_id, status="RUNNING")
                    return tracker
            except Exception:
                pass  # the run is gone (other store, deleted): start a new one
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
            tracker = cls(uri, run.info.run_id)
            tracker._log_params({**params.flat(), **extra_params})
        except Exception as e:
            raise VoxdiffError(f"MLflow tracking store {uri}: could not create a run ({str(e).splitlines()[0][:200]})") from None
        return tracker

    def _log_params(self, flat: dict) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:6000]) for k, v in flat.items()]
        for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    # --- during training --------------------------------------------------------------------------
    def _safely(self, what: str, fn) -> None:
        if self.failed:
            return
        try:
            fn()
        except Exception as e:
            self.failed = True
            warnings.warn(f"MLflow {what} failed ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}); "
                          "training continues and the DVC metrics files stay complete", stacklevel=2)

    def log_history(self, history: list[dict]) -> None:
        """Send the steps of `history` that MLflow does not have yet (call right after a checkpoint)."""
        from mlflow.entities import Metric

        new = [h for h in history if h["step"] > self.logged_through]
        if not new:
            return
        metrics = []
        for h in new:
            ts = int(1000 * h.get("timestamp", 0)) or 0
            for key in METRIC_KEYS + tuple(k for k in h if k.startswith("gns_t")):
                v = h.get(key)
                if v is not None and math.isfinite(v):
                    metrics.append(Metric(key, float(v), ts, int(h["step"])))

        def send():
            for i in range(0, len(metrics), 1000):  # MLflow accepts at most 1000 metrics per batch
                self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])
            self.logged_through = new[-1]["step"]

        self._safely("metric logging", send)

    def log_summary(self, values: dict, artifacts: list[Path] = (), tags: dict | None = None) -> None:
        from mlflow.entities import Metric, RunTag
        import time

        ts = int(time.time() * 1000)

        def send():
            metrics = [Metric(k, float(v), ts, 0) for k, v in values.items()
                       if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
            self.client.log_batch(self.run_id, metrics=metrics,
                                  tags=[RunTag(k, str(v)) for k, v in (tags or {}).items()])
            for path in artifacts:
                if Path(path).is_file():
                    self.client.log_artifact(self.run_id, str(path))

        self._safely("summary logging", send)

    def log_dataset(self, name: str, digest: str, source: dict, context: str = "training") -> None:
        """Record the processed data as the run's input (MLflow datasets): `digest` is the cache's
        fingerprint, so runs on identical data show the same dataset; `source` names where it came from."""
        from mlflow.data.code_dataset_source import CodeDatasetSource
        from mlflow.data.meta_dataset import MetaDataset
        from mlflow.entities import DatasetInput, InputTag

        def send():
            dataset = MetaDataset(CodeDatasetSource({k: str(v) for k, v in source.items()}), name=name,
                                  digest=digest[:36])
            self.client.log_inputs(self.run_id, datasets=[DatasetInput(
                dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)])])

        self._safely("dataset logging", send)

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
        what a user needs to run it in its metadata: label values, preprocessing, diffusion settings."""
        import mlflow
        import monai
        import torch

        def send():
            mlflow.set_tracking_uri(self.uri)
            with mlflow.start_run(run_id=self.run_id):
                # Explicit requirements: MLflow would otherwise infer them by importing the model (slow).
                # Pickle, not MLflow 3's default 'pt2' (a traced export that needs an input example
                # and would fix the grid): the network takes any grid its levels divide.
                mlflow.pytorch.log_model(net, name=name, metadata=metadata, serialization_format="pickle",
                                         pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                                           f"monai=={monai.__version__}"])

        self._safely("model logging", send)

    def finish(self, status: str = "FINISHED") -> None:
        self._safely("run close", lambda: self.client.set_terminated(self.run_id, status=status))


def open_existing(params: Params, root: Path, run_id: str) -> RunTracker | None:
    """The training's run, for evaluate to log into; None (with a warning) when it cannot be reached."""
    if not run_id:
        return None
    uri = resolve_tracking_uri(params, root)
    try:
        tracker = RunTracker(uri, run_id)
        tracker.client.get_run(run_id)
        return tracker
    except Exception as e:
        warnings.warn(f"MLflow run {run_id} not reachable at {uri} ({type(e).__name__}); evaluation is not logged there")
        return None
