"""Simple gradient noise scale B_simple = tr(Sigma) / |G|^2 (McCandlish et al. 2018, App. A).

Gradient accumulation gives two batch sizes per optimizer step for free: each micro-batch's own
gradient (B_small) and the accumulated window gradient (B_big). Since E|G_B|^2 = |G|^2 + tr(Sigma)/B,
the pair gives unbiased estimates of |G|^2 and tr(Sigma). Each is smoothed with its own EMA and the
noise scale is the ratio of the EMAs: the mean of per-step ratios is badly biased, because the per-step
|G|^2 estimate is very noisy and often near zero or negative.

The probe (probe_noise_scale, run by Trainer.bucket_noise_scale every train.gns_buckets_every_samples)
measures B_simple at the current weights from single-sample gradients on fixed draws, per timestep bucket
and marginally over timesteps, each with a confidence interval (jackknife + Fieller), in two passes that
keep at most two gradient copies alive (two_pass_estimate).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence


class GradientNoiseScale:
    """EMA-smoothed estimator, fed once per optimizer step (never per micro-batch)."""

    def __init__(self, beta: float = 0.99):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        self.beta = float(beta)
        self._grad_sq_ema = 0.0
        self._trace_ema = 0.0
        self._steps = 0
        # Product of the betas of every update so far: the bias correction divides by 1 - it, which stays
        # exact when train.gns_smoothing changes at a resume (beta ** steps would not).
        self._decay = 1.0

    def update(self, small_sq_norms: Sequence[float], b_small: float, big_sq_norm: float,
               b_big: float) -> None:
        """One optimizer step: |g_j|^2 of each micro-batch's mean-loss gradient, and |G_big|^2 of the window.

        A window without a small/big pair (b_big <= b_small, e.g. a one-micro-batch tail) is skipped.
        Non-finite inputs are skipped too: one NaN would poison the EMA for the rest of training.
        """
        if b_big <= b_small or not small_sq_norms:
            return
        small_sq = math.fsum(small_sq_norms) / len(small_sq_norms)
        if not (math.isfinite(small_sq) and math.isfinite(big_sq_norm)):
            return
        grad_sq = (b_big * big_sq_norm - b_small * small_sq) / (b_big - b_small)
        trace = (small_sq - big_sq_norm) / (1.0 / b_small - 1.0 / b_big)
        self._grad_sq_ema = self.beta * self._grad_sq_ema + (1.0 - self.beta) * grad_sq
        self._trace_ema = self.beta * self._trace_ema + (1.0 - self.beta) * trace
        self._steps += 1
        self._decay *= self.beta

    def _debiased(self, ema: float) -> float | None:
        # Adam-style bias correction: the EMA starts at 0, so early values would be shrunk towards it.
        return ema / (1.0 - self._decay) if self._steps else None

    @property
    def grad_sq(self) -> float | None:
        """Smoothed |G|^2 (None before the first measurable step)."""
        return self._debiased(self._grad_sq_ema)

    @property
    def trace(self) -> float | None:
        """Smoothed tr(Sigma), the per-sample gradient variance summed over parameters."""
        return self._debiased(self._trace_ema)

    @property
    def value(self) -> float | None:
        """B_simple = tr(Sigma)/|G|^2, or None when not measurable (no pair yet, or a non-positive EMA)."""
        g, t = self.grad_sq, self.trace
        if g is None or g <= 0.0 or t <= 0.0:
            return None
        return t / g

    @property
    def steps(self) -> int:
        """Number of measurable updates so far."""
        return self._steps

    def state_dict(self) -> dict:
        # Plain floats/ints only: checkpoints are read with torch.load(weights_only=True).
        return {"beta": self.beta, "grad_sq_ema": float(self._grad_sq_ema),
                "trace_ema": float(self._trace_ema), "steps": int(self._steps), "decay": float(self._decay)}

    def load_state_dict(self, state: dict) -> None:
        missing = {"beta", "grad_sq_ema", "trace_ema", "steps"} - set(state)
        if missing:
            raise KeyError(f"gradient noise scale state lacks {sorted(missing)}")
        # self.beta stays the one configured now: train.gns_smoothing is measurement-only, so a changed
        # value applies from the resume on (the checkpoint's beta only rebuilds an older state's decay).
        self._grad_sq_ema = float(state["grad_sq_ema"])
        self._trace_ema = float(state["trace_ema"])
        self._steps = int(state["steps"])
        self._decay = float(state.get("decay", float(state["beta"]) ** self._steps))


def not_measurable_reason(accumulate_every: int, world_size: int) -> str | None:
    """Why the noise scale cannot be measured with this setting, or None when it can."""
    # DDP with accumulate_every 1 is measurable: each rank's local gradient (read before the
    # all-reduce by a comm hook) is the small batch, the all-reduced gradient the big one.
    if accumulate_every * world_size <= 1:
        return (f"accumulate_every x world_size = {accumulate_every * world_size}: no small/big batch "
                "pair, gradient noise scale not measurable")
    return None


@dataclasses.dataclass(frozen=True)
class Tradeoff:
    batch: float
    steps_over_min: float    # S / S_min = 1 + B_crit / B
    samples_over_min: float  # E / E_min = 1 + B / B_crit


def critical_batch_tradeoff(b_noise: float, batch_sizes: Sequence[float]) -> list[Tradeoff]:
    """Steps and samples needed relative to their minimum at each batch size, with B_crit ~ B_noise."""
    if not b_noise > 0:
        raise ValueError(f"noise scale must be positive, got {b_noise}")
    return [Tradeoff(float(b), 1.0 + b_noise / b, 1.0 + b / b_noise) for b in batch_sizes]


def balanced_accumulate_every(b_noise: float, micro_batch: int, world_size: int = 1) -> int:
    """accumulate_every whose effective batch is nearest B_crit ~ B_noise, as a power of two >= 1.

    At B = B_crit both steps and samples are twice their minimum: the knee of the tradeoff.
    """
    if not b_noise > 0:
        raise ValueError(f"noise scale must be positive, got {b_noise}")
    k = b_noise / (micro_batch * world_size)
    return 1 if k <= 1 else 2 ** round(math.log2(k))


# --- noise scale per timestep bucket ---------------------------------------------------------------
def b_simple_from_gram(gram) -> tuple[float, float, float]:
    """(B_simple, tr(Sigma), |G|^2) from the Gram matrix of n single-sample gradients g_i (the reference
    for tests; the trainer's probe streams, see two_pass_estimate: a Gram matrix needs every gradient kept).

    Unbiased: |G|^2 = mean over i != j of <g_i, g_j> (independent samples), tr(Sigma) = mean |g_i|^2 - |G|^2.
    B_simple is NaN when the |G|^2 estimate is not positive (the gradient is lost in the noise).
    """
    import numpy as np

    gram = np.asarray(gram, np.float64)
    n = gram.shape[0]
    if n < 2:
        raise ValueError("need at least 2 gradients")
    diag = float(np.trace(gram)) / n
    off = (float(gram.sum()) - float(np.trace(gram))) / (n * (n - 1))
    trace = diag - off
    return (trace / off if off > 0 else float("nan")), trace, off


def jackknife_se(gram) -> float:
    """Jackknife standard error of B_simple over the n samples (leave one out), from the full Gram
    matrix: the reference the streaming probe (estimate_from_moments) is checked against. NaN when any
    leave-one-out estimate is undefined."""
    import numpy as np

    gram = np.asarray(gram, np.float64)
    n = gram.shape[0]
    if n < 3:
        return float("nan")
    keep = [np.delete(np.arange(n), i) for i in range(n)]
    values = np.array([b_simple_from_gram(gram[np.ix_(k, k)])[0] for k in keep])
    if not np.isfinite(values).all():
        return float("nan")
    return float(np.sqrt((n - 1) / n * np.sum((values - values.mean()) ** 2)))


def bucket_edges(timesteps: int, buckets: int) -> list[tuple[int, int]]:
    """[lo, hi) timestep ranges of equal width; bucket 0 holds the least noisy timesteps."""
    cuts = [round(i * timesteps / buckets) for i in range(buckets + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(buckets)]


# --- the single-sample probe: B_simple with a confidence interval, in bounded memory -----------------
# probe_draws "bucket" tag of the marginal probe's draws: its own stream, apart from buckets 0..gns_buckets-1.
MARGINAL_STREAM = 0x3A46


@dataclasses.dataclass(frozen=True)
class ProbeEstimate:
    """B_simple = tr(Sigma)/|G|^2 from n single-sample gradients, with a `level` confidence interval.

    grad_sq is the U-statistic mean_{i != j} g_i.g_j and trace the sample variance summed over
    parameters: both unbiased. Their jackknife covariance gives a Fieller interval for the ratio
    (exact for a ratio of normal estimates; it is bounded only when |G|^2 is resolved).

    resolved: |G|^2's interval lies above 0. Otherwise the gradient is lost in the noise at this n:
    value and hi are None (B may be infinite) and lo is a lower bound on B (0.0 when even that is
    uninformative), never a number to plot as B.
    """
    n: int                      # finite single-sample gradients used
    dropped: int                # gradients with inf/NaN, left out
    level: float
    grad_sq: float | None = None
    grad_sq_se: float | None = None
    trace: float | None = None
    value: float | None = None  # B_simple, only when resolved
    lo: float | None = None     # lower end of the interval (a lower bound when not resolved)
    hi: float | None = None     # upper end; None = unbounded (not resolved)
    se: float | None = None     # delta-method SE of B from the jackknife covariance, only when resolved

    @property
    def resolved(self) -> bool:
        return self.value is not None

    def record(self, prefix: str) -> dict:
        """History keys of one probe group: prefix (B), prefix_lo/_hi, _grad_sq, _trace, _se, _dropped."""
        return {prefix: self.value, f"{prefix}_lo": self.lo, f"{prefix}_hi": self.hi,
                f"{prefix}_grad_sq": self.grad_sq, f"{prefix}_trace": self.trace, f"{prefix}_se": self.se,
                f"{prefix}_dropped": self.dropped}


def estimate_from_moments(q, d, s_sq: float, level: float = 0.9, dropped: int = 0) -> ProbeEstimate:
    """ProbeEstimate from the scalars the two-pass probe keeps: q_i = |g_i|^2, d_i = g_i.S and
    s_sq = |S|^2, with S = sum_i g_i. Nothing else is needed, the jackknife included:
      |G|^2 = (|S|^2 - sum q) / (n (n-1)),   tr(Sigma) = (sum q - |S|^2 / n) / (n - 1),
    and leaving sample i out gives |S - g_i|^2 = |S|^2 - 2 d_i + q_i exactly.
    """
    import numpy as np
    from scipy import stats

    q, d = np.asarray(q, np.float64), np.asarray(d, np.float64)
    n = len(q)
    if n < 3 or not (np.isfinite(q).all() and np.isfinite(d).all() and math.isfinite(s_sq)):
        return ProbeEstimate(n, dropped, level)
    total_q = float(q.sum())
    grad_sq = (s_sq - total_q) / (n * (n - 1))
    trace = (total_q - s_sq / n) / (n - 1)
    m = n - 1  # leave-one-out
    q_out, s_out = total_q - q, s_sq - 2.0 * d + q
    loo = np.stack([(q_out - s_out / m) / (m - 1), (s_out - q_out) / (m * (m - 1))])  # rows: trace, |G|^2
    dev = loo - loo.mean(axis=1, keepdims=True)
    cov = (n - 1) / n * (dev @ dev.T)
    v_tt, v_tu, v_uu = float(cov[0, 0]), float(cov[0, 1]), float(cov[1, 1])
    z = float(stats.t.ppf(0.5 + level / 2.0, n - 1))
    lo, hi, resolved = fieller(trace, grad_sq, v_tt, v_tu, v_uu, z)
    out = dict(grad_sq=grad_sq, grad_sq_se=math.sqrt(v_uu), trace=trace, lo=lo, hi=hi)
    if resolved:
        value = trace / grad_sq
        rel = v_tt / trace ** 2 - 2.0 * v_tu / (trace * grad_sq) + v_uu / grad_sq ** 2 if trace != 0 else math.nan
        out.update(value=value, se=abs(value) * math.sqrt(max(rel, 0.0)) if math.isfinite(rel) else None)
    return ProbeEstimate(n, dropped, level, **out)


def fieller(t: float, u: float, v_tt: float, v_tu: float, v_uu: float, z: float) -> tuple[float, float | None, bool]:
    """Interval for R = t/u: {R : (t - R u)^2 <= z^2 Var(t - R u)} (Fieller 1954), with B >= 0.

    Returns (lo, hi, resolved). Resolved when u - z se(u) > 0: then the set is a bounded interval.
    Otherwise |G|^2 cannot be told from 0, the set is unbounded above and lo is its lower end on
    B > 0 (0.0 when the set reaches down to 0): a lower bound on B, hi None.
    """
    a = u * u - z * z * v_uu
    b = -2.0 * (t * u - z * z * v_tu)
    c = t * t - z * z * v_tt
    disc = b * b - 4.0 * a * c
    if u > 0 and a > 0:  # |G|^2 resolved: f(t/u) <= 0, so the roots are real
        r = math.sqrt(max(disc, 0.0))
        return max((-b - r) / (2.0 * a), 0.0), max((-b + r) / (2.0 * a), 0.0), True
    if a < 0 and disc > 0:  # unbounded set (-inf, r1] u [r2, inf)
        r1, r2 = sorted(((-b - math.sqrt(disc)) / (2.0 * a), (-b + math.sqrt(disc)) / (2.0 * a)))
        if r1 <= 0.0 < r2:
            return r2, None, False
    return 0.0, None, False


def _dot(a, b, weight=None):
    """sum over tensors of <a_k, b_k> (or <a_k, w_k b_k> with a per-parameter `weight`), accumulated in
    float64 (a device scalar: no host read). Temporaries are per tensor (the largest parameter), never a
    flat copy of the whole gradient."""
    import torch

    if weight is None:
        return torch.stack([torch.sum(x * y, dtype=torch.float64) for x, y in zip(a, b)]).sum()
    return torch.stack([torch.sum(x * y * w, dtype=torch.float64) for x, y, w in zip(a, b, weight)]).sum()


def two_pass_estimate(gradient, count: int, level: float = 0.9) -> ProbeEstimate:
    """ProbeEstimate from `count` single-sample gradients, gradient(i) -> list of tensors (one per
    parameter; a fresh result each call, e.g. torch.autograd.grad), called twice per i.

    Memory: pass 1 keeps the running sum S (one float32 copy) and |g_i|^2; pass 2 recomputes each
    g_i and keeps g_i.S. At any time at most two gradient-sized sets of tensors are alive (S and the
    current g_i), plus per-tensor temporaries; no stack, flat copy or float64 copy of the gradients.
    Cost: 2 x count forward+backward passes, one host read per gradient (its finiteness) and one at the end.
    """
    return two_pass_estimates(gradient, count, level, {"": None})[""]


def two_pass_estimates(gradient, count: int, level: float, metrics: dict) -> dict:
    """two_pass_estimate under several inner products at once, name -> ProbeEstimate: `metrics` maps a
    name to None (the plain one) or to a per-parameter weight list w (<a, b>_w = sum w a b, w > 0).

    A weighted B_simple is the noise scale of the whitened gradient w^(1/2) g: every moment it needs is
    an inner product of the same g_i and S (|S|_w^2 = <S, w S>), so the extra metrics cost dot products,
    not forward or backward passes."""
    import torch

    total, keep = None, []
    q = {name: [] for name in metrics}
    for i in range(count):
        g = gradient(i)
        qi = {name: _dot(g, g, w) for name, w in metrics.items()}
        if not all(math.isfinite(float(v)) for v in qi.values()):
            continue  # inf/NaN gradient (e.g. an fp16 overflow): left out of both passes
        keep.append(i)
        for name, v in qi.items():
            q[name].append(v)
        if total is None:
            total = [x.detach().float().clone() for x in g]
        else:
            torch._foreach_add_(total, [x.float() for x in g])
        del g
    if len(keep) < 3:
        return {name: ProbeEstimate(len(keep), count - len(keep), level) for name in metrics}
    d = {name: [] for name in metrics}
    for i in keep:
        g = gradient(i)
        for name, w in metrics.items():
            d[name].append(_dot(g, total, w))
        del g
    s_sq = {name: _dot(total, total, w) for name, w in metrics.items()}
    del total
    n, out = len(keep), {}
    for name in metrics:
        host = torch.stack(q[name] + d[name] + [s_sq[name]]).cpu().tolist()
        out[name] = estimate_from_moments(host[:n], host[n:2 * n], host[-1], level, count - n)
    return out


def probe_noise_scale(gradient_of, seed: int, timesteps: int, buckets: int, bucket_samples: int,
                      marginal_samples: int, n_subjects: int, shape: tuple[int, ...], level: float = 0.9,
                      preconditioner=None) -> dict:
    """The noise-scale probe's history keys: per timestep bucket (gns_t{b}, timesteps uniform in the
    bucket, bucket_samples draws) and marginal over timesteps (gns_marginal: timesteps uniform over
    [0, timesteps) as in training, marginal_samples draws; 0 = off), each with _lo/_hi (the `level`
    interval; see ProbeEstimate for the unresolved case), _grad_sq, _trace, _se and _dropped.

    gradient_of(subject position, timestep, noise) -> one sample's loss gradient, one tensor per
    parameter. Draws are fixed per seed (objective.probe_draws), so probes are comparable over training.
    """
    from voxdiff.diffusion.objective import probe_draws

    groups = [(f"gns_t{b}", b, lo, hi, bucket_samples) for b, (lo, hi) in enumerate(bucket_edges(timesteps, buckets))]
    if marginal_samples:
        groups.append(("gns_marginal", MARGINAL_STREAM, 0, timesteps, marginal_samples))
    out = {}
    for prefix, stream, lo, hi, count in groups:
        draws = probe_draws(seed, stream, lo, hi, count, n_subjects, shape)
        metrics = {prefix: None}
        if prefix == "gns_marginal" and preconditioner is not None:
            metrics[ADAM_PREFIX] = preconditioner
        for name, estimate in two_pass_estimates(lambda i: gradient_of(*draws[i]), len(draws), level,
                                                 metrics).items():
            out.update(estimate.record(name))
    return out


ADAM_PREFIX = "gns_marginal_adam"
# probe_draws "bucket" tag of the draws that move Adam's second moment (advise's branches): its own stream.
MOMENT_STREAM = 0x5A17


@dataclasses.dataclass(frozen=True)
class GradientMoments:
    """Per-coordinate mean and mean square of n single-sample gradients (one tensor per parameter).

    The per-coordinate noise and the sums of noise and signal are computed once (cached): advise asks for
    them for every branch batch. The per-coordinate signal is not kept (one parameter-sized list fewer held
    through the branches; only batch_second_moment needs it)."""
    mean: list
    mean_sq: list
    n: int

    @functools.cached_property
    def noise(self) -> list:
        """sigma^2 per coordinate, n (A - C) / (n - 1) with A = mean of g_i^2 and C = (mean g_i)^2: unbiased,
        n - 1 degrees of freedom."""
        import torch

        return [torch.clamp(sq - m * m, min=0.0) * (self.n / (self.n - 1)) for m, sq in zip(self.mean, self.mean_sq)]

    def _signal(self, mean, noise):
        """max(G^2, 0) of one tensor, G^2 = C - sigma^2 / n = (n C - A) / (n - 1): unbiased before the clamp
        (a difference that can fall below 0)."""
        import torch

        return torch.clamp(mean * mean - noise / self.n, min=0.0)

    @property
    def signal(self) -> list:
        """max(G^2, 0) per coordinate (see _signal)."""
        return [self._signal(m, v) for m, v in zip(self.mean, self.noise)]

    @functools.cached_property
    def _totals(self) -> tuple[float, float]:
        """(sum of signal, sum of noise) over all coordinates, in float64, one tensor at a time."""
        import torch

        signal = sum(torch.sum(self._signal(m, v), dtype=torch.float64) for m, v in zip(self.mean, self.noise))
        return float(signal), float(sum(torch.sum(v, dtype=torch.float64) for v in self.noise))

    def batch_second_moment(self, batch: int, clip: float = 0.0) -> list:
        """E[(s_B g_B)^2] per coordinate, g_B the mean gradient of `batch` samples and s_B the clip's scale,
        at these weights.

        Unclipped, E[g_B^2] = G^2 + sigma^2 / B per coordinate; at B near n a per-coordinate estimate of G^2
        alone would leave some coordinates near 0, so max(G^2, 0) + sigma^2 / B: never below the noise's
        share (it holds for the truth), biased up where G^2 < ~sigma^2 / n, for Gaussian gradients by
        E[(chi2_1 - 1)+] sigma^2 / (n - 1) = 0.48 sigma^2 / (n - 1) at G = 0. The clip (train.grad_clip on
        the whole gradient's norm) scales by s_B^2 ~ min(1, clip^2 / E|g_B|^2), |g_B|^2 concentrating in
        many dimensions."""
        scale = self.clip_scale_sq(batch, clip)
        return [(s + v / batch) * scale for s, v in zip(self.signal, self.noise)]

    def clip_scale_sq(self, batch: int, clip: float) -> float:
        """s_B^2 = min(1, clip^2 / E|g_B|^2) (1 without a clip), E|g_B|^2 = the sum of batch_second_moment's
        unclipped coordinates."""
        if clip <= 0:
            return 1.0
        signal, noise = self._totals
        norm_sq = signal + noise / batch
        return min(1.0, clip * clip / norm_sq) if norm_sq > 0 else 1.0

    def move_second_moment(self, v_hat: list, batch: int, trained_batch: int, clip: float = 0.0) -> list:
        """Adam's bias-corrected second moment v_hat, trained at `trained_batch`, as it would be on the same
        trajectory at `batch`. Along a trajectory E[g_B^2] = E[g_B0^2] - sigma^2 (1/B0 - 1/B) at every point,
        so the average Adam keeps shifts by the noise's share, with sigma^2 measured here standing in for its
        average over the steps v remembers: v_B = (s_B^2 / s_B0^2) (v_hat - s_B0^2 sigma^2 (1/B0 - 1/B)),
        kept >= (s_B^2 / s_B0^2) v_hat B0 / B (the most the noise's share can shrink it) for B > B0.
        Additive, not a ratio: where v_hat is mostly the trajectory's history (on the study's model, per
        coordinate a median 360-1230x the moment at the checkpoint's weights) it barely moves, as it should,
        where a ratio of moments at these weights would shrink it by up to B / B0."""
        import torch

        s0, s1 = self.clip_scale_sq(trained_batch, clip), self.clip_scale_sq(batch, clip)
        delta = 1.0 / trained_batch - 1.0 / batch
        out = []
        for v, noise in zip(v_hat, self.noise):
            moved = v - s0 * noise * delta
            if delta > 0:
                moved = torch.maximum(moved, v * (trained_batch / batch))
            out.append(moved * (s1 / s0))
        return out


def gradient_moments(gradient, count: int) -> GradientMoments:
    """GradientMoments of gradient(i), i < count (non-finite gradients left out), in float32 accumulators:
    two gradient-sized copies alive besides the current gradient (kept by the caller while it moves v)."""
    import torch

    total = total_sq = None
    n = 0
    for i in range(count):
        g = [x.detach().float() for x in gradient(i)]
        if not all(bool(torch.isfinite(x).all()) for x in g):
            continue
        n += 1
        if total is None:
            total, total_sq = [x.clone() for x in g], [x * x for x in g]
        else:
            torch._foreach_add_(total, g)
            torch._foreach_addcmul_(total_sq, g, g)
    if n < 2:
        raise ValueError(f"only {n} of {count} single-sample gradients were finite")
    torch._foreach_div_(total, n)
    torch._foreach_div_(total_sq, n)
    return GradientMoments(total, total_sq, n)


def adam_preconditioner(optimizer, params) -> list | None:
    """P = 1 / (sqrt(v_hat) + eps) per parameter tensor of `params`, from torch.optim.Adam's state
    (v_hat = exp_avg_sq / (1 - beta2^step), as Adam's own update divides by); None before the first step."""
    import torch

    group = optimizer.param_groups[0]
    beta2, eps = group["betas"][1], group["eps"]
    out = []
    for p in params:
        state = optimizer.state.get(p)
        if not state or "exp_avg_sq" not in state:
            return None
        step = float(state["step"])
        v_hat = state["exp_avg_sq"] / (1.0 - beta2 ** step)
        out.append(1.0 / (torch.sqrt(v_hat) + eps))
    return out
