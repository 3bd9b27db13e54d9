"""Shared fixtures: params from the real params.yaml with overrides, and a tiny preprocessed cache."""

from __future__ import annotations

import ast
import copy
import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

# One OpenMP thread in every process the suite starts (voxdiff commands, DVC stages, torchrun ranks, queue
# workers), as in its own workers (_one_thread_from_the_start): xdist already keeps every core busy with a
# test, and a second thread per process spins on a core another test is using.
os.environ["OMP_NUM_THREADS"] = "1"
BASE_RAW = yaml.safe_load((REPO / "params.yaml").read_text())

# A configuration small enough for many training runs per test (16^3, two UNet levels).
TINY = {
    "preprocess.shape": [16, 16, 16],
    "model.channels": [8, 16],
    "model.attention_levels": [False, True],
    "model.num_head_channels": 8,
    "model.norm_num_groups": 4,
    "diffusion.timesteps": 50,
    # epsilon: the sampler tests use an analytic epsilon denoiser, and samples of an x0 model this young
    # barely depend on their noise (see docs/tuning.md); the demo's x0 setting is run by the e2e tests
    "diffusion.prediction": "epsilon",
    "data.label_values": [0, 1, 2],
    "train.max_samples": 8,
    "train.max_steps": 0,
    "train.lr": 1.0e-3,
    "train.warmup_samples": 0,
    "train.precision": "fp32",  # exactness tests compare trajectories bit for bit or to 1e-5; bf16 has its own tests
    "train.val_every_samples": 2,
    "train.val_draws": 2,
    "train.checkpoint_every": 2,
    # the probe's cost in every tiny run: 2 x (2 buckets x 3 + 4) = 20 single-sample gradients, more than the
    # run's own training; the estimator is tested against known answers at its own sizes (test_gns.py)
    "train.gns_buckets": 2,
    "train.gns_bucket_samples": 3,
    "train.gns_probe_samples": 4,
    "evaluate.sampling_steps": 5,
    "evaluate.samples_per_condition": 1,
    "evaluate.subjects": 1,
    # the Dice metrics run, wired as in the demo, at a token cost (test_segmenter.py scores them at the demo's size)
    "evaluate.segmenter_steps": 20,
    "evaluate.segmenter_seeds": 1,
}


def raw_params(**overrides) -> dict:
    """params.yaml as a dict with dotted-key overrides (`train__batch_size=4` or {"train.batch_size": 4})."""
    raw = copy.deepcopy(BASE_RAW)
    for key, value in overrides.items():
        node = raw
        parts = key.replace("__", ".").split(".")
        for part in parts[:-1]:
            node = node[part]
        node[parts[-1]] = value
    return raw


def make_params(overrides: dict | None = None, tiny: bool = True):
    from voxdiff.params import validate

    merged = {**(TINY if tiny else {}), **(overrides or {})}
    return validate(raw_params(**merged))


def write_tiny_cache(root: Path, n_train: int = 4, n_val: int = 2, shape=(16, 16, 16), classes: int = 3,
                     seed: int = 0) -> Path:
    """A preprocessed cache in the cache.py format: smooth blobs whose intensity follows the class."""
    from scipy.ndimage import gaussian_filter

    from voxdiff.data.cache import FORMAT_VERSION

    rng = np.random.default_rng(seed)
    n = n_train + n_val
    labels = np.zeros((n, *shape), np.uint8)
    images = np.full((n, *shape), -1.0, np.float32)
    for i in range(n):
        field = gaussian_filter(rng.standard_normal(shape), 2.0)
        inside = gaussian_filter(rng.standard_normal(shape), 3.0) > -0.05
        lab = np.where(inside, 1 + (field > 0).astype(np.uint8) * (classes - 2), 0).astype(np.uint8)
        labels[i] = lab
        img = np.where(lab == 0, -1.0, np.where(lab == 1, -0.2, 0.6)) + 0.05 * rng.standard_normal(shape)
        images[i] = np.clip(img, -1, 1)
    out = root / "data" / "processed"
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "images.npy", images)
    np.save(out / "labels.npy", labels)
    affine = np.diag([6.0, 6.0, 6.0, 1.0]).tolist()
    manifest = {
        "version": FORMAT_VERSION, "shape": list(shape), "spacing": [6.0] * 3,
        "label_values": list(range(classes)), "fingerprint": f"tiny{seed}",
        "subjects": [{"id": f"sub-{i:03d}", "index": i, "split": "train" if i < n_train else "val",
                      "affine": affine} for i in range(n)],
    }
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def without_timing(history: list[dict]) -> list[dict]:
    """A run's step records without what the clock sets: what an interrupted and resumed run must equal."""
    drop = ("wall_time", "samples_per_s", "peak_memory_mb", "timestamp")
    return [{k: v for k, v in h.items() if k not in drop} for h in history]


def uninterrupted_run(tiny_root: Path, folder: Path, params) -> dict:
    """The checkpoint of a run trained to its end without a stop, in `folder` (sharing tiny_root's data): what a
    stopped and resumed run must equal."""
    import torch

    from voxdiff.pipeline.train import run_training

    folder.mkdir()
    (folder / "data").symlink_to(tiny_root / "data")
    run_training(params, folder, progress=False)
    return torch.load(folder / "models" / "checkpoint.pt", weights_only=True)


@pytest.fixture
def tiny_root(tmp_path, monkeypatch):
    """A project root with a tiny cache and a private MLflow store."""
    write_tiny_cache(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.delenv("DVC_EXP_NAME", raising=False)
    monkeypatch.delenv("DVC_ROOT", raising=False)
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    return tmp_path


@pytest.fixture(autouse=True)
def _quiet_threads():
    import torch

    torch.set_num_threads(1)  # 2 threads on 2 busy cores is many times slower
    yield


# --- make test on every core (pytest-xdist: make test runs `-n auto --dist loadgroup --no-loadscope-reorder`) ---
# (-n auto: a worker per usable CPU and one more, pytest_xdist_auto_num_workers below)
# Tests are independent (tmp_path roots, private SQLite stores, MLflow servers and torchrun on free ports), so
# xdist hands them out one at a time, with two exceptions arranged here: a module that defines a fixture shared
# by its tests (scope module, class, package or session: a trained model, a built dataset) goes to one worker
# whole, which builds it once; and the slowest tests start first, so that the other worker runs the rest beside
# them instead of waiting for them at the end. xdist's own loadgroup cannot do the first on pytest 9 (the group
# it writes into the test's nodeid is lost: pytest-dev/pytest-xdist#1386), hence the scheduler below.

# Slowest first, by `pytest --durations` on 2 cores (a path prefix takes a module or a parametrized test).
SLOW_FIRST = [
    "tests/test_e2e_dvc.py::test_pipeline_repro_experiments_and_queue",  # ~200 s: dvc repro, edits, a queued grid
    "tests/test_e2e_hosts.py",  # ~100 s: the grid on three clones and a real mlflow server, in its module fixture
    "tests/test_compare_real.py",  # six trainings in its module fixture
    "tests/test_evaluate.py",  # a 512-sample training in its module fixture
    "tests/test_resume_ddp.py::test_resume_after_sigkill_is_bitwise_exact",  # ~45 s (80 samples)
    "tests/test_resume_ddp.py",  # torchrun on 2 processes
    "tests/test_advise.py",
    "tests/test_tracking_outage.py",
    "tests/test_params_cli.py::test_doctor_reports_device_precision_versions_and_store",
]


@functools.lru_cache(maxsize=None)
def _shares_a_fixture(module: str) -> bool:
    """Whether the test module (a path from the repo root) defines a fixture broader than one test."""
    try:
        tree = ast.parse((REPO / module).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        for dec in getattr(node, "decorator_list", ()):
            if (isinstance(dec, ast.Call) and getattr(dec.func, "attr", getattr(dec.func, "id", None)) == "fixture"
                    and any(k.arg == "scope" and getattr(k.value, "value", None) != "function" for k in dec.keywords)):
                return True
    return False


def _work_unit(nodeid: str) -> str:
    """What one xdist worker runs in one go: the test, or its whole module when that shares a fixture."""
    module = nodeid.split("::", 1)[0]
    return module if _shares_a_fixture(module) else nodeid


def _slow_rank(nodeid: str) -> int:
    return next((i for i, prefix in enumerate(SLOW_FIRST) if nodeid.startswith(prefix)), len(SLOW_FIRST))


def pytest_collection_modifyitems(config, items):
    """Slowest first (with or without xdist); a stable sort, so a module's tests stay together and in order."""
    rank = {}
    for item in items:
        unit = _work_unit(item.nodeid)
        rank[unit] = min(rank.get(unit, len(SLOW_FIRST)), _slow_rank(item.nodeid))
    items.sort(key=lambda item: rank[_work_unit(item.nodeid)])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup: xdist's load-group scheduler with _work_unit's units, in the collection's order."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class SharedFixtureScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.rfind("@") > nodeid.rfind("]"):  # an explicit xdist_group mark, should xdist pass it on again
                return super()._split_scope(nodeid)
            return _work_unit(nodeid)

    return SharedFixtureScheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per CPU this process may use (its affinity, and a cgroup CPU quota where one is
    set; not psutil's count of the host's physical cores), and one more: with one per CPU, 7 % of a 2-core
    machine's time was idle while tests waited on servers, queues and sleeps (make test-profile: 1.86 of 2 cores
    busy), and the third worker filled it (1.97 busy; 9 min 40 s against 10 min 11 s, minutes apart on one
    machine). PYTEST_XDIST_AUTO_NUM_WORKERS still overrides it."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None  # xdist's own hook reads it
    return _usable_cpus() + 1


def _usable_cpus() -> int:
    """The CPUs this process may use: its affinity, and a cgroup CPU quota where one is set."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


@pytest.fixture(autouse=True, scope="session")
def _mlflow_schema_built_once(tmp_path_factory):
    """Every test's private SQLite store starts with MLflow's schema replayed from one store per worker that MLflow's
    own migrations built. MLflow builds a new store by running its alembic migrations, about 1.5-2 s of CPU each,
    and the suite opens a new store in each of its 65+ trainings. The schema, the alembic revision and what MLflow
    then writes (the default experiment, the runs) are the same; the migrations themselves still run here once per
    worker, and in every subprocess the end-to-end tests start (stages, `mlflow server`)."""
    import sqlite3

    import mlflow.store.db.utils as db_utils
    import sqlalchemy

    migrate = db_utils._initialize_tables
    template = tmp_path_factory.mktemp("mlflow-schema") / "schema.db"
    engine = sqlalchemy.create_engine(f"sqlite:///{template}")
    migrate(engine)
    engine.dispose()
    with sqlite3.connect(template) as db:
        script = "\n".join(db.iterdump())

    def replay(engine) -> None:
        if engine.dialect.name != "sqlite":
            return migrate(engine)
        raw = engine.raw_connection()
        try:
            raw.driver_connection.executescript(script)
        finally:
            raw.close()

    db_utils._initialize_tables = replay
    yield
    db_utils._initialize_tables = migrate


@pytest.fixture(autouse=True, scope="session")
def _outside_any_dvc_run():
    """The suite runs as though no DVC stage started it: under DVC_ROOT (a `make test` from a DVC stage, or a shell
    that exported it) the module fixtures that train or score would send their caches and MLflow runs to that
    project (runtime/fsutil.project_root), not to their tmp roots. Per-test fixtures clear it too (tiny_root)."""
    with pytest.MonkeyPatch.context() as patch:
        for var in ("DVC_ROOT", "DVC_EXP_NAME"):
            patch.delenv(var, raising=False)
        yield


@pytest.fixture(autouse=True, scope="session")
def _one_thread_from_the_start():
    """One torch thread before any module fixture trains (those are set up before _quiet_threads runs)."""
    import torch

    torch.set_num_threads(1)


# --- where make test's time goes: VOXDIFF_TEST_PROFILE=<file> (make test-profile) -----------------------------
# Per test (set-up, call and tear-down; a broader fixture's set-up counts in the first test that uses it, its
# tear-down in the last): its wall time and the CPU time of its worker and of the subprocesses it waited for (a dvc
# queue's detached workers are not counted). Wall well above CPU is waiting (a server starting, a queue polling, a
# sleep); the summary names the tests that wait most and those that compute most. The file is emptied first.
def pytest_configure(config):
    path = os.environ.get("VOXDIFF_TEST_PROFILE")
    if path and not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or a run without xdist), once
        Path(path).write_text("")
        _MACHINE_AT_START.update(_machine_jiffies())


_MACHINE_AT_START: dict = {}


def _machine_jiffies() -> dict:
    """The whole machine's CPU time so far (/proc/stat, all cores): busy, idle and stolen by the hypervisor. The
    tests' own count misses the detached queue workers and whatever else runs; this one misses nothing."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return {}
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return {"busy": user + nice + system + irq + softirq, "idle": idle + iowait, "steal": steal}


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get("VOXDIFF_TEST_PROFILE")
    if not path:
        yield
        return
    import time

    start, cpu = time.time(), _cpu_seconds()
    yield
    row = {"test": item.nodeid, "start": round(start, 2), "wall_s": round(time.time() - start, 2),
           "cpu_s": round(_cpu_seconds() - cpu, 2), "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}
    with open(path, "a") as fh:  # one short line per write: the workers' lines do not interleave
        fh.write(json.dumps(row) + "\n")


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get("VOXDIFF_TEST_PROFILE")
    if not path or os.environ.get("PYTEST_XDIST_WORKER") or not Path(path).is_file():
        return
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        return
    say = terminalreporter.write_line
    t0 = min(r["start"] for r in rows)
    span = max(max(r["start"] + r["wall_s"] for r in rows) - t0, 1e-3)
    cpu = sum(r["cpu_s"] for r in rows)
    say(f"profile ({path}): {len(rows)} tests in {span:.0f} s, {sum(r['wall_s'] for r in rows):.0f} s of wall time "
        f"in the workers, {cpu:.0f} s of CPU ({cpu / span:.2f} cores busy on average; {_usable_cpus()} usable)")
    # From the controller's start to this summary (collection and the workers' start-up included), and on every
    # core the kernel shows: in a container, other tenants' work counts as busy.
    machine_now = _machine_jiffies()
    if _MACHINE_AT_START and machine_now:
        used = {k: machine_now[k] - _MACHINE_AT_START[k] for k in machine_now}
        total = max(sum(used.values()), 1)
        cores = os.cpu_count() or 1
        say(f"  the machine over the run: {cores * used['busy'] / total:.2f} of {cores} cores busy (every process), "
            f"{cores * used['idle'] / total:.2f} idle, {cores * used['steal'] / total:.2f} stolen by the hypervisor")
    for worker in sorted({r["worker"] for r in rows}):
        mine = [r for r in rows if r["worker"] == worker]
        end = max(r["start"] + r["wall_s"] for r in mine)
        say(f"  worker {worker or '-'}: {len(mine)} tests, {sum(r['wall_s'] for r in mine):.0f} s in tests, "
            f"its last ended {end - t0:.0f} s after the first test started")
    for title, key in (("waiting most (wall - CPU)", lambda r: r["wall_s"] - r["cpu_s"]),
                       ("computing most (CPU)", lambda r: r["cpu_s"])):
        say(f"{title}:")
        for r in sorted(rows, key=key, reverse=True)[:10]:
            say(f"  {r['wall_s']:7.1f} s wall {r['cpu_s']:7.1f} s CPU  {r['test']}")
