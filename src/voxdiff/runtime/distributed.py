"""Process-group set-up for `torchrun` (DDP) and the device/precision choice."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import time

import torch
import torch.distributed as dist

from voxdiff.runtime.errors import VoxdiffError


@dataclasses.dataclass(frozen=True)
class Runtime:
    device: torch.device
    rank: int
    world_size: int
    autocast_dtype: torch.dtype | None  # None = fp32
    use_scaler: bool                    # fp16 needs loss scaling

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def precision(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.autocast_dtype]

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)


def pick_device(requested: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    if world_size > 1 and requested.startswith("cuda:"):
        raise VoxdiffError(f"params.yaml: train.device is {requested!r} under torchrun: every rank would use that one "
                           "GPU; use 'cuda' or 'auto' (rank r takes GPU LOCAL_RANK) and pick GPUs with "
                           "CUDA_VISIBLE_DEVICES")
    if requested == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise VoxdiffError(f"params.yaml: train.device is {requested!r} but no CUDA device is available")
    if requested == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(requested)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX: oneDNN then runs bf16 convolutions natively (no fp32 emulation).

    Measured on the reference 2-core machine (benchmarks/RESULTS.md): bf16 autocast trains the demo
    network 1.7x faster at micro-batch 2 and 6.7x at micro-batch 1, because oneDNN's bf16 kernels also
    replace the slow fp32 im2col path that PyTorch picks for small batch-1 3D convolutions.
    """
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def auto_precision(device: torch.device) -> tuple[torch.dtype | None, str]:
    """What `train.precision: auto` resolves to on `device`, and why (printed by the stages)."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, "CUDA device with native bf16"
        return torch.float16, "CUDA device without bf16: fp16 with a GradScaler"
    if cpu_has_native_bf16():
        return torch.bfloat16, "CPU with native bf16 (AVX512-BF16/AMX)"
    return None, "CPU without native bf16: fp32 (emulated bf16 is slower)"


def pick_precision(requested: str, device: torch.device) -> torch.dtype | None:
    if requested == "auto":
        return auto_precision(device)[0]
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]


# How long a rank waits in a collective for the others. Only rank 0 validates, probes the noise scale,
# writes snapshots and checkpoints and talks to MLflow, while the other ranks wait in the next step's
# all-reduce: NCCL's default (10 min) could be reached by a slow disk or a large probe at 128^3. One hour is
# far above what each of those takes (`voxdiff train --plan` measures each and warns when one step's rank-0
# work would exceed a quarter of this; MLflow calls are bounded by tracking/runs.py's 10 s HTTP timeout and
# 1 retry), and still ends a run whose peer died instead of hanging forever.
PROCESS_GROUP_TIMEOUT = datetime.timedelta(minutes=60)


def init_runtime(device: str, precision: str) -> Runtime:
    """Join the process group when started by torchrun (WORLD_SIZE > 1), else run as one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank, world)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", timeout=PROCESS_GROUP_TIMEOUT)
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = pick_precision(precision, dev)
    return Runtime(dev, rank, world, dtype, use_scaler=dtype is torch.float16)


DETERMINISTIC_CUBLAS = (":4096:8", ":16:8")  # the CUBLAS_WORKSPACE_CONFIG values cuBLAS is deterministic with


def configure_backends(device: torch.device, tf32: bool = True, deterministic: bool = False) -> dict:
    """The CUDA settings of train.tf32 and train.deterministic; returns what was set (for the log).

    On CUDA: cudnn.benchmark (cuDNN times its algorithms once per shape and keeps the fastest: every
    training step has the same shapes), TF32 for fp32 matmuls and convolutions unless `tf32` is false
    (PyTorch's own defaults differ: cuDNN convolutions allow TF32, matmuls do not; false makes both IEEE
    fp32), and with `deterministic` deterministic kernels only: torch.use_deterministic_algorithms (an op
    without one raises), cudnn.deterministic, no benchmark (its choice can differ run to run), and
    CUBLAS_WORKSPACE_CONFIG, which cuBLAS reads when its first handle is made (set it before any CUDA
    matmul, as run_training does). On the CPU nothing is changed: these are process-wide switches of
    the CUDA backends, and PyTorch's CPU kernels are deterministic already.
    """
    if device.type != "cuda":
        return {}
    # The legacy switches, not PyTorch 2.9's per-backend fp32_precision: in 2.13, setting
    # torch.backends.cuda.matmul.fp32_precision makes torch.get_float32_matmul_precision() raise ("mix of
    # the legacy and new APIs"), and inductor calls it when it compiles (codecache, select_algorithm), so
    # train.compile would fail. These two touch CUDA only (set_float32_matmul_precision would also switch
    # oneDNN's CPU matmuls) and the new getters read them back consistently (tests/test_cuda_settings.py).
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cudnn.benchmark = not deterministic
    torch.backends.cudnn.deterministic = deterministic
    if deterministic and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in DETERMINISTIC_CUBLAS:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = DETERMINISTIC_CUBLAS[0]
    torch.use_deterministic_algorithms(deterministic, warn_only=False)
    return {"tf32": tf32, "cudnn_benchmark": not deterministic, "deterministic": deterministic,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")}


def all_reduce_sum(values: list[float], rt: Runtime) -> list[float]:
    """Sum a few floats over ranks (one collective); a no-op for one process."""
    if rt.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=rt.device if rt.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU. Around anything timed."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> tuple[float, object]:
    """(seconds, result) of fn(), the device's queued work included."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn()
    synchronize(device)
    return time.perf_counter() - t0, out


def reset_peak_memory(device: torch.device) -> None:
    """Start peak_memory_mb's count again: CUDA's peak allocated, or on the CPU (Linux) this process's
    peak RSS (VmHWM; writing "5" to /proc/self/clear_refs resets it), so a measurement after it is not the
    peak of whatever ran before (imports, another micro-batch)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def peak_memory_mb(device: torch.device | None = None) -> float:
    """Peak CUDA memory allocated (since the last reset), or this process's peak RSS on the CPU.

    On the CPU we read VmHWM rather than ru_maxrss: Linux carries ru_maxrss across execve, so a stage
    started by a large parent (dvc, pytest) would report the parent's peak as its own.
    """
    if device is not None and device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
