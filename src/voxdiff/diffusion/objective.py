"""The training objective and its random draws.

Every per-sample random choice (which subject, timestep, noise) is a pure function of
(seed, global sample index). That is what makes batch 4 x accumulate 1 and batch 1 x accumulate 4
follow the same trajectory, makes a resumed run continue bit for bit, and lets DDP shard samples by
index without changing what any sample sees.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from voxdiff.diffusion.model import one_hot


def stream_seed(*words: int) -> int:
    """A 63-bit seed for one independent random stream, mixed by numpy's SeedSequence."""
    return int(np.random.SeedSequence(list(words)).generate_state(1, np.uint64)[0] >> 1)


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.default_rng(stream_seed(seed, 0x5EED, epoch)).permutation(n)


def subject_for(seed: int, index: int, n: int) -> int:
    """Position (0..n-1) of the training subject that global sample `index` uses: a fresh
    permutation every epoch of n samples, so each subject is seen once per epoch."""
    return int(_epoch_order(seed, index // n, n)[index % n])


def draw(seed: int, index: int, timesteps: int, shape: tuple[int, ...]) -> tuple[int, torch.Tensor]:
    """(timestep, noise) of global sample `index`; noise has `shape` and is drawn on the CPU so that
    CPU and CUDA runs see the same numbers."""
    g = torch.Generator().manual_seed(stream_seed(seed, index))
    t = int(torch.randint(0, timesteps, (1,), generator=g))
    return t, torch.randn(shape, generator=g)


def val_draws(val_seed: int, n_subjects: int, per_subject: int, timesteps: int, shape) -> list[tuple[int, int, torch.Tensor]]:
    """Fixed validation draws: (subject position, timestep, noise), timesteps stratified over the schedule.

    Draw j of subject s gets the stratum (j * n_subjects + s), so every subject covers the whole schedule
    and the draws are identical in every run that shares val_seed and the validation split.
    """
    n = n_subjects * per_subject
    out = []
    for s in range(n_subjects):
        for j in range(per_subject):
            stratum = j * n_subjects + s
            t = min(timesteps - 1, int((stratum + 0.5) * timesteps / n))
            g = torch.Generator().manual_seed(stream_seed(val_seed, 0x7A1, stratum))
            out.append((s, t, torch.randn(shape, generator=g)))
    return out


def probe_draws(seed: int, bucket: int, lo: int, hi: int, count: int, n_subjects: int,
                shape: tuple[int, ...]) -> list[tuple[int, int, torch.Tensor]]:
    """Fixed (subject position, timestep in [lo, hi), noise) draws for the noise-scale probe of one
    timestep bucket: the same in every run with this seed, so buckets are comparable over training."""
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(stream_seed(seed, 0x6B5, bucket, i))
        s = int(torch.randint(0, n_subjects, (1,), generator=g))
        t = int(torch.randint(lo, max(hi, lo + 1), (1,), generator=g))
        out.append((s, t, torch.randn(shape, generator=g)))
    return out


def per_sample_loss(net, inferer, scheduler, images, labels, noise, timesteps, num_classes: int,
                    diffusion_params) -> torch.Tensor:
    """Loss of each sample in the batch, shape [B]: mean over voxels of |pred - target| (l1) or squared,
    times the min-SNR-gamma weight when diffusion.min_snr_gamma > 0."""
    condition = one_hot(labels, num_classes)
    pred = inferer(inputs=images, diffusion_model=net, noise=noise, timesteps=timesteps,
                   condition=condition, mode="concat")
    prediction = diffusion_params.prediction
    if prediction == "epsilon":
        target = noise
    elif prediction == "sample":
        target = images
    else:  # v_prediction
        target = scheduler.get_velocity(images, noise, timesteps)
    err = (pred.float() - target.float())
    err = err.abs() if diffusion_params.loss == "l1" else err.square()
    loss = err.flatten(1).mean(dim=1)
    if diffusion_params.min_snr_gamma > 0:
        loss = loss * min_snr_weight(scheduler, timesteps, prediction, diffusion_params.min_snr_gamma)
    return loss


def min_snr_weight(scheduler, timesteps: torch.Tensor, prediction: str, gamma: float) -> torch.Tensor:
    """Min-SNR-gamma loss weight (Hang et al., ICCV 2023), written for each prediction target so that all
    three equal the x0 *squared* error weighted by min(SNR, gamma): epsilon min(SNR, g)/SNR, sample
    min(SNR, g), v min(SNR, g)/(SNR + 1). It stops the easy low-noise steps from dominating the gradient.
    The equivalence needs the squared error (the targets' errors differ by factors of sqrt(SNR)), so
    params.py refuses min_snr_gamma > 0 with the L1 loss."""
    abar = scheduler.alphas_cumprod.to(timesteps.device)[timesteps].double()
    snr = abar / (1 - abar)
    clipped = torch.clamp(snr, max=gamma)
    weight = {"epsilon": clipped / snr, "sample": clipped, "v_prediction": clipped / (snr + 1)}[prediction]
    return weight.float()


@torch.no_grad()
def validation_loss(net, inferer, scheduler, cache, val_rows, draws, diffusion_params, device,
                    autocast, chunk: int = 4) -> float:
    """Mean loss over fixed validation draws (see val_draws): the convergence signal shared by
    training (EMA weights, each time samples seen crosses a multiple of train.val_every_samples) and
    evaluation."""
    net.eval()
    total = 0.0
    for i in range(0, len(draws), chunk):
        part = draws[i:i + chunk]
        rows = [int(val_rows[s]) for s, _, _ in part]
        images, labels = (torch.from_numpy(a).to(device) for a in cache.stack(rows))
        t = torch.tensor([d[1] for d in part], device=device, dtype=torch.long)
        noise = torch.stack([d[2] for d in part]).to(device)
        with autocast():
            losses = per_sample_loss(net, inferer, scheduler, images, labels, noise, t, cache.num_classes,
                                     diffusion_params)
        total += float(losses.double().sum())
    return total / len(draws)
