"""Shared plumbing for the benchmarks: params, scratch data, trainers, timing, fresh-process workers.

Timing rules (the machine is shared and noisy): configurations being compared run interleaved
(A B, B A, A B ...) after a warm-up round, and we report medians. On CUDA every timer synchronises.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SCRATCH = HERE / ".scratch"  # git-ignored


# --- params ---------------------------------------------------------------------------------------
def with_overrides(raw: dict, overrides: dict) -> dict:
    """A copy of a params dict with dotted-key overrides ({"train.batch_size": 2})."""
    raw = copy.deepcopy(raw)
    for key, value in overrides.items():
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node[part]
        if leaf not in node:
            raise KeyError(f"unknown params key {key}")
        node[leaf] = value
    return raw


def validated(raw: dict, overrides: dict | None = None):
    from voxdiff.params import validate

    return validate(with_overrides(raw, overrides or {}))


def step_budget(b: int, k: int) -> dict:
    """Overrides for a trainer of micro-batch b x accumulate k whose every window is full."""
    return {"train.batch_size": b, "train.accumulate_every": k, "train.max_steps": 10**6, "train.max_samples": 0}


def _key(raw: dict, sections: tuple[str, ...]) -> str:
    return hashlib.sha256(json.dumps({s: raw[s] for s in sections}, sort_keys=True).encode()).hexdigest()[:10]


def data_root(raw: dict) -> Path:
    """A scratch project root holding data/raw (built-in data) and data/processed for these params.

    Kept between runs (keyed by the params that shape the data) so a rerun does not pay for it again.
    """
    from voxdiff.data.prepare import run_prepare
    from voxdiff.data.preprocess import run_preprocess

    params = validated(raw)
    raw_root = SCRATCH / f"raw-{_key(raw, ('seed', 'data'))}"
    if not (raw_root / "data" / "raw" / "index.json").is_file():
        run_prepare(params, raw_root)
    root = SCRATCH / f"root-{_key(raw, ('seed', 'data', 'preprocess'))}"
    if not (root / "data" / "processed" / "manifest.json").is_file():
        (root / "data").mkdir(parents=True, exist_ok=True)
        link = root / "data" / "raw"
        if not link.exists():
            link.symlink_to(raw_root / "data" / "raw", target_is_directory=True)
        run_preprocess(params, root)
    return root


# --- timing ---------------------------------------------------------------------------------------
def sync(device) -> None:
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def interleave(cases: dict[str, Callable[[], object]], rounds: int, device, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each case, run in alternating order (A B, B A, ...) so that drift and
    other users' load hit every case alike; the warm-up rounds are dropped."""
    out = {name: [] for name in cases}
    names = list(cases)
    for r in range(warmup + rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            t = timed(cases[name], device)
            if r >= warmup:
                out[name].append(t)
    return out


def med(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


@contextlib.contextmanager
def stopwatch(owner, name: str, device):
    """Time every call of owner.name (an instance's method or a class's function) into a list."""
    had_own = name in vars(owner)  # a class's own function, or (normally not) an instance attribute
    original = vars(owner)[name] if had_own else getattr(owner, name)
    spent: list[float] = []

    def wrapper(*args, **kwargs):
        sync(device)
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            sync(device)
            spent.append(time.perf_counter() - t0)

    setattr(owner, name, wrapper)
    try:
        yield spent
    finally:
        if had_own:
            setattr(owner, name, original)
        else:
            delattr(owner, name)


@contextlib.contextmanager
def environ(**values):
    """Set (str) or unset (None) environment variables for the block."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        yield
    finally:
        for k, v in old.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)


# --- the run's context ----------------------------------------------------------------------------
class Ctx:
    """What every benchmark needs: base params, the scratch data, the runtime and the profile."""

    def __init__(self, raw: dict, device: str, precision: str, compile_: bool, profile: dict):
        from voxdiff.data.cache import open_cache
        from voxdiff.runtime.distributed import init_runtime

        self.raw = with_overrides(raw, {"train.device": device, "train.precision": precision})
        self.base = validated(self.raw)
        self.rt = init_runtime(device, precision)
        self.device = self.rt.device
        self.compile = compile_
        self.profile = profile
        self.root = data_root(self.raw)
        self.cache = open_cache(self.root / "data" / "processed")

    @functools.cached_property
    def param_mb(self) -> float:
        """Size of the network's parameters in fp32 (one copy: weights, .grad, each Adam moment...)."""
        from voxdiff.diffusion.model import build_network

        net = build_network(self.base.model, self.cache.num_classes)
        return sum(p.numel() for p in net.parameters()) * 4 / 2**20

    def params(self, overrides: dict | None = None):
        return validated(self.raw, overrides)

    def trainer(self, b: int | None = None, k: int | None = None, overrides: dict | None = None, cache=None,
                root: Path | None = None):
        """A voxdiff Trainer (params.yaml's micro-batch and accumulation unless given), compiled with --compile."""
        import torch
        from voxdiff.training.trainer import Trainer

        t = self.base.train
        params = self.params({**step_budget(b or t.batch_size, k or t.accumulate_every), **(overrides or {})})
        trainer = Trainer(params, root or self.root, self.rt, cache or self.cache)
        if self.compile:
            trainer.model = torch.compile(trainer.net)  # losses() runs self.model; probe/EMA/clip use self.net
        return trainer

    def interleave(self, cases, rounds: int | None = None):
        # torch.compile: the first steps compile (and, on the CPU, build kernels in the background).
        warmup = self.profile["warmup"] + (2 if self.compile else 0)
        return interleave(cases, rounds or self.profile["rounds"], self.device, warmup)


CONV_KERNELS = ("slow_conv3d_forward", "mkldnn_convolution", "cudnn_convolution", "_convolution_depthwise")


@contextlib.contextmanager
def quiet_fd2():
    """Silence file descriptor 2 (the profiler's C++ start/stop lines would clutter the report)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def conv_path(net, batch: int, shape, channels: int, device, faults: bool = True) -> dict:
    """Which ATen convolution kernels a forward pass runs (PyTorch picks them by input size) and, on
    the CPU, the minor page faults of one forward+backward (large buffers faulted in afresh every call)."""
    import resource

    import torch
    from torch.profiler import ProfilerActivity, profile

    x = torch.randn(batch, channels, *shape, device=device)
    t = torch.zeros(batch, dtype=torch.long, device=device)
    with torch.no_grad(), quiet_fd2(), profile(activities=[ProfilerActivity.CPU]) as prof:
        net(x, timesteps=t)
    names = [e.name.removeprefix("aten::") for e in prof.events()]
    out = {"kernels": {k: names.count(k) for k in CONV_KERNELS if k in names}}
    if faults and device.type == "cpu":
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        net(x, timesteps=t).float().abs().mean().backward()
        out["page_faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        net.zero_grad(set_to_none=True)
    return out


def machine(device) -> dict:
    import mlflow
    import monai
    import psutil
    import torch

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        cpu = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                   if l.startswith("model name"))
    out = {"cpu": cpu, "cores_logical": os.cpu_count(), "cores_physical": psutil.cpu_count(logical=False),
           "memory_gb": round(psutil.virtual_memory().total / 2**30, 1), "torch_threads": torch.get_num_threads(),
           "python": platform.python_version(), "torch": torch.__version__, "monai": monai.__version__,
           "mlflow": mlflow.__version__, "os": platform.platform(), "device": str(device)}
    if device.type == "cpu":  # bf16 autocast runs 1.6-4.5x faster where the CPU has it (RESULTS.md, speed)
        from voxdiff.runtime.distributed import cpu_has_native_bf16

        out["native_bf16"] = cpu_has_native_bf16()
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    return out


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# --- fresh-process measurements -------------------------------------------------------------------
def run_worker(job: dict, timeout: float = 900) -> dict:
    """Run `job` in a fresh Python process (its own peak RSS) and return what it measured."""
    cmd = [sys.executable, str(HERE / "run.py"), "--worker", json.dumps(job)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"benchmark worker failed ({proc.returncode}): {' | '.join(tail)}")
    return json.loads(lines[-1])


def peak_rss_mb() -> float:
    """Peak RSS of this process image (VmHWM, not the execve-inherited ru_maxrss)."""
    from voxdiff.runtime.distributed import peak_memory_mb

    return peak_memory_mb(None)


def worker_main(job: dict) -> None:
    """In the fresh process: baseline memory after imports, then a few training steps, then the peak."""
    import resource

    import psutil
    import torch
    from voxdiff.data.cache import open_cache
    from voxdiff.runtime.distributed import init_runtime
    from voxdiff.training.trainer import Trainer  # every import before the baseline is taken

    rt = init_runtime(job["device"], job["precision"])
    cuda = rt.device.type == "cuda"
    baseline = psutil.Process().memory_info().rss / 2**20
    params = validated(job["raw"], job["overrides"])
    trainer = Trainer(params, Path(job["root"]), rt, open_cache(Path(job["root"]) / "data" / "processed"))
    if job.get("compile"):
        trainer.model = torch.compile(trainer.net)
    if cuda:
        torch.cuda.synchronize(rt.device)
        baseline = torch.cuda.memory_allocated(rt.device) / 2**20  # the weights and their EMA copy
        torch.cuda.reset_peak_memory_stats(rt.device)
    times, faults, oom = [], [], False
    try:
        for _ in range(job["steps"]):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            times.append(timed(trainer.train_step, rt.device))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    except torch.OutOfMemoryError:
        oom = True
    peak = torch.cuda.max_memory_allocated(rt.device) / 2**20 if cuda else peak_rss_mb()
    result = {"baseline_mb": baseline, "peak_mb": peak, "step_s": times, "page_faults": faults, "oom": oom,
              "ru_maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if job.get("conv_path") and not oom:
        result["conv"] = conv_path(trainer.net, params.train.batch_size, trainer.shape, 1 + trainer.num_classes,
                                   rt.device, faults=False)
    print(json.dumps(result))


# --- a benchmark's figures: a goal (pass/fail) or an info line (suite.py and advise_bench.py) -------------
def goal(name: str, value, op: str, target: float, unit: str = "x", why: str = "") -> dict:
    ok = None
    if value is not None and math.isfinite(value):
        ok = {">=": value >= target, "<=": value <= target, "<": value < target}[op]
    shown = f"{op} {target:g}{({'%': ' %', 'x': '×'}).get(unit, '')}"
    return {"name": name, "value": value, "unit": unit, "goal": shown, "met": ok, "why": "" if ok else why}


def info(name: str, value, unit: str = "x", note: str = "") -> dict:
    """A figure the issue asks for without a pass/fail goal."""
    return {"name": name, "value": value, "unit": unit, "goal": "(info)", "met": None, "why": note}
