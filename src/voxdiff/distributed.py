"""Process-group set-up for `torchrun` (DDP) and the device/precision choice."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from .errors import VoxdiffError


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


def pick_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "auto":
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise VoxdiffError(f"params.yaml: train.device is {requested!r} but no CUDA device is available")
    if requested == "cuda":
        return torch.device(f"cuda:{local_rank}")
    return torch.device(requested)


def pick_precision(requested: str, device: torch.device) -> torch.dtype | None:
    if requested == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[requested]


def init_runtime(device: str, precision: str) -> Runtime:
    """Join the process group when started by torchrun (WORLD_SIZE > 1), else run as one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    if world > 1 and not dist.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    dtype = pick_precision(precision, dev)
    return Runtime(dev, rank, world, dtype, use_scaler=dtype is torch.float16)


def all_reduce_sum(values: list[float], rt: Runtime) -> list[float]:
    """Sum a few floats over ranks (one collective); a no-op for one process."""
    if rt.world_size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=rt.device if rt.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()


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
