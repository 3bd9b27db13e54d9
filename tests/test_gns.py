"""Gradient noise scale against a least-squares problem whose |G|^2 and tr(Sigma) are known exactly.

Per-sample loss 0.5 |w - x_i|^2 with x_i ~ N(mu, sigma^2 I) in d dimensions: the per-sample gradient
is w - x_i, so G = w - mu, tr(Sigma) = d sigma^2 and B_simple = d sigma^2 / |w - mu|^2.
"""

import io
import math

import pytest
import torch

from voxdiff.training.gns import (GradientNoiseScale, balanced_accumulate_every, critical_batch_tradeoff,
                         not_measurable_reason)

D, SIGMA, DIST_SQ = 16, 1.0, 2.0
TRUE_GRAD_SQ, TRUE_TRACE = DIST_SQ, D * SIGMA**2
TRUE_B_SIMPLE = TRUE_TRACE / TRUE_GRAD_SQ  # 8: between the micro-batch and effective batch sizes tested


def train_window_gradients(b_small: int, k: int, steps: int, seed: int, beta: float = 0.998):
    """Feed the estimator as the trainer does; also return the mean of per-step ratios (biased)."""
    gen = torch.Generator().manual_seed(seed)
    mu = torch.zeros(D)
    w = torch.nn.Parameter(mu + math.sqrt(DIST_SQ / D))  # fixed w: the truth stays put
    gns, per_step_ratios = GradientNoiseScale(beta), []
    n_window = b_small * k
    for _ in range(steps):
        w.grad = None
        small_sq = []
        for _ in range(k):
            x = mu + SIGMA * torch.randn(b_small, D, generator=gen)
            before = torch.zeros_like(w) if w.grad is None else w.grad.clone()
            loss = 0.5 * (w - x).pow(2).sum(1).mean()
            (loss * b_small / n_window).backward()  # sample-weighted accumulation
            own = (w.grad - before) * (n_window / b_small)  # this micro-batch's unscaled gradient
            small_sq.append(float(own.pow(2).sum()))
        big_sq = float(w.grad.pow(2).sum())
        gns.update(small_sq, b_small, big_sq, n_window)
        if k > 1:
            per_step_ratios.append(_per_step_ratio(small_sq, b_small, big_sq, n_window))
    return gns, sum(per_step_ratios) / max(len(per_step_ratios), 1)


def _per_step_ratio(small_sq, b_small, big_sq, b_big):
    small = sum(small_sq) / len(small_sq)
    grad_sq = (b_big * big_sq - b_small * small) / (b_big - b_small)
    trace = (small - big_sq) / (1 / b_small - 1 / b_big)
    return trace / grad_sq


@pytest.mark.parametrize("b_small,k", [(2, 4), (1, 8)])
def test_ema_of_unbiased_estimates_recovers_true_noise_scale(b_small, k):
    naive_errors = []
    for seed in range(3):
        gns, naive = train_window_gradients(b_small, k, steps=500, seed=seed)
        assert gns.steps == 500
        assert gns.grad_sq == pytest.approx(TRUE_GRAD_SQ, rel=0.1)
        assert gns.trace == pytest.approx(TRUE_TRACE, rel=0.1)
        assert gns.value == pytest.approx(TRUE_B_SIMPLE, rel=0.1)
        naive_errors.append(abs(naive / TRUE_B_SIMPLE - 1))
    # Negative control: the mean of per-step ratios does not converge (its denominator crosses zero).
    assert max(naive_errors) > 0.5


def test_single_micro_batch_is_not_measurable():
    gns, _ = train_window_gradients(b_small=4, k=1, steps=5, seed=0)
    assert gns.value is None and gns.steps == 0 and gns.grad_sq is None
    assert "not measurable" in not_measurable_reason(1, 1)
    assert not_measurable_reason(2, 1) is None and not_measurable_reason(1, 2) is None


def test_bias_correction_makes_first_step_usable():
    gns = GradientNoiseScale(beta=0.99)
    gns.update([3.0, 5.0], 1, 2.5, 2)  # small mean 4, big 2.5 -> |G|^2 = 1, tr = 3
    assert gns.grad_sq == pytest.approx(1.0) and gns.trace == pytest.approx(3.0)
    assert gns.value == pytest.approx(3.0)


def test_non_finite_and_non_positive_inputs():
    gns = GradientNoiseScale(beta=0.9)
    gns.update([float("nan"), 1.0], 1, 1.0, 2)
    assert gns.steps == 0
    gns.update([1.0, 1.0], 1, 1.0, 2)  # |G|^2 = 1, tr = 0: no noise -> value None, not 0/inf
    assert gns.value is None


def test_state_dict_round_trips_through_weights_only_checkpoint():
    gns, _ = train_window_gradients(2, 2, steps=20, seed=1)
    buf = io.BytesIO()
    torch.save({"gns": gns.state_dict()}, buf)
    buf.seek(0)
    restored = GradientNoiseScale()
    restored.load_state_dict(torch.load(buf, weights_only=True)["gns"])
    assert (restored.value, restored.steps, restored.beta) == (gns.value, gns.steps, gns.beta)


def test_critical_batch_tradeoff_and_balanced_accumulation():
    rows = critical_batch_tradeoff(8.0, [2, 8, 32])
    assert [(r.steps_over_min, r.samples_over_min) for r in rows] == [(5.0, 1.25), (2.0, 2.0), (1.25, 5.0)]
    assert balanced_accumulate_every(8.0, micro_batch=1) == 8
    assert balanced_accumulate_every(11.0, micro_batch=1) == 8   # log2(11) = 3.46 -> 8
    assert balanced_accumulate_every(12.0, micro_batch=1) == 16  # log2(12) = 3.58 -> 16
    assert balanced_accumulate_every(3.0, micro_batch=2, world_size=2) == 1
    with pytest.raises(ValueError):
        critical_batch_tradeoff(-1.0, [1])
