"""`voxdiff train --plan`: what a training will need and take, before it starts; and the disk check that
every `voxdiff train` runs up front.

The arithmetic (steps, samples, how many validations, probes, snapshots and checkpoints, the bytes of each
file) follows the trainer's own rules: schedule.plan_budget and the same due-in-samples tests, walked over
the budget step by step, and sizes from the network's tensors (a network on the meta device will do, so
params-gpu.yaml's 41 M weights are planned without allocating them). The measurements are real: a few
whole training steps at train.batch_size on the training's device and precision (the first, warm-up and
any compile, left out of the step time), one validation pass, two of the probe's single-sample gradients,
one checkpoint and one post-hoc EMA snapshot written to a temporary folder beside models/ and read back.
Nothing under models/ is written, and no MLflow run is made.

The disk check counts, per file system: the checkpoint twice (the previous one stays until the new one is
complete), the post-hoc EMA snapshots still to take, DVC's cache copy of the checkpoint (`dvc repro` stores
models/checkpoint.pt in .dvc/cache: a full copy unless cache.type links), and the EMA model MLflow stores
when its artifacts are local; less what the run replaces (the present checkpoint and, on a fresh start,
the snapshots of another run). When a file system cannot hold its part, training is refused in one line.

Not part of the training's identity (codehash.training_sources: the stage's own floor): nothing here changes a weight.
"""

from __future__ import annotations

import configparser
import copy
import dataclasses
import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from voxdiff.runtime.errors import VoxdiffError
from voxdiff.params import Params, Train, validate
from voxdiff.training import posthoc_ema
from voxdiff.training.schedule import crosses, due_in_samples, plan_budget

# torch.save's zip format: per tensor a zip entry (local and central headers, 64-byte alignment) and its
# pickle record; measured 360 B per tensor on the demo checkpoint (1,293 tensors).
TENSOR_OVERHEAD_BYTES = 400
# A snapshot file holds one profile's tensors under shorter names: 245 B per tensor measured on the tiny net.
SNAPSHOT_TENSOR_OVERHEAD_BYTES = 260
# One optimizer step's record in the checkpoint's history (15 numbers, keys memoised by pickle): 160 B on
# the demo; a probe's record adds ~7 keys per timestep bucket and the marginal.
HISTORY_BYTES_PER_STEP = 200
PROBE_BYTES_PER_GROUP = 200
# `voxdiff train --plan` warns when one step's rank-0 work (validation, probe, snapshot, checkpoint, while
# the other ranks wait in the next all-reduce) would take more than this share of the process-group timeout.
RANK0_TIMEOUT_SHARE = 0.25
# What torchrun (its agent's shutdown timeout), SLURM (KillWait) and Kubernetes (terminationGracePeriodSeconds)
# allow by default between SIGTERM and SIGKILL: a stopped training must have saved by then.
SIGTERM_GRACE_S = 30.0


# --- the budget's events ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Events:
    """What a run does from optimizer step `start_step` to the end of its budget."""
    effective_batch: int
    micro_batch: int
    accumulate_every: int
    world_size: int
    total_steps: int
    total_samples: int
    start_step: int
    validations: int   # train.val_every_samples crossings, and the end
    probes: int        # train.gns_buckets_every_samples crossings, and the end (0 when off)
    snapshots: int     # post-hoc EMA snapshots per profile (train.phema_snapshots points crossed)
    checkpoints: int   # writes of models/checkpoint.pt: every train.checkpoint_every steps, and the end
    kept: int = 0      # copies in models/kept (train.keep_checkpoints_at_samples points crossed)

    @property
    def steps(self) -> int:
        return self.total_steps - self.start_step


def count_events(train: Train, world_size: int = 1, start_step: int = 0) -> Events:
    """Walk the budget's windows as the training loop does (train.py: run_sample_counted_events, save)."""
    from voxdiff.training.trainer import due  # the checkpoint cadence's own test

    b = plan_budget(train, world_size)
    val = probe = snap = ckpt = kept = 0
    profiles = bool(train.phema_sigma_rels)
    for step in range(start_step, b.total_steps):
        window = b.window(step)
        before, now, last = window.start, window.stop, step + 1 == b.total_steps
        val += due_in_samples(before, now, train.val_every_samples, last)
        probe += due_in_samples(before, now, train.gns_buckets_every_samples, last)
        snap += profiles and posthoc_ema.snapshot_due(before, now, b.total_samples, train.phema_snapshots)
        ckpt += due(step + 1, train.checkpoint_every, b.total_steps) and not last
        kept += crosses(before, now, train.keep_checkpoints_at_samples)
    if b.total_steps > start_step:
        ckpt += 1  # the finished checkpoint
    return Events(b.effective_batch, b.micro_batch, b.accumulate_every, world_size, b.total_steps, b.total_samples,
                  start_step, val, probe, snap, ckpt, kept)


# --- sizes -----------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Sizes:
    """The network's tensors: what every copy of it in a checkpoint or snapshot holds."""
    weights: int          # elements of the floating tensors of its state_dict (parameters and buffers)
    tensors: int          # how many such tensors
    trainable: int        # elements of the parameters Adam updates (two fp32 moments each)
    trainable_tensors: int


def network_sizes(net: torch.nn.Module) -> Sizes:
    state = [v for v in net.state_dict().values() if v.is_floating_point()]
    params = [p for p in net.parameters() if p.requires_grad]
    return Sizes(sum(v.numel() for v in state), len(state), sum(p.numel() for p in params), len(params))


def sizes_for(params: Params, num_classes: int | None = None) -> Sizes:
    """Sizes of params.yaml's network, built on the meta device (no memory for its weights)."""
    from voxdiff.diffusion.model import build_network

    with torch.device("meta"):
        net = build_network(dataclasses.replace(params.model, activation_checkpointing=False),
                            num_classes or params.data.num_classes)
    return network_sizes(net)


def checkpoint_bytes(sizes: Sizes, train: Train, events: Events) -> int:
    """models/checkpoint.pt at the end of the run (Trainer.state): the weights, the EMA, each post-hoc EMA
    profile, the best point's EMA copies (best_copies), Adam's two moments, all in fp32, and the step history."""
    profiles = len(train.phema_sigma_rels)
    copies = 2 + profiles + best_copies(events.validations)
    elements = sizes.weights * copies + 2 * sizes.trainable
    tensors = sizes.tensors * copies + 3 * sizes.trainable_tensors + 1 + 2 * profiles  # + Adam's step,
    history = events.total_steps * HISTORY_BYTES_PER_STEP + events.probes * PROBE_BYTES_PER_GROUP * (  # EMA's count
        train.gns_buckets + (1 if train.gns_probe_samples else 0))
    return 4 * elements + TENSOR_OVERHEAD_BYTES * tensors + history


def best_copies(validations: int) -> int:
    """EMA copies training/best.py holds at the end of a run with this many validations: the kept best (once a
    window of BEST_WINDOW is full) and the BEST_WINDOW // 2 latest, which may yet be a window's centre."""
    from voxdiff.analysis.convergence import BEST_WINDOW

    return (1 if validations >= BEST_WINDOW else 0) + min(validations, BEST_WINDOW // 2)


def snapshot_set_bytes(sizes: Sizes, train: Train) -> int:
    """One snapshot point: every profile's weights in posthoc_ema.SNAPSHOT_DTYPE, one file each."""
    profiles = len(train.phema_sigma_rels)
    return (posthoc_ema.snapshot_bytes(sizes.weights, profiles, 1)
            + SNAPSHOT_TENSOR_OVERHEAD_BYTES * sizes.tensors * profiles)


# --- GPU memory ------------------------------------------------------------------------------------
# Share of the free device memory an estimate may fill: the rest is for what it leaves out (the allocator's
# fragmentation, cuDNN's workspaces, the gradients in flight during the backward).
MEMORY_HEADROOM = 0.9


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Device memory of a training step: a part that does not depend on the micro-batch and a part per sample."""
    fixed: int        # bytes: fp32 weights, gradients, Adam's moments, EMA, post-hoc EMA profiles, and
                      # autocast's low-precision copy of the weights
    per_sample: int   # bytes per sample of the micro-batch: what autograd keeps from the forward for the backward
    precision: str

    def at(self, micro: int) -> int:
        return self.fixed + micro * self.per_sample

    def fitting(self, free: int) -> int:
        """The largest micro-batch whose estimate fits MEMORY_HEADROOM of `free` bytes (0: none)."""
        return max(0, int((MEMORY_HEADROOM * free - self.fixed) // max(self.per_sample, 1)))


class _FlashAttentionSaves(torch.overrides.TorchFunctionMode):
    """On the meta device scaled_dot_product_attention takes the math path, which keeps the tokens x tokens
    attention matrix (69 GB for the tiny test network at 64^3). On CUDA the network uses the fused kernels
    (model.build_network: flash_attention), which keep q, k, v, the output and a log-sum-exp per token: count
    those instead, and let the output be a copy of q (same shape) so the pass goes on."""

    def __init__(self):
        super().__init__()
        self.saved = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = (*args, *(kwargs[n] for n in ("query", "key", "value") if n in kwargs))[:3]
            self.saved += sum(t.numel() * t.element_size() for t in (q, k, v, q)) + 4 * q[..., 0].numel()
            return q.clone()
        return func(*args, **kwargs)


def activation_bytes(params: Params, num_classes: int) -> tuple[int, int]:
    """(all fp32, all in half precision) bytes autograd saves in one sample's forward pass of params.yaml's
    network as CUDA runs it (saved-tensor hooks on a meta-device pass: nothing is allocated; the attention as
    the fused kernels keep it). With model.activation_checkpointing the blocks keep only their inputs, plus
    one block's own activations while it is recomputed."""
    from voxdiff.diffusion.model import build_network

    def count(dtype) -> int:
        with torch.device("meta"):
            net = build_network(dataclasses.replace(params.model, activation_checkpointing=False),
                                num_classes, flash_attention=True).to(dtype)
        saved: dict[int, tuple[int, torch.Tensor]] = {}  # by id, the tensor kept so that no id is reused
        blocks: list[tuple[int, int]] = []  # (bytes saved inside the block, bytes of its inputs)
        at_entry: list[tuple[int, int]] = []

        def pack(t):
            saved[id(t)] = (t.numel() * t.element_size(), t)
            return t

        def saved_bytes() -> int:
            return sum(n for n, _ in saved.values())

        def enter(module, args):
            at_entry.append((saved_bytes(), sum(a.numel() * a.element_size() for a in args
                                                      if isinstance(a, torch.Tensor))))

        def leave(module, args, out):
            total, inputs = at_entry.pop()
            blocks.append((saved_bytes() - total, inputs))

        for block in [*net.down_blocks, net.middle_block, *net.up_blocks]:
            block.register_forward_pre_hook(enter)
            block.register_forward_hook(leave)
        attention = _FlashAttentionSaves()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), attention:
            net(torch.zeros(1, 1 + num_classes, *params.preprocess.shape, device="meta", dtype=dtype),
                timesteps=torch.zeros(1, dtype=torch.long, device="meta"))
        total = saved_bytes() + attention.saved
        if params.model.activation_checkpointing:
            total += -sum(b for b, _ in blocks) + sum(i for _, i in blocks) + max(b for b, _ in blocks)
        return total

    return count(torch.float32), count(torch.bfloat16)


def memory_estimate(params: Params, num_classes: int, precision: str, world_size: int = 1) -> MemoryEstimate:
    """The training step's device memory (MemoryEstimate) from the network's sizes and its saved activations.
    Activations: fp32 at precision fp32; under bf16/fp16 autocast the midpoint of all-fp32 and all-half (the
    convolutions keep half-precision inputs, CUDA's autocast keeps GroupNorm in fp32). Not calibrated on a
    GPU here (none was lent): an estimate, written out in the refusal."""
    sizes = sizes_for(params, num_classes)
    copies = 2 + len(params.train.phema_sigma_rels)  # weights, EMA, profiles (the best point's copies: on the CPU)
    fixed = 4 * sizes.weights * copies + 4 * 3 * sizes.trainable  # + gradients and Adam's two moments
    if precision != "fp32":
        fixed += 2 * sizes.trainable  # autocast's half-precision copy of the weights
    if world_size > 1:
        fixed += 4 * sizes.trainable  # DDP's gradient buckets
    full, half = activation_bytes(params, num_classes)
    per_sample = full if precision == "fp32" else (full + half) // 2
    return MemoryEstimate(fixed, per_sample, precision)


def memory_refusal(estimate: MemoryEstimate, free: int, micro: int, accumulate: int, world_size: int,
                   device: str) -> str | None:
    """One line when train.batch_size `micro` does not fit `free` bytes of device memory (its estimate above
    MEMORY_HEADROOM of them), naming the estimate, the free memory and the micro-batch that fits; else None.
    A pure function: the CPU tests it, training and `--plan` call it with CUDA's free memory."""
    need = estimate.at(micro)
    if need <= MEMORY_HEADROOM * free:
        return None
    head = (f"{device}: not enough GPU memory for train.batch_size {micro}: a training step needs ~{fmt_bytes(need)} "
            f"(estimated: {fmt_bytes(estimate.fixed)} for weights, gradients, Adam, EMA and profiles + "
            f"{fmt_bytes(estimate.per_sample)} of activations per sample, {estimate.precision}), "
            f"{fmt_bytes(free)} are free")
    fits = estimate.fitting(free)
    if fits < 1:
        return (f"{head}; not even micro-batch 1 fits: set model.activation_checkpointing: true, a smaller "
                "preprocess.shape or model.channels, or use a larger GPU")
    per_process = micro * accumulate  # keep the effective batch: a micro-batch that divides it
    m = max(d for d in range(1, min(fits, per_process) + 1) if per_process % d == 0)
    return (f"{head}; micro-batch {fits} fits: set train.batch_size: {m} and train.accumulate_every: "
            f"{per_process // m} to keep the effective batch {per_process * world_size}")


def check_gpu_memory(params: Params, device: torch.device, num_classes: int, world_size: int,
                     precision: str) -> MemoryEstimate:
    """On a CUDA device: refuse (VoxdiffError, one line) a micro-batch that cannot fit the free memory,
    before any weight is on it. Returns the estimate."""
    estimate = memory_estimate(params, num_classes, precision, world_size)
    free, _ = torch.cuda.mem_get_info(device)
    line = memory_refusal(estimate, free, params.train.batch_size, params.train.accumulate_every, world_size,
                          str(device))
    if line:
        raise VoxdiffError(line)
    return estimate


# --- disk ------------------------------------------------------------------------------------------
@dataclasses.dataclass
class DiskNeed:
    """What one file system must hold beyond what it holds now."""
    folder: Path                  # the first folder named (the file system is that of its nearest existing parent)
    items: list[tuple[str, int]]  # (what, bytes) written there
    reclaimed: int                # bytes there now that the run replaces or removes
    free: int

    @property
    def need(self) -> int:
        return max(0, sum(b for _, b in self.items) - self.reclaimed)

    @property
    def ok(self) -> bool:
        return self.need <= self.free


def existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def dvc_cache_dir(root: Path) -> Path | None:
    """Where `dvc repro` copies models/checkpoint.pt (its cache), or None: not a DVC project, or a
    cache.type that links instead of copying."""
    from voxdiff.runtime.fsutil import project_root

    dvc = project_root(root) / ".dvc"
    if not dvc.is_dir():
        return None
    cache, kind = dvc / "cache", ""
    for name in ("config", "config.local"):
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        try:
            parser.read(dvc / name)
        except configparser.Error:
            continue
        if parser.has_option("cache", "dir"):
            cache = (dvc / parser.get("cache", "dir").strip().strip("'\"")).resolve()
        if parser.has_option("cache", "type"):
            kind = parser.get("cache", "type")
    if kind and not any(k.strip() in ("copy", "reflink") for k in kind.split(",")):
        return None  # hardlink / symlink: no second copy
    return cache


def mlflow_artifacts_dir(params: Params, root: Path) -> Path | None:
    """The local folder of MLflow's artifacts for the store in force (tracking.uri), else None."""
    from voxdiff.tracking.uri import local_artifacts_dir, resolve_tracking_uri

    return local_artifacts_dir(resolve_tracking_uri(params, root))


def disk_needs(params: Params, root: Path, sizes: Sizes, events: Events, fresh_start: bool = True) -> list[DiskNeed]:
    """Per file system, what the run writes beyond what is there now (DiskNeed). fresh_start: the snapshots
    now in models/phema are removed when the run starts (another run's, or none); otherwise they are this
    run's own and only those still to take are counted."""
    root = Path(root)
    models = root / "models"
    ckpt_file, phema_dir = models / "checkpoint.pt", models / "phema"
    ckpt = checkpoint_bytes(sizes, params.train, events)
    groups: dict[int, DiskNeed] = {}

    def add(folder: Path, what: str, nbytes: int, reclaimed: int = 0) -> None:
        here = existing(folder)
        dev = os.stat(here).st_dev
        if dev not in groups:
            groups[dev] = DiskNeed(folder, [], 0, shutil.disk_usage(here).free)
        groups[dev].items.append((what, nbytes))
        groups[dev].reclaimed += reclaimed

    present = ckpt_file.stat().st_size if ckpt_file.is_file() else 0
    add(models, f"checkpoint 2 x {fmt_bytes(ckpt)} while one is written", 2 * ckpt, present)
    if params.train.phema_sigma_rels and events.snapshots:
        old = sum(f.stat().st_size for f in phema_dir.glob("*.pt")) if fresh_start and phema_dir.is_dir() else 0
        add(phema_dir, f"post-hoc EMA snapshots {fmt_bytes(events.snapshots * snapshot_set_bytes(sizes, params.train))}",
            events.snapshots * snapshot_set_bytes(sizes, params.train), old)
    if events.kept:
        add(models / "kept", f"{events.kept} kept checkpoint copies {fmt_bytes(events.kept * ckpt)}", events.kept * ckpt)
    cache = dvc_cache_dir(root)
    if cache is not None:
        add(cache, f"DVC cache copy {fmt_bytes(ckpt)}", ckpt)
    artifacts = mlflow_artifacts_dir(params, root)
    if artifacts is not None:
        add(artifacts, f"MLflow EMA model {fmt_bytes(4 * sizes.weights)}", 4 * sizes.weights)
    return list(groups.values())


def refusal(need: DiskNeed) -> str:
    what = ", ".join(w for w, _ in need.items)
    return (f"{existing(need.folder)}: not enough free disk for this training: it needs {fmt_bytes(need.need)} "
            f"there ({what}{f', less {fmt_bytes(need.reclaimed)} it replaces' if need.reclaimed else ''}), "
            f"{fmt_bytes(need.free)} are free; free some (e.g. `dvc gc -w`), lower train.phema_snapshots, or see "
            "`voxdiff train --plan`")


def check_disk(needs: list[DiskNeed]) -> None:
    """Refuse (VoxdiffError, one line) when a file system cannot hold its part of the run."""
    for need in needs:
        if not need.ok:
            raise VoxdiffError(refusal(need))


def fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def fmt_seconds(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.1f} h"
    if s >= 120:
        return f"{s / 60:.1f} min"
    return f"{s:.2f} s" if s < 10 else f"{s:.0f} s"


# --- measurements ----------------------------------------------------------------------------------
def short_run(params: Params, *, max_samples: int = 0, max_steps: int = 0, seed: int | None = None,
              **train) -> Params:
    """params with another training budget (and any other train keys, and seed) for a short run made from them:
    advise's branches and warm-up, --plan's measured steps. train.keep_checkpoints_at_samples is emptied: its
    points belong to the full run, lie past such a budget and would be refused there. (Here, not in params.py:
    params.py is part of the training code's hash, and training never calls this.)"""
    raw = copy.deepcopy(params.raw)
    raw["train"].update(max_samples=max_samples, max_steps=max_steps, keep_checkpoints_at_samples=[], **train)
    if seed is not None:
        raw["seed"] = seed
    return validate(raw)


def measuring_params(params: Params, steps: int) -> Params:
    """params.yaml with a budget of exactly the measured steps, every window full (no kept copies)."""
    return short_run(params, max_steps=steps)


def measure(trainer, steps: int, scratch_parent: Path) -> dict:
    """Time `steps` + 1 training steps (the first is the warm-up: left out), one validation, two probe
    gradients (the first warm), one checkpoint and one snapshot written (and the snapshot read) in a
    temporary folder under `scratch_parent`; peak memory of the steps alone and of everything."""
    from voxdiff.runtime.distributed import peak_memory_mb, reset_peak_memory, timed

    dev = trainer.rt.device
    reset_peak_memory(dev)
    times = [timed(trainer.train_step, dev)[0] for _ in range(steps + 1)]
    out = {"first_step_s": times[0], "step_s": statistics.median(times[1:]), "step_times_s": times,
           "peak_memory_mb": peak_memory_mb(dev)}
    out["validation_s"] = timed(trainer.validation_loss, dev)[0]

    params = [q for q in trainer.net.parameters() if q.requires_grad]
    noise = torch.zeros((1, *trainer.shape))

    def gradient():
        loss = trainer.losses(trainer.net, *trainer.on_device([0], [trainer.p.diffusion.timesteps // 2], [noise])).sum()
        return torch.autograd.grad(loss, params)

    timed(gradient, dev)
    out["probe_gradient_s"] = timed(gradient, dev)[0]
    out["peak_memory_all_mb"] = peak_memory_mb(dev)
    if trainer.rt.is_main:
        with tempfile.TemporaryDirectory(prefix=".voxdiff-plan-", dir=existing(scratch_parent)) as tmp:
            from voxdiff.training import checkpoint

            path = Path(tmp) / "checkpoint.pt"
            out["checkpoint_write_s"] = timed(lambda: checkpoint.save(path, trainer.state(False, None)), dev)[0]
            out["checkpoint_measured_bytes"] = path.stat().st_size
            out["checkpoint_measured_history_steps"] = len(trainer.counters.history) or trainer.counters.step
            path.unlink()
            if trainer.phema is not None:
                tracker = trainer.phema
                folder, tracker.folder = tracker.folder, Path(tmp) / "phema"
                try:
                    out["snapshot_write_s"] = timed(tracker.snapshot, dev)[0]
                    files = list(tracker.folder.glob("*.pt"))
                    out["snapshot_read_s"] = timed(
                        lambda: [torch.load(f, map_location="cpu", weights_only=True) for f in files], dev)[0]
                finally:
                    tracker.folder = folder
                    tracker.taken = []
    return out


# --- the plan --------------------------------------------------------------------------------------
def stop_to_saved(m: dict, checkpoint_end_bytes: int, train: Train) -> dict:
    """Seconds from a SIGTERM (or Ctrl-C) to the saved checkpoint, in the worst case: the signal lands as a
    step starts, so the whole step runs first; the validation and the probe due there wait for the resumed
    run (train.run_sample_counted_events), a post-hoc EMA snapshot due there is taken; then the checkpoint,
    at the size it reaches at the end of the run, is written at the speed measured by writing one (its
    bytes over its seconds). None without a measured write (ranks other than 0)."""
    if not m.get("checkpoint_write_s") or not m.get("checkpoint_measured_bytes"):
        return {}
    speed = m["checkpoint_measured_bytes"] / m["checkpoint_write_s"]
    parts = {"step": m["step_s"], "snapshot": m.get("snapshot_write_s", 0.0) if train.phema_sigma_rels else 0.0,
             "checkpoint": checkpoint_end_bytes / speed}
    return {"parts": parts, "total_s": sum(parts.values()), "write_bytes_per_s": speed,
            "checkpoint_bytes": checkpoint_end_bytes, "grace_s": SIGTERM_GRACE_S}


def predict(events: Events, train: Train, m: dict, compile_: bool) -> dict:
    """Seconds of each part of the run from the measurements, and their sum."""
    probe_gradients = 2 * (train.gns_buckets * train.gns_bucket_samples + train.gns_probe_samples)
    profiles = len(train.phema_sigma_rels)
    parts = {
        "training steps": events.steps * m["step_s"],
        "validation": events.validations * m["validation_s"],
        "noise-scale probe": events.probes * probe_gradients * m["probe_gradient_s"],
        "checkpoints": events.checkpoints * m.get("checkpoint_write_s", 0.0),
        "post-hoc EMA snapshots": events.snapshots * m.get("snapshot_write_s", 0.0),
        # the end: every snapshot read once, then one validation per reconstructed length
        "post-hoc EMA at the end": (events.snapshots * m.get("snapshot_read_s", 0.0)
                                    + len(train.phema_eval_sigma_rels) * m["validation_s"]) if profiles else 0.0,
    }
    if compile_:
        parts["torch.compile (first step)"] = max(0.0, m["first_step_s"] - m["step_s"])
    rank0 = m["validation_s"] + (probe_gradients * m["probe_gradient_s"] if events.probes else 0.0) + m.get(
        "snapshot_write_s", 0.0) + m.get("checkpoint_write_s", 0.0)
    return {"parts": parts, "total_s": sum(parts.values()), "rank0_longest_s": rank0,
            "probe_gradients": probe_gradients}


def run_plan(params: Params, root: Path, steps: int = 3, echo=print) -> dict:
    """Print the plan of `voxdiff train` for params.yaml (see the module docstring); raise VoxdiffError
    after printing when the disk cannot hold the run. Returns the plan as a dict."""
    from voxdiff.data.cache import open_cache
    from voxdiff.runtime.distributed import (PROCESS_GROUP_TIMEOUT, configure_backends, init_runtime,
                                              shutdown)
    from voxdiff.training.trainer import Trainer

    root = Path(root)
    rt = init_runtime(params.train.device, params.train.precision)
    try:
        configure_backends(rt.device, params.train.tf32, params.train.deterministic)
        cache = open_cache(root / "data" / "processed")
        events = count_events(params.train, rt.world_size)
        sizes = sizes_for(params, cache.num_classes)
        needs = disk_needs(params, root, sizes, events)
        memory = memory_estimate(params, cache.num_classes, rt.precision, rt.world_size)
        if rt.device.type == "cuda":  # refused before the measured steps would run out of memory
            check_gpu_memory(params, rt.device, cache.num_classes, rt.world_size, rt.precision)
        trainer = Trainer(measuring_params(params, steps + 1), root, rt, cache)
        m = measure(trainer, steps, root / "models")
        del trainer
        pred = predict(events, params.train, m, params.train.compile)
        pred["stop_to_saved"] = stop_to_saved(m, checkpoint_bytes(sizes, params.train, events), params.train)
        plan = {"device": str(rt.device), "precision": rt.precision, "world_size": rt.world_size,
                "events": dataclasses.asdict(events), "sizes": dataclasses.asdict(sizes),
                "checkpoint_bytes": checkpoint_bytes(sizes, params.train, events),
                "snapshot_bytes": events.snapshots * snapshot_set_bytes(sizes, params.train)
                if params.train.phema_sigma_rels else 0,
                "dvc_cache_dir": str(dvc_cache_dir(root) or ""),
                "disk": [{"folder": str(n.folder), "need": n.need, "free": n.free, "ok": n.ok,
                          "items": n.items, "reclaimed": n.reclaimed} for n in needs],
                "measured": m, "predicted": pred, "measured_steps": steps,
                "memory_estimate": dataclasses.asdict(memory),
                "process_group_timeout_s": PROCESS_GROUP_TIMEOUT.total_seconds()}
        if rt.device.type == "cuda":
            plan["device_memory_mb"] = torch.cuda.get_device_properties(rt.device).total_memory / 2**20
        if rt.is_main:
            for line in render(plan, params):
                echo(line)
        short = [n for n in needs if not n.ok]
        if short:
            raise VoxdiffError(refusal(short[0]))
        return plan
    finally:
        shutdown()


def render(plan: dict, params: Params) -> list[str]:
    e, t, m, pred = plan["events"], params.train, plan["measured"], plan["predicted"]
    n = plan["sizes"]["weights"]
    rule = (f"{e['total_steps']} = ceil({e['total_samples']} / {e['effective_batch']})" if t.max_samples
            else f"train.max_steps; {e['total_samples']} = {e['total_steps']} x {e['effective_batch']}")
    mem_kind = "CUDA memory allocated" if plan["device"].startswith("cuda") else "the process's peak RSS: CPU"
    lines = [
        f"[voxdiff plan] device {plan['device']}, precision {plan['precision']}, world size {plan['world_size']}"
        + (", torch.compile" if t.compile else "") + (", deterministic" if t.deterministic else ""),
        f"  budget            {e['total_samples']} samples in {e['total_steps']} optimizer steps of effective batch "
        f"{e['effective_batch']} (micro-batch {e['micro_batch']} x accumulate_every {e['accumulate_every']} x "
        f"{e['world_size']} process{'es' if e['world_size'] > 1 else ''}; steps {rule})",
        f"  events            {e['validations']} validations, {e['probes']} noise-scale probes, {e['snapshots']} post-hoc "
        f"EMA snapshots per profile, {e['checkpoints']} checkpoint writes",
        f"  network           {n / 1e6:.2f} M weights ({fmt_bytes(4 * n)} in fp32)",
        f"  checkpoint        {fmt_bytes(plan['checkpoint_bytes'])} at the end (fp32: weights, EMA, "
        f"{len(t.phema_sigma_rels)} post-hoc EMA profiles, {best_copies(e['validations'])} EMA copies for the best point, "
        f"Adam's 2 moments; + step history; a real one written now, with no best point yet: "
        f"{fmt_bytes(m.get('checkpoint_measured_bytes', 0))} after {m.get('checkpoint_measured_history_steps', 0)} "
        f"steps); twice that while one is written",
        f"  snapshots         {fmt_bytes(plan['snapshot_bytes'])} in models/phema ({n / 1e6:.2f} M x 2 B x "
        f"{len(t.phema_sigma_rels)} profiles x {e['snapshots']})",
        *([f"  kept copies       {e['kept']} x the checkpoint in models/kept (train.keep_checkpoints_at_samples)"]
          if e["kept"] else []),
        "  DVC cache copy    " + (f"{fmt_bytes(plan['checkpoint_bytes'])} in {plan['dvc_cache_dir']} (dvc repro stores "
                                   "models/checkpoint.pt there; `dvc gc -w` removes other runs')"
                                   if plan["dvc_cache_dir"] else "none (not a DVC project, or cache.type links)"),
    ]
    for d in plan["disk"]:
        lines.append(f"  disk              {existing(Path(d['folder']))}: needs {fmt_bytes(d['need'])}, "
                     f"{fmt_bytes(d['free'])} free: {'ok' if d['ok'] else 'NOT ENOUGH'} ("
                     + ", ".join(w for w, _ in d["items"])
                     + (f", less {fmt_bytes(d['reclaimed'])} replaced" if d["reclaimed"] else "") + ")")
    total = plan.get("device_memory_mb")
    mem = plan["memory_estimate"]
    lines += [
        f"  memory            peak {m['peak_memory_mb']:.0f} MB ({mem_kind}) in a training step at micro-batch "
        f"{e['micro_batch']}, {m['peak_memory_all_mb']:.0f} MB with validation and the probe"
        + (f", of {total:.0f} MB" if total else ""),
        f"  GPU memory        estimated {fmt_bytes(mem['fixed'] + e['micro_batch'] * mem['per_sample'])} at micro-batch "
        f"{e['micro_batch']} ({fmt_bytes(mem['fixed'])} for weights, gradients, Adam, EMA and profiles + "
        f"{fmt_bytes(mem['per_sample'])} of activations per sample, {mem['precision']}); on CUDA, training refuses "
        f"a step that does not fit {MEMORY_HEADROOM:.0%} of the free memory",
        f"  step time         {fmt_seconds(m['step_s'])} (median of {plan['measured_steps']} steps after a warm-up step "
        f"of {fmt_seconds(m['first_step_s'])}): {e['effective_batch'] / m['step_s']:.2f} samples/s",
        f"  per event         validation {fmt_seconds(m['validation_s'])}, probe {pred['probe_gradients']} x "
        f"{fmt_seconds(m['probe_gradient_s'])}, checkpoint {fmt_seconds(m.get('checkpoint_write_s', 0))}, snapshot "
        f"{fmt_seconds(m.get('snapshot_write_s', 0))}",
        "  predicted         " + " + ".join(f"{k} {fmt_seconds(v)}" for k, v in pred["parts"].items() if v > 0)
        + f" = {fmt_seconds(pred['total_s'])}",
    ]
    timeout = plan["process_group_timeout_s"]
    share = pred["rank0_longest_s"] / timeout
    lines.append(f"  rank-0 pause      at most {fmt_seconds(pred['rank0_longest_s'])} in one step (validation, probe, "
                 f"snapshot and checkpoint together; other ranks wait in the all-reduce) against a process-group "
                 f"timeout of {fmt_seconds(timeout)}: "
                 + ("ok" if share <= RANK0_TIMEOUT_SHARE else
                    "TOO CLOSE: lower train.gns_bucket_samples / gns_probe_samples or val_draws before using torchrun"))
    stop = pred.get("stop_to_saved")
    if stop:
        parts = stop["parts"]
        lines.append(f"  SIGTERM to saved  at most {fmt_seconds(stop['total_s'])} (a step {fmt_seconds(parts['step'])}"
                     + (f" + a snapshot {fmt_seconds(parts['snapshot'])}" if parts["snapshot"] else "")
                     + f" + the checkpoint, {fmt_bytes(stop['checkpoint_bytes'])} at the end, at "
                     f"{fmt_bytes(stop['write_bytes_per_s'])}/s {fmt_seconds(parts['checkpoint'])}; validation and "
                     f"the probe wait for the resumed run) against the ~{stop['grace_s']:.0f} s torchrun, SLURM and "
                     "Kubernetes allow before SIGKILL: "
                     + ("ok" if stop["total_s"] <= stop["grace_s"] else
                        "TOO LONG: a stop would be killed before its checkpoint is written; put models/ on a faster "
                        "disk or raise the grace (SLURM KillWait, Kubernetes terminationGracePeriodSeconds)"))
    return lines

