"""The training loop: exact gradient accumulation, counted in samples seen (after NVlabs EDM).

Follow `train.accumulate_every`: schedule.plan_budget -> Budget.micro_batches (which samples each
micro-batch holds) -> micro_batch_weight (the line that divides the loss) -> optimizer_step (once
per window: unscale, clip, step, LR, EMA).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import time
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from voxdiff.diffusion import objective

from voxdiff.training import gns, posthoc_ema
from voxdiff.training.best import BestWeights
from voxdiff.data.cache import ProcessedCache
from voxdiff.runtime.distributed import Runtime, all_reduce_sum, peak_memory_mb
from voxdiff.runtime.errors import TrainingDiverged
from voxdiff.diffusion.model import build_inferer, build_network, build_scheduler, enable_activation_checkpointing
# MEASUREMENT_KEYS, OPERATIONAL_KEYS: the train.* keys left out of the fingerprint (one list, read by compare too)
from voxdiff.params import MEASUREMENT_KEYS, OPERATIONAL_KEYS, Params
from voxdiff.training.schedule import Budget, adam_settings, ema_beta, ema_halflife, lr_at, plan_budget


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device copy; on CUDA from pinned memory without blocking, so the copy of the next
    micro-batch's noise (drawn on the CPU: same numbers on CPU and GPU) overlaps the GPU's work."""
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def micro_batch_weight(n_window: int, budget: Budget) -> float:
    """Factor on the *sum* of a micro-batch's per-sample losses.

    Sample-weighted: each sample counts 1/n_window, however the window is cut into micro-batches,
    so a short last window is still exact (dividing by the configured k would not be). DDP averages
    gradients over ranks, hence the world_size factor. The micro-batch's own size is not an argument on
    purpose: a weight that depends on it (mean per micro-batch, then /k) is the classic accumulation bug.
    """
    return budget.world_size / n_window


@dataclasses.dataclass
class Counters:
    """Everything that says where training is; saved in every checkpoint."""
    step: int = 0            # optimizer steps taken (windows consumed)
    samples_seen: int = 0    # global samples consumed
    wall_time: float = 0.0   # seconds spent training, summed over resumes
    skipped_steps: int = 0   # fp16 steps skipped by the GradScaler (overflow)
    ema_updates: int = 0
    history: list = dataclasses.field(default_factory=list)  # one dict per optimizer step
    clipped_steps: int = 0   # optimizer steps whose gradient norm exceeded train.grad_clip
    skipped_in_a_row: int = 0  # consecutive fp16 skips (train.fp16_max_skipped_steps stops a run that never recovers)
    measurement_changes: list = dataclasses.field(default_factory=list)  # {"step", "keys"} per resume that changed them


class Trainer:
    def __init__(self, params: Params, root: Path, rt: Runtime, cache: ProcessedCache):
        self.p, self.root, self.rt, self.cache = params, root, rt, cache
        self.budget = plan_budget(params.train, rt.world_size)
        self.train_rows = cache.training_rows(params.data.train_subjects, params.data.seed)  # data.train_subjects
        self.val_rows = cache.split_indices("val")
        self.num_classes = cache.num_classes
        self.shape = tuple(cache.images.shape[1:])

        torch.manual_seed(params.seed)
        net = build_network(dataclasses.replace(params.model, activation_checkpointing=False), self.num_classes,
                            flash_attention=rt.device.type == "cuda")
        self.net = net.to(rt.device)
        # The EMA copy is taken before activation checkpointing patches the blocks' forward.
        self.ema = AveragedModel(self.net, use_buffers=True)
        self.best = BestWeights(self.ema, params.train.early_stop_patience_samples)  # the run at its own best
        tr = params.train
        self.phema = self._profiles(tr.phema_sigma_rels) if tr.phema_sigma_rels else None
        if params.model.activation_checkpointing:
            enable_activation_checkpointing(self.net)
        self.scheduler = build_scheduler(params.diffusion)
        self.inferer = build_inferer(self.scheduler)
        self.adam = adam_settings(params.train, self.budget.effective_batch)  # after lr_scaling: logged as effective_*
        self.opt = torch.optim.Adam(self.net.parameters(), lr=self.adam.lr, betas=self.adam.betas, eps=self.adam.eps)
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=rt.use_scaler)
        self.gns = gns.GradientNoiseScale(params.train.gns_smoothing)
        self.gns_reason = gns.not_measurable_reason(params.train.accumulate_every, rt.world_size)
        self.counters = Counters()
        self.model = (DistributedDataParallel(self.net) if rt.world_size > 1 else self.net)
        self.local_grad = None
        if rt.world_size > 1 and self.gns_reason is None:
            self.local_grad = LocalGradNorm()
            self.model.register_comm_hook(self.local_grad, LocalGradNorm.hook)
        # train.compile: the training forward/backward only (self.model, after DDP's wrap and hook: no_sync
        # reaches DDP through the wrapper); validation, the probe, the EMA and clipping use self.net. The
        # compile happens in the first step; compile_seconds = that step's time less the second's.
        self.compile_seconds: float | None = None
        self._first_step_s: float | None = None
        if params.train.compile:
            self.model = torch.compile(self.model)
        self.val_set = objective.val_draws(params.train.val_seed, len(self.val_rows), params.train.val_draws,
                                           params.diffusion.timesteps, (1, *self.shape))

    def _profiles(self, sigma_rels) -> posthoc_ema.ProfileTracker:
        """The post-hoc EMA profiles at these lengths, averaging the network being trained."""
        return posthoc_ema.ProfileTracker(self.net, lambda: copy.deepcopy(self.ema.module), tuple(sigma_rels),
                                          self.root / "models" / "phema", self.fingerprint())

    # --- identity ---------------------------------------------------------------------------------
    def fingerprint_parts(self, precision: str | None = None) -> dict[str, str]:
        """What a checkpoint must match to be resumed or to stand as finished, part by part (stored in the
        checkpoint, so that a refusal names what differs): each param that shapes the trajectory (as JSON),
        the data, the world size (it sets the effective batch), the resolved precision (`precision`
        overrides it), each training source file's syntax-tree hash and the torch/MONAI major.minor
        (codehash: a code fix retrains, a comment does not)."""
        from voxdiff.runtime import codehash

        parts = {}
        for section in ("seed", "data", "preprocess", "model", "diffusion", "train"):
            value = self.p.raw[section]
            if not isinstance(value, dict):
                parts[section] = json.dumps(value)
                continue
            for key, v in value.items():
                if section != "train" or key not in MEASUREMENT_KEYS + OPERATIONAL_KEYS:
                    parts[f"{section}.{key}"] = json.dumps(v, sort_keys=True)
        parts["data fingerprint"] = self.cache.fingerprint
        parts["world size"] = str(self.rt.world_size)
        parts["precision"] = precision or self.rt.precision
        parts["libraries"] = codehash.library_versions()
        parts.update({f"code {name}": digest for name, digest in codehash.training_code_hashes().items()})
        return parts

    def fingerprint(self, precision: str | None = None) -> str:
        """The parts in one hash: what post-hoc EMA snapshots are named after (posthoc_ema)."""
        return hashlib.sha256(json.dumps(self.fingerprint_parts(precision), sort_keys=True).encode()).hexdigest()[:16]

    def measurement(self) -> dict:
        """The measurement-only settings in force (MEASUREMENT_KEYS), stored in every checkpoint."""
        return {k: self.p.raw["train"][k] for k in MEASUREMENT_KEYS}

    # --- data -------------------------------------------------------------------------------------
    def batch(self, indices: list[int]):
        """Images, labels, timesteps and noise of the given global sample indices, on the device."""
        n = len(self.train_rows)
        draws = [objective.draw(self.p.seed, i, self.p.diffusion.timesteps, (1, *self.shape)) for i in indices]
        return self.on_device([objective.subject_for(self.p.seed, i, n) for i in indices],
                              [d[0] for d in draws], [d[1] for d in draws])

    def on_device(self, positions: list[int], timesteps: list[int], noises: list[torch.Tensor]):
        """(images, labels, t, noise) on the device for training subjects at these positions in the
        training split, with these timesteps and noises: training batches and the probe's alike."""
        rows = [int(self.train_rows[s]) for s in positions]
        images, labels = (to_device(torch.from_numpy(a), self.rt.device) for a in self.cache.stack(rows))
        t = to_device(torch.tensor(timesteps, dtype=torch.long), self.rt.device)
        return images, labels, t, to_device(torch.stack(noises), self.rt.device)

    def losses(self, model, images, labels, t, noise) -> torch.Tensor:
        with self.rt.autocast():
            return objective.per_sample_loss(model, self.inferer, self.scheduler, images, labels, noise, t,
                                             self.num_classes, self.p.diffusion)

    # --- one optimizer step -----------------------------------------------------------------------
    def train_step(self) -> dict:
        step, budget, rt = self.counters.step, self.budget, self.rt
        window = budget.window(step)
        n_window = len(window)
        micros = budget.micro_batches(step, rt.rank)
        full = n_window == budget.effective_batch
        measure = full and self.gns_reason is None
        probe = GradProbe(self.net) if (measure and rt.world_size == 1) else None
        if self.local_grad is not None:
            self.local_grad.reset()
        scale = self.scaler.get_scale() if rt.use_scaler else 1.0
        loss_sum = torch.zeros((), dtype=torch.float64, device=rt.device)
        t0 = time.perf_counter()
        for j, micro in enumerate(micros):
            last = j == len(micros) - 1
            if not micro and rt.world_size == 1:
                continue  # short last window: nothing left for this micro-batch
            # A rank with nothing left in the last window still runs a zero-weight micro-batch so
            # that DDP's gradient hooks fire the same number of times on every rank.
            indices, weight = (micro, micro_batch_weight(n_window, budget)) if micro else (list(window[:1]), 0.0)
            sync = contextlib.nullcontext() if (last or rt.world_size == 1) else self.model.no_sync()
            with sync:
                per_sample = self.losses(self.model, *self.batch(indices))
                loss = per_sample.sum() * weight
                self.scaler.scale(loss).backward()
            if micro:
                loss_sum += per_sample.detach().sum().double()
            if probe is not None and micro:
                probe.record(weight * len(micro) * scale)
        total_loss, = all_reduce_sum([float(loss_sum)], rt)
        train_loss = total_loss / n_window
        if not math.isfinite(train_loss):
            raise TrainingDiverged(f"training loss is {train_loss} at optimizer step {step + 1} "
                                   f"(samples {window.start}-{window.stop - 1}); the last good checkpoint is kept")
        grad_norm, stepped = self.optimizer_step(n_window)
        if measure and stepped:
            self.update_noise_scale(probe, scale, grad_norm)
        c = self.counters
        c.step += 1
        c.samples_seen += n_window
        elapsed = time.perf_counter() - t0
        c.wall_time += elapsed  # with train.compile, the compile too (compile_seconds says how much)
        if self.p.train.compile and self.compile_seconds is None:
            if self._first_step_s is None:
                self._first_step_s = elapsed
            else:
                self.compile_seconds = max(0.0, self._first_step_s - elapsed)
        return {
            "step": c.step, "samples_seen": c.samples_seen, "wall_time": round(c.wall_time, 4),
            "train_loss": train_loss, "val_loss": None, "lr": self.opt.param_groups[0]["lr"],
            "grad_norm": grad_norm, "samples_per_s": n_window / max(elapsed, 1e-9),
            "clip_fraction": c.clipped_steps / c.step,
            "gns": self.gns.value if self.gns_reason is None else None,
            "gns_grad_sq": self.gns.grad_sq, "gns_trace": self.gns.trace,
            "ema_halflife": ema_halflife(self.p.train, c.samples_seen),
            "peak_memory_mb": peak_memory_mb(rt.device),
        }

    def update_noise_scale(self, probe: GradProbe | None, scale: float, grad_norm: float) -> None:
        """Small/big batch pair of a full window -> the noise scale's |G|^2 and tr(Sigma) estimates.

        One process: each micro-batch's own gradient (B_small = micro-batch) from GradProbe. DDP: each
        rank's local window gradient, read by the comm hook just before the all-reduce (B_small =
        micro-batch x accumulate_every), so world_size x 1 is measurable too. Big = the window's gradient.
        """
        b = self.budget
        if probe is not None:
            total, count = probe.total()
            b_small = b.micro_batch
        else:
            mine = self.local_grad.total() / scale ** 2
            total, count = all_reduce_sum([mine, 1.0], self.rt)
            b_small = b.micro_batch * b.accumulate_every
        if count > 0:
            self.gns.update([total / count], b_small, grad_norm ** 2, b.effective_batch)

    def optimizer_step(self, n_window: int) -> tuple[float, bool]:
        """Once per window: LR, unscale, clip (norm logged before clipping), step, EMA."""
        c, tr = self.counters, self.p.train
        lr = lr_at(tr, self.budget.effective_batch, c.samples_seen + n_window, self.budget.total_samples)
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.scaler.unscale_(self.opt)
        max_norm = tr.grad_clip if tr.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.net.parameters(), max_norm))
        if math.isfinite(grad_norm) and grad_norm > max_norm:
            c.clipped_steps += 1  # clip_fraction: a clip that binds on most steps changes the optimizer
        if not self.rt.use_scaler and not math.isfinite(grad_norm):
            raise TrainingDiverged(f"gradient norm is {grad_norm} at optimizer step {c.step + 1}; "
                                   "the last good checkpoint is kept")
        scale_before = self.scaler.get_scale()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.zero_grad(set_to_none=True)
        stepped = not (self.rt.use_scaler and self.scaler.get_scale() < scale_before)
        if stepped:
            beta = ema_beta(tr, n_window, c.samples_seen + n_window)
            self.ema.multi_avg_fn = get_ema_multi_avg_fn(beta)
            self.ema.update_parameters(self.net)
            if self.phema is not None:
                self.phema.update()
            c.ema_updates += 1
            c.skipped_in_a_row = 0
        else:
            c.skipped_steps += 1  # fp16 overflow: the scaler skipped the step, so EMA and GNS skip it too
            c.skipped_in_a_row += 1
            if c.skipped_in_a_row >= tr.fp16_max_skipped_steps:
                raise TrainingDiverged(
                    f"fp16: the GradScaler skipped {c.skipped_in_a_row} steps in a row (overflow) up to optimizer "
                    f"step {c.step + 1} (train.fp16_max_skipped_steps); the last good checkpoint is kept: use "
                    "train.precision bf16 or fp32, or a lower train.lr")
        return grad_norm, stepped

    # --- validation -------------------------------------------------------------------------------
    def validation_loss(self, net: torch.nn.Module | None = None) -> float:
        """Loss of `net` (default: the EMA model) on the held-out subjects with fixed (t, noise) draws:
        comparable across runs."""
        return objective.validation_loss(self.ema.module if net is None else net, self.inferer, self.scheduler,
                                         self.cache, self.val_rows, self.val_set, self.p.diffusion, self.rt.device,
                                         self.rt.autocast)

    def posthoc_val_losses(self) -> dict:
        """Val loss of the EMA reconstructed at each train.phema_eval_sigma_rels from the snapshots
        (post-hoc EMA), the best of them, and where the fixed EMA sits on that axis."""
        tr, c = self.p.train, self.counters
        out = {"ema_sigma_rel": posthoc_ema.classic_ema_sigma_rel(tr.ema_halflife_samples, c.samples_seen)}
        if self.phema is None or not self.phema.snapshots():
            return out
        rebuilt = self.phema.reconstruct(tr.phema_eval_sigma_rels)  # every snapshot read once for all lengths
        for sigma_rel, net in zip(tr.phema_eval_sigma_rels, rebuilt):
            out[posthoc_ema.metric_name(sigma_rel)] = self.validation_loss(net)
        best = min(tr.phema_eval_sigma_rels, key=lambda s: out[posthoc_ema.metric_name(s)])
        out["phema_best_val_loss"] = out[posthoc_ema.metric_name(best)]
        out["phema_best_sigma_rel"] = best
        return out

    # --- noise scale per timestep bucket ---------------------------------------------------------
    def bucket_noise_scale(self) -> dict:
        """B_simple per timestep bucket (gns_t0 ...: train.gns_bucket_samples draws each) and marginal over
        timesteps (gns_marginal: train.gns_probe_samples draws, timesteps uniform as in training), each with
        a train.gns_ci_level interval (_lo, _hi), from single-sample gradients of the current weights on
        fixed probe draws of training subjects (gns.probe_noise_scale: two passes, at most two gradient
        copies alive, three with Adam's preconditioner), and the marginal one also in Adam's whitened
        coordinates (gns_marginal_adam). The denoising target's variance depends on the noise level, so
        one B_noise per run averages over very different problems. Touches neither .grad, the optimizer nor any RNG
        (training stays bit for bit the same with the probe on or off)."""
        tr = self.p.train
        return gns.probe_noise_scale(self.sample_gradient, self.p.seed, self.p.diffusion.timesteps, tr.gns_buckets,
                                     tr.gns_bucket_samples, tr.gns_probe_samples, len(self.train_rows),
                                     (1, *self.shape), tr.gns_ci_level,
                                     gns.adam_preconditioner(self.opt, self.trainable()))

    def trainable(self) -> list:
        return [q for q in self.net.parameters() if q.requires_grad]

    def sample_gradient(self, position: int, t: int, noise: torch.Tensor):
        """One training sample's loss gradient at the current (raw) weights, one tensor per trainable
        parameter; touches neither .grad, the optimizer nor any RNG. In fp16 the loss is scaled by the
        GradScaler's scale as in training (small gradients would underflow otherwise) and divided out."""
        loss = self.losses(self.net, *self.on_device([position], [t], [noise])).sum()
        if not self.rt.use_scaler:
            return torch.autograd.grad(loss, self.trainable())
        scale = self.scaler.get_scale()
        return tuple(g / scale for g in torch.autograd.grad(loss * scale, self.trainable()))

    def gradient_moments(self, count: int) -> gns.GradientMoments:
        """Per-coordinate mean and mean square of `count` single-sample gradients on fixed draws (their
        own stream, timesteps uniform as in training) of training subjects."""
        from voxdiff.diffusion.objective import probe_draws

        draws = probe_draws(self.p.seed, gns.MOMENT_STREAM, 0, self.p.diffusion.timesteps, count,
                            len(self.train_rows), (1, *self.shape))
        return gns.gradient_moments(lambda i: self.sample_gradient(*draws[i]), count)

    def move_adam_second_moment(self, moments: gns.GradientMoments, trained_batch: int) -> None:
        """Move Adam's second moment from the batch it was trained at to this trainer's effective batch
        (moments.move_second_moment with train.grad_clip: the sampling noise's share shifts, the
        trajectory's history stays). A restored state carries ~1/(1 - beta2) steps (1000 at 0.999) of the
        trained batch's squared gradients, which a short branch cannot forget. The step count is kept, and
        exp_avg_sq scaled with v_hat by the same bias correction (torch's Adam adds 1 to the step before it
        corrects by 1 - beta2^step). One process only (every rank would measure its own moments and the
        replicas' optimizer states would drift apart).

        Not a replacement by the moment measured here: on the study's model that made Adam's steps 11-25x
        longer and the branches' val loss rose (benchmarks/advise_vs_study), v being mostly the trajectory's
        history there."""
        if self.rt.world_size > 1:
            raise RuntimeError("move_adam_second_moment runs in one process (advise), not under torchrun")
        beta2 = self.opt.param_groups[0]["betas"][1]
        params = [p for p in self.trainable() if "exp_avg_sq" in self.opt.state.get(p, {})]
        if len(params) != len(self.trainable()):
            raise RuntimeError("Adam has no second moment for some parameters: nothing to move")
        states = [self.opt.state[p] for p in params]
        bias = [1.0 - beta2 ** float(st["step"]) for st in states]
        v_hat = [st["exp_avg_sq"] / c for st, c in zip(states, bias)]
        moved = moments.move_second_moment(v_hat, self.budget.effective_batch, trained_batch, self.p.train.grad_clip)
        for st, v, c in zip(states, moved, bias):
            st["exp_avg_sq"].copy_(v * c)

    # --- checkpoints ------------------------------------------------------------------------------
    def state(self, finished: bool, run_id: str | None) -> dict:
        c = self.counters
        return {
            "fingerprint": self.fingerprint(), "fingerprint_parts": self.fingerprint_parts(), "finished": finished,
            "precision_resolved": self.rt.precision, "measurement": self.measurement(),
            "clipped_steps": c.clipped_steps, "skipped_in_a_row": c.skipped_in_a_row,
            "measurement_changes": c.measurement_changes,
            "step": c.step, "samples_seen": c.samples_seen, "wall_time": c.wall_time,
            "skipped_steps": c.skipped_steps, "ema_updates": c.ema_updates, "history": c.history,
            "model": self.net.state_dict(), "ema": self.ema.state_dict(),
            "optimizer": self.opt.state_dict(), "scaler": self.scaler.state_dict(),
            "gns": self.gns.state_dict(), "mlflow_run_id": run_id or "",
            "phema": self.phema.state_dict() if self.phema is not None else {},
            "best": self.best.state_dict(),  # the EMA weights at the run's own best (training/best.py)
            "num_classes": self.num_classes, "shape": list(self.shape),
            "params": {k: self.p.raw[k] for k in ("seed", "model", "diffusion", "preprocess")},
            "label_values": list(self.cache.label_values),
        }

    def restore(self, state: dict) -> None:
        self.net.load_state_dict(state["model"])
        self.ema.load_state_dict(state["ema"])
        self.opt.load_state_dict(state["optimizer"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.gns.load_state_dict(state["gns"])
        # The run keeps the post-hoc EMA profiles it started with, none included (train.phema_sigma_rels is
        # measurement-only: posthoc_ema.ProfileTracker.load_state_dict says why).
        if not state["phema"]:
            self.phema = None
        elif self.phema is None and state["phema"].get("sigma_rels"):
            self.phema = self._profiles(state["phema"]["sigma_rels"])
        if self.phema is not None:
            self.phema.load_state_dict(state["phema"])
        self.best.load_state_dict(state.get("best"))
        self.counters = Counters(state["step"], state["samples_seen"], state["wall_time"],
                                 state["skipped_steps"], state["ema_updates"], list(state["history"]),
                                 state["clipped_steps"], state["skipped_in_a_row"],
                                 list(state["measurement_changes"]))


class GradProbe:
    """|g_j|^2 of each micro-batch's own mean-loss gradient, for the gradient noise scale.

    The running .grad holds the sum over earlier micro-batches, so g_j is the difference between
    .grad after and before micro-batch j, divided by the factor that micro-batch's loss carried.
    Everything stays on the device: the copy of .grad goes into buffers allocated once, and the sum
    of squared norms is a device tensor read once per optimizer step (`total`), not once per
    parameter tensor per micro-batch (a host sync each on a GPU).
    """

    def __init__(self, net: torch.nn.Module):
        self.params = [p for p in net.parameters() if p.requires_grad]
        self.before: list[torch.Tensor] | None = None
        self.sq_sum: torch.Tensor | None = None
        self.count = 0

    @torch.no_grad()
    def record(self, loss_factor: float) -> None:
        now = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        diff = now if self.before is None else torch._foreach_sub(now, self.before)
        norms = torch._foreach_norm(diff)
        sq = torch.stack([n.double() for n in norms]).square().sum() / loss_factor ** 2
        self.sq_sum = sq if self.sq_sum is None else self.sq_sum + sq
        self.count += 1
        if self.before is None:
            self.before = [g.clone() for g in now]
        else:
            torch._foreach_copy_(self.before, now)

    def total(self) -> tuple[float, int]:
        """(sum of the micro-batches' |g_j|^2, how many): the step's one host read."""
        return (float(self.sq_sum) if self.sq_sum is not None else 0.0), self.count


class LocalGradNorm:
    """DDP comm hook state: |g_rank|^2 of this rank's local (accumulated) gradient, summed over DDP's
    buckets just before each is all-reduced; kept on the device until the step reads it."""

    def __init__(self):
        self.sq: torch.Tensor | None = None

    def reset(self) -> None:
        self.sq = None

    def total(self) -> float:
        return float(self.sq) if self.sq is not None else 0.0

    @staticmethod
    def hook(state: "LocalGradNorm", bucket):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        sq = bucket.buffer().double().square().sum()
        state.sq = sq if state.sq is None else state.sq + sq
        return default_hooks.allreduce_hook(None, bucket)


def due(step: int, every: int, last: int) -> bool:
    return step % every == 0 or step == last
