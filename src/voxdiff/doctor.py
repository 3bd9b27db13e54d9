"""`voxdiff doctor`: what a bug report needs, in one screen (device, precision, threads, versions, store)."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path


def report(root: Path, params=None) -> list[tuple[str, str]]:
    """(label, value) lines; nothing here trains or writes."""
    import torch

    from voxdiff import __version__
    from voxdiff.runtime.distributed import auto_precision, pick_device

    requested = params.train.device if params else "auto"
    lines = [("voxdiff", __version__), ("python", platform.python_version()),
             ("platform", f"{platform.system()} {platform.machine()}")]
    device = None
    try:
        device = pick_device(requested)
        dtype, why = auto_precision(device)
        auto = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
        lines.append(("device", f"{device} (train.device: {requested})"))
        chosen = params.train.precision if params else "auto"
        lines.append(("precision", f"{auto if chosen == 'auto' else chosen} (train.precision: {chosen}; "
                                   f"auto picks {auto}: {why})"))
    except Exception as e:  # a bad device request is itself worth reporting
        lines.append(("device", f"error: {e}"))
    lines += gpu_lines()
    lines.append(("cpu", f"{os.cpu_count()} logical cores, torch threads {torch.get_num_threads()}, "
                         f"capability {torch.backends.cpu.get_cpu_capability()}, "
                         f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}"))
    lines.append(("bf16 conv3d", bf16_convolutions(params, device)))
    for name in ("torch", "monai", "mlflow", "dvc", "nibabel", "numpy", "nvidia-ml-py"):
        lines.append((name, _version(name)))
    lines += tracking_lines(root, params)
    return lines


def bf16_convolutions(params, device) -> str:
    """Whether bf16 conv3d gives fp32's numbers on this CPU at every convolution shape of params.yaml's
    network on its grid (diffusion/bf16_check.py: PyTorch issue 169688, AMX). Seconds at 128^3. Run where
    the network's convolutions would run on the CPU; never raises."""
    if params is None:
        return "not checked: no params.yaml (the check needs the network and its grid)"
    if device is not None and device.type != "cpu":
        return f"not checked: the network runs on {device} (the fault is in oneDNN's CPU kernel)"
    from voxdiff.diffusion import bf16_check

    try:
        grid = list(params.preprocess.shape)
        return bf16_check.summary(bf16_check.check_network(params.model, len(params.data.label_values), grid), grid)
    except Exception as e:  # an unusual build of PyTorch without bf16 convolutions is itself worth reporting
        return f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def gpu_lines() -> list[tuple[str, str]]:
    """The GPUs: each CUDA device PyTorch sees (name, memory, compute capability), the machine's GPUs as
    NVML (nvidia-ml-py) reports them (memory in use) and the driver; "no CUDA device" without one. Never
    raises: a broken driver is itself worth reporting."""
    import torch

    lines: list[tuple[str, str]] = []
    built = f"PyTorch built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build of PyTorch"
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:  # a driver/runtime mismatch
        lines.append(("cuda", f"error: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"))
        count = 0
    if count:
        lines.append(("cuda", f"{count} device(s) visible to PyTorch ({built})"))
        for i in range(count):
            try:
                props = torch.cuda.get_device_properties(i)
                lines.append((f"cuda:{i}", f"{props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
                                           f"{props.major}.{props.minor}"))
            except Exception as e:
                lines.append((f"cuda:{i}", f"error: {type(e).__name__}"))
    elif not lines:
        lines.append(("cuda", f"no CUDA device ({built})"))
    lines += nvml_lines()
    return lines


def nvml_lines() -> list[tuple[str, str]]:
    """Driver and per-GPU memory in use from NVML (the nvidia-ml-py package, also what MLflow's GPU system
    metrics read); nothing when NVML has no driver to talk to (no NVIDIA GPU)."""
    try:
        import pynvml
    except ImportError:
        return [("nvml", "nvidia-ml-py not installed (MLflow logs no GPU metrics)")]

    def text(v) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound / DriverNotLoaded: no NVIDIA driver here
        return []
    try:
        driver = text(pynvml.nvmlSystemGetDriverVersion())
        try:
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()
            driver += f", supports CUDA {cuda // 1000}.{cuda % 1000 // 10}"
        except Exception:
            pass
        lines = [("driver", f"NVIDIA {driver}")]
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(handle)
            lines.append((f"gpu {i}", f"{text(pynvml.nvmlDeviceGetName(handle))}, {mem.used / 2**30:.1f} of "
                                      f"{mem.total / 2**30:.1f} GiB in use (NVML)"))
        return lines
    except Exception as e:
        return [("nvml", f"error: {type(e).__name__}: {str(e)[:160]}")]
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "not installed"


def tracking_lines(root: Path, params) -> list[tuple[str, str]]:
    from voxdiff.tracking.uri import resolve_tracking_uri, sqlite_path

    uri = resolve_tracking_uri(params, root)
    source = ("MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI")
              else "mlflow.tracking_uri" if params and params.mlflow.tracking_uri.strip() else "default")
    shown = uri
    if (db := sqlite_path(uri)) is not None:
        try:
            shown = f"sqlite:///{db.relative_to(root)} (relative to the project)"
        except ValueError:
            pass
    return [("tracking URI", f"{shown} [{source}]"), ("tracking store", reachable(uri))]


def reachable(uri: str) -> str:
    """Whether the store answers: a SQLite file's folder must exist; a server must answer a search."""
    from voxdiff.tracking.uri import sqlite_path

    db = sqlite_path(uri)
    if db is not None:
        if db.is_file():
            return "reachable (database exists)"
        return "reachable (created on first run)" if db.parent.is_dir() else f"NOT reachable: {db.parent} missing"
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        return "reachable"
    except Exception as e:
        return f"NOT reachable ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''})"


def print_report(root: Path, params, echo=print) -> None:
    lines = report(root, params)
    width = max(len(k) for k, _ in lines)
    for k, v in lines:
        echo(f"{k:<{width}}  {v}")
    if params is None:
        echo(f"{'params':<{width}}  no params.yaml under {root}: showing defaults")
    sys.stdout.flush()
