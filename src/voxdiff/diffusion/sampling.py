"""Sampling with a trained checkpoint's EMA weights: shared by `evaluate`, `sample` and the benchmarks.

Two samplers, both through MONAI's DiffusionInferer.sample in "concat" mode (noisy image + one-hot label
map, as in training):
  ddim       ScheduleDDIM (MONAI's DDIMScheduler, each step moving to the next scheduled timestep), eta 0
             (deterministic given the initial noise), `steps` steps from T-1 down to 0
  ancestral  DDPMScheduler, the full chain of diffusion.timesteps stochastic steps

Seeding: volume k of subject s starts from noise drawn by a torch.Generator seeded from (seed, s, k);
the ancestral sampler's per-step noise comes from torch's global RNG (MONAI's DDPMScheduler.step gets no
generator from the inferer), so that RNG is seeded from the same words inside torch.random.fork_rng
(the caller's RNG state is left untouched). Every volume is sampled on its own, so a volume does not
depend on how many others are sampled with it: same checkpoint + seed -> identical volumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from typing import Sequence

import torch

from voxdiff.diffusion.objective import stream_seed
from voxdiff.runtime.distributed import peak_memory_mb
from voxdiff.runtime.errors import ParamsError, VoxdiffError
from voxdiff.params import SCHEMA, Diffusion, Model, Preprocess

SAMPLERS = ("ddim", "ancestral")
_NOISE, _STEPS = 0x5A3, 0xA7C  # stream tags: initial noise, ancestral per-step noise


def _stored_section(state: dict, section: str, source) -> dict:
    """The raw params section a checkpoint stores, or one line naming `source`."""
    raw = state.get("params")
    if not isinstance(raw, dict) or not isinstance(raw.get(section), dict):
        raise VoxdiffError(f"{source}: not a voxdiff training checkpoint (no params.{section} stored in it)")
    return raw[section]


def checkpoint_section(state: dict, section: str, cls, source) -> object:
    """A typed params section (model, diffusion, preprocess) from the raw params a checkpoint stores,
    checked with the same rules as params.yaml."""
    stored = _stored_section(state, section, source)
    spec = SCHEMA[section]
    try:
        missing = [k for k in spec if k not in stored]
        if missing:
            raise ParamsError(f"missing {section}.{missing[0]}")
        return cls(**{k: check(f"{section}.{k}", stored[k]) for k, check in spec.items()})
    except ParamsError as e:
        raise VoxdiffError(f"{source}: the stored training params are invalid ({str(e).removeprefix('params.yaml: ')})") from None


def checkpoint_preprocess(state: dict, source="checkpoint") -> Preprocess:
    return checkpoint_section(state, "preprocess", Preprocess, source)


def check_training_checkpoint(state: dict, source="checkpoint") -> None:
    """The keys sampling needs (EMA weights, class count, stored params), each problem one line naming `source`."""
    if not isinstance(state, dict) or not isinstance(state.get("ema"), dict) or not state["ema"]:
        raise VoxdiffError(f"{source}: not a voxdiff training checkpoint (no EMA weights in it)")
    classes = state.get("num_classes")
    if isinstance(classes, bool) or not isinstance(classes, int) or classes < 2:
        raise VoxdiffError(f"{source}: num_classes {classes!r} is not a class count; not a voxdiff checkpoint")
    for section in ("model", "diffusion", "preprocess"):
        _stored_section(state, section, source)


PRECISIONS = ("fp32", "bf16", "fp16")


def checkpoint_runtime(state: dict, device, fallback: str = "auto", source="checkpoint"):
    """A Runtime whose autocast is the training's precision, for sampling with a checkpoint.

    The network's numbers depend on it (bf16 autocast gives other volumes than fp32), so `voxdiff sample`
    must use what `evaluate` uses: the precision training resolved (the checkpoint's precision_resolved),
    else `fallback` (params.yaml's train.precision, checked already) resolved on `device`, as evaluate
    resolves it."""
    from voxdiff.runtime.distributed import Runtime, pick_precision

    device = torch.device(device)
    resolved = state.get("precision_resolved") or fallback
    if resolved not in PRECISIONS + ("auto",):
        raise VoxdiffError(f"{source}: precision_resolved {resolved!r} is not one of {', '.join(PRECISIONS)}; "
                           "not a usable voxdiff checkpoint")
    return Runtime(device, 0, 1, pick_precision(resolved, device), False)


def checkpoint_label_values(state: dict, source="checkpoint") -> list[int]:
    check_training_checkpoint(state, source)
    values = state.get("label_values")
    if (not isinstance(values, (list, tuple)) or len(values) != state["num_classes"]
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in values)):
        raise VoxdiffError(f"{source}: label_values {values!r} do not match num_classes "
                           f"{state['num_classes']}; not a usable voxdiff checkpoint")
    return [int(v) for v in values]


def load_ema_network(ckpt_state: dict, device, source="checkpoint", num_classes: int | None = None):
    """(network with the EMA weights in eval mode on `device`, Model params, Diffusion params).

    The network is built from the checkpoint's own stored params (not params.yaml), so a checkpoint
    keeps working after params.yaml changed. `num_classes`, when given, is what the caller's label maps
    hold; a checkpoint trained for another number of classes is refused. Any mismatch raises a
    one-line VoxdiffError naming `source` (the checkpoint file).
    """
    from voxdiff.diffusion.model import build_network

    check_training_checkpoint(ckpt_state, source)
    model = checkpoint_section(ckpt_state, "model", Model, source)
    diffusion = checkpoint_section(ckpt_state, "diffusion", Diffusion, source)
    classes = ckpt_state["num_classes"]
    if num_classes is not None and num_classes != classes:
        raise VoxdiffError(f"{source}: trained for {classes} label classes, but the label maps here have "
                           f"{num_classes}; use a checkpoint trained on this data")
    # Inference never needs activation checkpointing (it only trades memory in backward).
    net = build_network(dataclasses.replace(model, activation_checkpointing=False), classes,
                        flash_attention=torch.device(device).type == "cuda")
    weights = {k[len("module."):]: v for k, v in ckpt_state["ema"].items() if k.startswith("module.")}
    if not weights:
        raise VoxdiffError(f"{source}: no EMA weights of a network in its EMA state (keys module.*)")
    try:
        net.load_state_dict(weights, strict=True)
    except RuntimeError as e:
        detail = " ".join(str(e).split())
        raise VoxdiffError(f"{source}: the EMA weights do not fit the stored model params and "
                           f"num_classes={classes} ({detail[:160]}...)") from None
    return net.to(device).eval(), model, diffusion


def as_one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[B, D, H, W] class indices (or [D, H, W]) or [B, C, D, H, W] one-hot -> [B, C, D, H, W] float."""
    from voxdiff.diffusion.model import one_hot

    labels = torch.as_tensor(labels)
    if labels.dtype.is_floating_point and labels.ndim == 5:
        if labels.shape[1] != num_classes:
            raise VoxdiffError(f"one-hot label maps have {labels.shape[1]} channels, the network expects {num_classes}")
        return labels.float()
    if labels.ndim == 3:
        labels = labels[None]
    if labels.ndim != 4:
        raise VoxdiffError(f"label maps must be [B, D, H, W] class indices or [B, C, D, H, W] one-hot, "
                           f"got shape {tuple(labels.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise VoxdiffError(f"label maps hold class indices {int(labels.min())}..{int(labels.max())}, "
                           f"the network knows 0..{num_classes - 1}")
    return one_hot(labels, num_classes)


@functools.cache  # one class; MONAI is imported when a sampler is built, as the network is
def _schedule_ddim():
    from monai.networks.schedulers import DDIMScheduler

    class ScheduleDDIM(DDIMScheduler):
        """MONAI's DDIMScheduler whose step goes from timesteps[i] to timesteps[i + 1], the last one to the
        clean image (final_alpha_cumprod).

        MONAI 1.6.1 places the timesteps by linspace(T - 1, 0, n).round() (PR Project-MONAI/MONAI#8623, the
        fix of issue #8600) but its step() still moves to t - T // n, the rule of the evenly spaced timesteps
        that PR replaced: when T // n is not the spacing, the image handed to the network at timesteps[i + 1]
        was made for another noise level (T = 250, 50 steps: 4 of 49 transitions, e.g. 219 -> 214 while the
        next evaluation is at 213; T = 1000/50: 19 of 49; T = 50, 7 steps: all 6). We found no MONAI issue
        about it; diffusers has the same mismatch for its "linspace" spacing (huggingface/diffusers#12633), and
        its DDPMScheduler.previous_timestep takes the next entry of the list, as this does. We keep MONAI's
        placement rather than the old "leading" range(0, T, T // n): that one starts at 980 of 1000 (for 50
        steps), not at T - 1 where the initial noise is; MONAI's change was made for exactly that.
        """

        def set_timesteps(self, num_inference_steps: int, device=None) -> None:
            super().set_timesteps(num_inference_steps, device)
            ts = [int(t) for t in self.timesteps]
            self.previous = dict(zip(ts, ts[1:] + [-1]))  # -1: the clean image

        def previous_timestep(self, timestep) -> int:
            t = int(timestep)
            if t not in self.previous:
                raise ValueError(f"timestep {t} is not one of the {len(self.previous)} scheduled DDIM timesteps")
            return self.previous[t]

        eta = 0.0  # DDIM's eta when step() is given none (MONAI's inferer never passes one): 0 = deterministic

        def step(self, model_output, timestep, sample, eta: float | None = None, generator=None):
            """MONAI's DDIMScheduler.step (formulas 12 and 16 of the DDIM paper) with prev = the next
            scheduled timestep; MONAI's step has no argument for it, so its body is restated here. eta > 0
            adds fresh noise at each step (eta 1: the variance of the ancestral sampler's posterior)."""
            eta = self.eta if eta is None else eta
            prev = self.previous_timestep(timestep)
            a_t = self.alphas_cumprod[int(timestep)]
            a_prev = self.alphas_cumprod[prev] if prev >= 0 else self.final_alpha_cumprod
            if self.prediction_type == "epsilon":
                x0 = (sample - (1 - a_t) ** 0.5 * model_output) / a_t ** 0.5
                eps = model_output
            elif self.prediction_type == "sample":
                x0 = model_output
                eps = (sample - a_t ** 0.5 * x0) / (1 - a_t) ** 0.5
            else:  # v_prediction
                x0 = a_t ** 0.5 * sample - (1 - a_t) ** 0.5 * model_output
                eps = a_t ** 0.5 * model_output + (1 - a_t) ** 0.5 * sample
            if self.clip_sample:
                x0 = torch.clamp(x0, *self.clip_sample_values)
            std = eta * self._get_variance(int(timestep), prev) ** 0.5
            prev_sample = a_prev ** 0.5 * x0 + (1 - a_prev - std ** 2) ** 0.5 * eps
            if eta > 0:
                noise = torch.randn(model_output.shape, dtype=model_output.dtype, generator=generator,
                                    device=model_output.device)
                prev_sample = prev_sample + std * noise
            return prev_sample, x0

    return ScheduleDDIM


def ddim_scheduler(diffusion: Diffusion, steps: int, eta: float = 0.0):
    """The DDIM scheduler of the samplers (see ScheduleDDIM), `steps` capped at diffusion.timesteps."""
    ddim = _schedule_ddim()(num_train_timesteps=diffusion.timesteps, schedule=diffusion.schedule,
                            prediction_type=diffusion.prediction, clip_sample=True)
    ddim.set_timesteps(min(steps, diffusion.timesteps))
    ddim.eta = eta
    return ddim


def make_scheduler(diffusion: Diffusion, sampler: str, steps: int, eta: float = 0.0):
    from voxdiff.diffusion.model import build_scheduler

    if sampler == "ddim":
        return ddim_scheduler(diffusion, steps, eta)
    if sampler == "ancestral":
        return build_scheduler(diffusion)  # timesteps = the full training chain
    raise VoxdiffError(f"sampler must be one of {', '.join(SAMPLERS)}, not {sampler!r}")


def initial_noise(seed: int, subject: int, sample_index: int, shape: Sequence[int]) -> torch.Tensor:
    """The starting noise [1, 1, *shape] of volume `sample_index` of `subject` (drawn on the CPU so that
    CPU and CUDA start from the same numbers)."""
    g = torch.Generator().manual_seed(stream_seed(seed, _NOISE, subject, sample_index))
    return torch.randn((1, 1, *shape), generator=g)


class _StepCounter:
    """Calls the network (under the training's autocast) and ticks a progress bar once per denoising
    step (the inferer owns the loop). The scheduler's update stays in fp32."""

    def __init__(self, net, bar, autocast=None):
        self.net, self.bar, self.autocast = net, bar, autocast or contextlib.nullcontext

    def __call__(self, x, timesteps, context=None):
        with self.autocast():
            out = self.net(x, timesteps=timesteps, context=context).float()
        if self.bar is not None:
            self.bar.update(1)
        return out


@torch.no_grad()
def generate(net, diffusion_params: Diffusion, labels_onehot_or_indices, num_classes: int, steps: int, seed: int,
             sampler: str = "ddim", progress: bool = True, subject: int = 0, sample_index: int = 0,
             record: list | None = None, autocast=None, eta: float = 0.0) -> torch.Tensor:
    """Sample one volume per label map: returns [B, 1, D, H, W] float32 on the CPU, in [-1, 1].

    Volume b is seeded by (seed, subject, sample_index + b). `steps` is the DDIM step count; the
    ancestral sampler always runs all diffusion.timesteps steps. `record`, when a list, receives one
    dict per volume: {"seconds", "peak_memory_mb", "steps", "sampler"}. `autocast`, when given, is a
    context factory for the network calls (Runtime.autocast: bf16 where training used it).

    DDIM (eta 0) is deterministic given its starting noise, so the whole batch runs in one network
    call per step: on the CPU a batch of 2 is ~3x faster per volume than 2 batches of 1 (PyTorch picks
    a slow convolution path for small batch-1 3D inputs). The ancestral sampler, and DDIM with `eta` > 0,
    draw fresh noise from the global RNG at every step, so they run volume by volume, the RNG seeded by
    (seed, subject, volume), to keep each volume's draws its own.
    """
    if not 0.0 <= eta <= 1.0:
        raise VoxdiffError(f"DDIM eta must be in [0, 1], not {eta}")
    condition = as_one_hot(labels_onehot_or_indices, num_classes)
    stochastic = sampler == "ancestral" or eta > 0
    groups = [[b] for b in range(condition.shape[0])] if stochastic else [list(range(condition.shape[0]))]
    out = [_sample_group(net, diffusion_params, condition, group, steps, seed, sampler, progress, subject,
                         sample_index, record, autocast, eta) for group in groups]
    return torch.cat(out)


def _sample_group(net, diffusion_params, condition, group, steps, seed, sampler, progress, subject, sample_index,
                  record, autocast, eta):
    from voxdiff.diffusion.model import build_inferer

    device = next(net.parameters()).device
    shape = tuple(condition.shape[2:])
    ks = [sample_index + b for b in group]
    scheduler = make_scheduler(diffusion_params, sampler, steps, eta)  # fresh: schedulers keep state
    inferer = build_inferer(scheduler)
    n_steps = len(scheduler.timesteps)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=n_steps, unit="step", leave=False, dynamic_ncols=True,
                   desc=f"{sampler} subject {subject} sample{'s' if len(ks) > 1 else ''} {','.join(map(str, ks))}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    devices = [device] if device.type == "cuda" else []
    t0 = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=devices):
            if sampler == "ancestral" or eta > 0:
                torch.manual_seed(stream_seed(seed, _STEPS, subject, ks[0]))
            noise = torch.cat([initial_noise(seed, subject, k, shape) for k in ks]).to(device)
            volume = inferer.sample(input_noise=noise, diffusion_model=_StepCounter(net, bar, autocast),
                                    scheduler=scheduler, conditioning=condition[group].to(device),
                                    mode="concat", verbose=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        if bar is not None:
            bar.close()
    seconds = (time.perf_counter() - t0) / len(group)
    if record is not None:
        record.extend({"seconds": seconds, "peak_memory_mb": peak_memory_mb(device), "steps": n_steps,
                       "sampler": sampler, "eta": eta if sampler == "ddim" else None} for _ in group)
    return volume.float().clamp(-1, 1).cpu()
