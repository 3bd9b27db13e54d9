"""Gradient noise scale against a least-squares problem whose |G|^2 and tr(Sigma) are known exactly.

Per-sample loss 0.5 |w - x_i|^2 with x_i ~ N(mu, sigma^2 I) in d dimensions: the per-sample gradient
is w - x_i, so G = w - mu, tr(Sigma) = d sigma^2 and B_simple = d sigma^2 / |w - mu|^2.

Second half: the single-sample probe (gns.two_pass_estimate / probe_noise_scale, Trainer.bucket_noise_scale):
its estimates equal the Gram matrix's, its 90 % interval covers the analytic B at about the nominal rate,
|G| = 0 is reported as unresolvable (a lower bound), and it never holds more than two gradient copies.
"""

import gc
import io
import math
import warnings

import numpy as np
import pytest
import torch

from voxdiff.training.gns import (GradientNoiseScale, ProbeEstimate, b_simple_from_gram, balanced_accumulate_every,
                                  critical_batch_tradeoff, estimate_from_moments, not_measurable_reason,
                                  adam_preconditioner, gradient_moments, probe_noise_scale, two_pass_estimate,
                                  two_pass_estimates)

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
    restored = GradientNoiseScale(gns.beta)
    restored.load_state_dict(torch.load(buf, weights_only=True)["gns"])
    assert (restored.value, restored.steps, restored.beta) == (gns.value, gns.steps, gns.beta)


def test_a_changed_smoothing_applies_after_a_restore():
    """train.gns_smoothing is measurement-only: a resume with another value goes on with the new beta (it
    used to take the checkpoint's), and the bias correction stays exact across the change: it divides by
    1 - the product of the betas in force at each update, computed here by hand."""
    steps = [(3.0, 2.5), (5.0, 3.0), (4.0, 1.0), (6.0, 2.0), (2.5, 2.0)]  # (small |g|^2, big |G|^2), B 1 -> 2
    old = GradientNoiseScale(0.9)
    for small, big in steps[:3]:
        old.update([small], 1, big, 2)
    new = GradientNoiseScale(0.5)
    new.load_state_dict(old.state_dict())
    assert new.beta == 0.5 and new.value == pytest.approx(old.value)  # nothing measured yet with the new beta
    for small, big in steps[3:]:
        new.update([small], 1, big, 2)
    g = t = 0.0
    prod = 1.0
    for (small, big), beta in zip(steps, (0.9, 0.9, 0.9, 0.5, 0.5)):
        g, t, prod = beta * g + (1 - beta) * (2 * big - small), beta * t + (1 - beta) * 2 * (small - big), prod * beta
    assert new.grad_sq == pytest.approx(g / (1 - prod)) and new.trace == pytest.approx(t / (1 - prod))
    assert new.steps == 5
    # A checkpoint written before the product was stored: it is beta ** steps of its own beta.
    legacy = {k: v for k, v in old.state_dict().items() if k != "decay"}
    again = GradientNoiseScale(0.5)
    again.load_state_dict(legacy)
    assert again.value == pytest.approx(old.value) and again.beta == 0.5


def test_critical_batch_tradeoff_and_balanced_accumulation():
    rows = critical_batch_tradeoff(8.0, [2, 8, 32])
    assert [(r.steps_over_min, r.samples_over_min) for r in rows] == [(5.0, 1.25), (2.0, 2.0), (1.25, 5.0)]
    assert balanced_accumulate_every(8.0, micro_batch=1) == 8
    assert balanced_accumulate_every(11.0, micro_batch=1) == 8   # log2(11) = 3.46 -> 8
    assert balanced_accumulate_every(12.0, micro_batch=1) == 16  # log2(12) = 3.58 -> 16
    assert balanced_accumulate_every(3.0, micro_batch=2, world_size=2) == 1
    with pytest.raises(ValueError):
        critical_batch_tradeoff(-1.0, [1])


# --- the single-sample probe: B_simple with an interval, in two passes (issue 20 item 4, issue 22 item 3) --
LEVEL = 0.9


def moments(g: np.ndarray):
    """(q_i, d_i, |S|^2) of the rows of g: what two_pass_estimate keeps."""
    s = g.sum(0)
    return (g * g).sum(1), g @ s, float(s @ s)


def least_squares_gradient(w: torch.nn.Parameter, mu: torch.Tensor, sigma: float, seed: int):
    """Per-sample gradient of 0.5 |w - x_i|^2, x_i ~ N(mu, sigma^2 I): w - x_i, drawn afresh per i from
    (seed, i) so both passes see the same sample. G = w - mu, tr(Sigma) = d sigma^2."""
    def gradient(i: int):
        x = mu + sigma * torch.randn(mu.shape, generator=torch.Generator().manual_seed(seed * 100_003 + i))
        return torch.autograd.grad(0.5 * (w - x).pow(2).sum(), [w])
    return gradient


def test_moments_give_the_gram_estimates_and_their_exact_jackknife():
    """From (q, d, |S|^2) alone: the same |G|^2 and tr(Sigma) as the full Gram matrix, and the same
    leave-one-out values as deleting each sample's row and column (brute force)."""
    rng = np.random.default_rng(1)
    g = 0.8 + rng.standard_normal((10, 40))  # B ~ 1.6: resolved with 10 samples
    est = estimate_from_moments(*moments(g), level=LEVEL)
    gram = g @ g.T
    value, trace, grad_sq = b_simple_from_gram(gram)
    assert est.grad_sq == pytest.approx(grad_sq, rel=1e-12) and est.trace == pytest.approx(trace, rel=1e-12)
    assert est.value == pytest.approx(value, rel=1e-12) and est.n == 10
    loo = np.array([b_simple_from_gram(np.delete(np.delete(gram, i, 0), i, 1))[2] for i in range(10)])
    brute_se = math.sqrt(9 / 10 * ((loo - loo.mean()) ** 2).sum())
    assert est.grad_sq_se == pytest.approx(brute_se, rel=1e-9)
    assert est.lo < est.value < est.hi and est.se > 0


def test_two_pass_probe_equals_the_moments_of_the_stack():
    """Streaming over several parameter tensors (one running sum, one gradient at a time) gives what the
    stacked float64 gradients give; inf/NaN gradients are left out of both passes and counted."""
    rng = np.random.default_rng(2)
    g = 0.9 + rng.standard_normal((9, 30))  # resolved with the 7 finite ones
    bad = {3, 7}

    def gradient(i):
        row = torch.tensor(g[i], dtype=torch.float32)
        if i in bad:
            row = row.clone()
            row[5] = float("nan") if i == 3 else float("inf")
        return [row[:10].reshape(2, 5), row[10:]]

    est = two_pass_estimate(gradient, 9, LEVEL)
    keep = np.array([i for i in range(9) if i not in bad])
    ref = estimate_from_moments(*moments(g[keep].astype(np.float32).astype(np.float64)), level=LEVEL)
    assert (est.n, est.dropped) == (7, 2)
    assert est.resolved
    for name in ("grad_sq", "trace", "value", "lo", "hi", "se", "grad_sq_se"):
        assert getattr(est, name) == pytest.approx(getattr(ref, name), rel=1e-5), name


def coverage(make_gradient, n: int, truth: float, seeds: int) -> tuple[float, list[ProbeEstimate]]:
    runs = [two_pass_estimate(make_gradient(seed), n, LEVEL) for seed in range(seeds)]
    covered = [r.lo <= truth <= (r.hi if r.hi is not None else math.inf) for r in runs]
    return sum(covered) / seeds, runs


@pytest.mark.parametrize("d,n,b_true", [(64, 32, 8.0), (256, 32, 64.0), (64, 8, 4.0)])
def test_probe_interval_covers_the_analytic_noise_scale(d, n, b_true):
    """Least squares with Gaussian per-sample gradients, B = d sigma^2 / |w - mu|^2 known: the nominal
    90 % interval covers the truth in >= 85 % of 200 independent probes (binomial sd 2 %),
    is resolved in >= 95 % of them and its centre is right (median within 10 %)."""
    mu = torch.zeros(d)
    w = torch.nn.Parameter(mu + math.sqrt(d / b_true / d))  # |w - mu|^2 = d / b_true with sigma = 1
    share, runs = coverage(lambda seed: least_squares_gradient(w, mu, 1.0, seed), n, b_true, 200)
    assert share >= 0.85, share  # measured 0.925, 0.965, 0.935
    resolved = [r for r in runs if r.resolved]
    assert len(resolved) >= 0.95 * len(runs)
    assert float(np.median([r.value for r in resolved])) == pytest.approx(b_true, rel=0.1)
    first_ten = sum(r.lo <= b_true <= (r.hi if r.resolved else math.inf) for r in runs[:10])
    assert first_ten >= 8  # the check: >= 8 of 10 seeds for a 90 % interval


def test_marginal_probe_is_the_noise_scale_of_the_timestep_mixture():
    """Two 'timesteps' drawn uniformly per sample, each with its own mean and noise: the marginal B is
    tr(Sigma_mix)/|G_mix|^2 (the spread of the per-timestep means is noise too), not the mean of the
    per-timestep B's, and the probe over mixed draws covers it."""
    d = 64
    half = torch.cat([torch.ones(d // 2), -torch.ones(d // 2)])
    means = [torch.full((d,), 0.5), 0.5 * half]  # |G_mix|^2 = 8, spread of the means adds 8 to tr = 80
    sigmas = [0.5, 1.5]
    g_mix = (means[0] + means[1]) / 2
    trace_mix = sum(d * s**2 + float(m @ m) for m, s in zip(means, sigmas)) / 2 - float(g_mix @ g_mix)
    truth = trace_mix / float(g_mix @ g_mix)
    per_t = [d * s**2 / float(m @ m) for m, s in zip(means, sigmas)]
    assert truth == pytest.approx(11.0, rel=1e-6) and sum(per_t) / 2 == pytest.approx(5.0)  # the distinction matters

    def make(seed):
        def gradient(i):
            gen = torch.Generator().manual_seed(seed * 100_003 + i)
            k = int(torch.randint(0, 2, (1,), generator=gen))
            return [means[k] + sigmas[k] * torch.randn(d, generator=gen)]
        return gradient

    share, runs = coverage(make, 32, truth, 200)
    assert share >= 0.85, share
    assert float(np.median([r.value for r in runs if r.resolved])) == pytest.approx(truth, rel=0.15)


def test_pure_noise_is_unresolvable_and_reported_as_a_lower_bound():
    """Negative control, |G| = 0: B is infinite. The probe says so (no value, no upper end, a finite
    lower bound), instead of the number the old Gram-matrix probe printed whenever |G|^2 came out > 0."""
    d = 64
    mu = torch.zeros(d)
    w = torch.nn.Parameter(mu.clone())
    runs = [two_pass_estimate(least_squares_gradient(w, mu, 1.0, seed), 32, LEVEL) for seed in range(100)]
    unresolved = [r for r in runs if not r.resolved]
    assert len(unresolved) >= 90
    assert all(r.value is None and r.hi is None and r.se is None and 0.0 <= r.lo < math.inf for r in unresolved)
    old = [b_simple_from_gram(np.stack([least_squares_gradient(w, mu, 1.0, s)(i)[0].numpy() for i in range(32)])
                              @ np.stack([least_squares_gradient(w, mu, 1.0, s)(i)[0].numpy() for i in range(32)]).T)[0]
           for s in range(10)]
    assert sum(math.isfinite(v) for v in old) >= 3  # the old probe reported a finite B for many of these
    rec = unresolved[0].record("gns_marginal")
    assert rec["gns_marginal"] is None and rec["gns_marginal_hi"] is None and rec["gns_marginal_lo"] >= 0.0
    # A one-sided check of the bound: with |G|^2 tiny (B = 10^4 >> what 32 samples resolve) it stays below B.
    w_far = torch.nn.Parameter(mu + math.sqrt(1e-4))
    far = [two_pass_estimate(least_squares_gradient(w_far, mu, 1.0, seed), 32, LEVEL) for seed in range(50)]
    assert sum(r.lo <= 1e4 for r in far) >= 45 and sum(r.resolved for r in far) <= 5


def big_tensors(numel: int, exclude) -> int:
    """Distinct storages of live tensors with `numel` elements (any dtype), other than `exclude`."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    ptrs = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated torch module attributes warns
        for obj in gc.get_objects():
            try:
                found = isinstance(obj, torch.Tensor) and obj.numel() == numel
            except ReferenceError:  # a weakref proxy whose object is gone, left by an earlier test in this process
                continue
            if found:
                ptr = obj.untyped_storage().data_ptr()
                if ptr not in skip:
                    ptrs.add(ptr)
    return len(ptrs)


def test_probe_holds_at_most_two_gradient_copies():
    """Issue 22 item 3: at every gradient request the probe holds at most the running sum (1 copy), so
    with the new gradient at most 2 copies are alive; the old design (list + stack + float64 copy) held
    them all. Counted as live tensors the size of the single parameter; a keep-all loop is the control."""
    numel = 10_007  # a size nothing else in the process has
    mu = torch.zeros(numel)
    w = torch.nn.Parameter(mu + 0.05)
    inner = least_squares_gradient(w, mu, 1.0, seed=0)
    alive = []

    def gradient(i):
        alive.append(big_tensors(numel, [w, mu]))  # before this sample's gradient exists
        return inner(i)

    est = two_pass_estimate(gradient, 8, LEVEL)
    assert est.n == 8 and len(alive) == 16
    assert max(alive) <= 1, alive  # + the gradient being made = 2 copies at most

    kept, counts = [], []
    for i in range(8):  # control: the old probe's list of flattened gradients
        counts.append(big_tensors(numel, [w, mu]))
        kept.append(torch.cat([g.reshape(-1) for g in inner(i)]))
    assert counts[-1] == 7


def test_probe_noise_scale_keys_and_marginal_draws_uniform_over_timesteps():
    """probe_noise_scale: per-bucket keys, gns_marginal keys, marginal timesteps across the whole schedule;
    marginal_samples 0 turns the marginal off."""
    seen = []

    def gradient_of(position, t, noise):
        seen.append(t)
        gen = torch.Generator().manual_seed(len(seen) % 1000)
        return [0.5 + torch.randn(32, generator=gen)]

    out = probe_noise_scale(gradient_of, seed=0, timesteps=100, buckets=2, bucket_samples=4, marginal_samples=40,
                            n_subjects=3, shape=(1, 2, 2, 2), level=LEVEL)
    for prefix in ("gns_t0", "gns_t1", "gns_marginal"):
        assert {f"{prefix}{s}" for s in ("", "_lo", "_hi", "_grad_sq", "_trace", "_se", "_dropped")} <= set(out)
    marginal_t = seen[2 * 2 * 4:][:40]  # pass 1 of the marginal group
    assert min(marginal_t) < 25 and max(marginal_t) >= 75
    assert all(t < 50 for t in seen[:8]) and all(t >= 50 for t in seen[8:16])
    off = probe_noise_scale(gradient_of, 0, 100, 2, 4, 0, 3, (1, 2, 2, 2), LEVEL)
    assert not any(k.startswith("gns_marginal") for k in off)


# --- in Adam's coordinates: B_P = tr(P Sigma) / G^T P G ------------------------------------------------
def anisotropic_problem(d: int = 64):
    """Least squares where Adam's view and SGD's differ by far: half the coordinates carry a large, nearly
    noiseless mean gradient and a small weight (as Adam's 1/sqrt(v) gives them), half a small mean under
    large noise and a large weight. Per-sample gradient w - x_i, x_i ~ N(mu, diag(sigma^2))."""
    half = d // 2
    g_mean = torch.cat([torch.full((half,), 3.0), torch.full((half,), 0.1)])
    sigma = torch.cat([torch.full((half,), 0.3), torch.full((half,), 1.0)])
    weight = torch.cat([torch.full((half,), 0.03), torch.full((half,), 1.0)])
    plain = float((sigma ** 2).sum() / (g_mean ** 2).sum())
    whitened = float((weight * sigma ** 2).sum() / (weight * g_mean ** 2).sum())
    w = torch.nn.Parameter(g_mean.clone())  # mu = 0, so G = w

    def make_gradient(seed):
        def gradient(i):
            x = sigma * torch.randn(d, generator=torch.Generator().manual_seed(seed * 100_003 + i))
            return torch.autograd.grad(0.5 * (w - x).pow(2).sum(), [w])
        return gradient
    return make_gradient, [weight], plain, whitened


def test_weighted_probe_covers_the_analytic_noise_scale_in_adams_coordinates():
    """The weighted estimate from the same two passes covers tr(P Sigma)/G^T P G (nominal 90 %: >= 85 % of
    200 probes); the plain one, from the same gradients, is what two_pass_estimate gives and covers the
    plain B. Negative control: the two truths differ 30x here, and the plain intervals miss the weighted
    truth in nearly every probe, so the check can fail."""
    make_gradient, weight, plain, whitened = anisotropic_problem()
    assert whitened / plain > 10
    hit_w = hit_p = plain_hits_w = 0
    for seed in range(200):
        est = two_pass_estimates(make_gradient(seed), 32, LEVEL, {"plain": None, "adam": weight})
        w_est, p_est = est["adam"], est["plain"]
        hit_w += w_est.lo <= whitened <= (w_est.hi if w_est.resolved else math.inf)
        hit_p += p_est.lo <= plain <= (p_est.hi if p_est.resolved else math.inf)
        plain_hits_w += p_est.lo <= whitened <= (p_est.hi if p_est.resolved else math.inf)
        if seed == 0:
            ref = two_pass_estimate(make_gradient(seed), 32, LEVEL)
            assert p_est.value == pytest.approx(ref.value, rel=1e-9) and p_est.lo == pytest.approx(ref.lo, rel=1e-9)
    assert hit_w >= 170 and hit_p >= 170, (hit_w, hit_p)
    assert plain_hits_w <= 10, plain_hits_w


def test_adam_preconditioner_is_what_adams_update_divides_by():
    """After a few steps of torch.optim.Adam, its next update equals -lr * m_hat * P with P from
    adam_preconditioner on the state after that step; None before the first step."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(50))
    opt = torch.optim.Adam([w], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    assert adam_preconditioner(opt, [w]) is None
    for step in range(1, 6):
        w.grad = torch.randn(50) * (1 + torch.arange(50.0))  # very different scales per coordinate
        before = w.detach().clone()
        opt.step()
        state = opt.state[w]
        m_hat = state["exp_avg"] / (1 - 0.9 ** step)
        (P,) = adam_preconditioner(opt, [w])
        assert torch.allclose(w.detach() - before, -1e-2 * m_hat * P, rtol=1e-3, atol=1e-6)  # float32 differences
    assert float(P.max() / P.min()) > 10  # the check sees the per-coordinate scales


# --- Adam's second moment at another batch, from single-sample gradients --------------------------------
def test_batch_second_moment_recovers_every_batch_and_is_clipped_like_training():
    """g_i = G + sigma z_i with G and sigma different in every coordinate (true E[g_B^2] = G^2 + sigma^2/B):
    from n = 64 draws, averaged over 4000 repetitions, each batch's estimate is within 2 % of the truth
    where G^2 >> sigma^2 / n, and elsewhere above it by no more than the floor's stated bias,
    E[(chi2_1 - 1)+] sigma^2 / (n - 1) = 0.48 sigma^2 / (n - 1) (its value at G = 0); the
    batch-1 moment (what a checkpoint trained at batch 1 holds) is 1.2-8x off at batch 8 (negative
    control). At B = n, where G = 0, no repetition leaves v below a quarter of its noise share sigma^2 / B,
    where the plain squared mean (the unbiased estimate at B = n) does in over 30 % of them. A clip below the norm
    scales the whole moment to clip^2, as clip_grad_norm_ scales the gradient."""
    torch.manual_seed(0)
    n, reps = 64, 4000
    G = torch.tensor([0.0, 0.3, 1.0, -2.0, 0.5])
    sigma = torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0])
    draws = G + sigma * torch.randn(n, reps, len(G))
    m = gradient_moments(lambda i: [draws[i]], n)
    assert m.n == n
    for b in (1, 2, 4, 8, 16):
        truth = G ** 2 + sigma ** 2 / b
        got = m.batch_second_moment(b)[0].mean(0)
        assert torch.allclose(got[2:4], truth[2:4], rtol=0.02), b  # G^2 >> sigma^2 / n: unbiased
        assert bool((got >= 0.98 * truth).all() and (got <= 1.02 * truth + 0.5 * sigma ** 2 / (n - 1)).all()), b
    off = (draws ** 2).mean(0).mean(0) / (G ** 2 + sigma ** 2 / 8)
    assert float(off.min()) > 1.2 and float(off.max()) > 7.5
    floor = 0.25 * sigma[0] ** 2 / n  # coordinate 0, G = 0: the squared mean is sigma^2/n chi2_1, < 1/4 of it 38 %
    assert bool((m.batch_second_moment(n)[0][:, 0] >= floor).all())  # needs s^2 < sigma^2 / 4 at 63 dof: ~1e-12
    assert float((draws.mean(0)[:, 0] ** 2 < floor).float().mean()) > 0.3
    unclipped = float(m.batch_second_moment(4)[0].sum())
    assert float(m.batch_second_moment(4, clip=1e6)[0].sum()) == pytest.approx(unclipped, rel=1e-6)
    assert float(m.batch_second_moment(4, clip=2.0)[0].sum()) == pytest.approx(4.0, rel=1e-5)


def test_moving_the_second_moment_shifts_only_the_noise_share():
    """From B0 = 2 to B = 8: a v_hat that is the stationary moment at B0 (G^2 + sigma^2/2) moves to
    G^2 + sigma^2/8 (averaged over repetitions, within 3 % where G^2 >> sigma^2/n); a v_hat 1000x larger
    (mostly history, as on the study's model) moves by less than 0.2 %, where the ratio of the moments at
    these weights (the negative control) would shrink it up to 4x; never below v_hat B0/B; B = B0 leaves
    it as it was; from 8 back to 2 it grows by the same shift. With a clip below the norm, the clip's scale
    at each batch enters as s_B^2 / s_B0^2."""
    torch.manual_seed(0)
    n, reps = 64, 2000
    G = torch.tensor([0.0, 1.0, -2.0, 0.5])
    sigma = torch.tensor([1.0, 0.5, 1.0, 3.0])
    draws = G + sigma * torch.randn(n, reps, len(G))
    m = gradient_moments(lambda i: [draws[i]], n)
    at_2, at_8 = G ** 2 + sigma ** 2 / 2, G ** 2 + sigma ** 2 / 8
    v2 = at_2.expand(reps, -1).clone()
    (moved,) = m.move_second_moment([v2], 8, 2)
    assert torch.allclose(moved.mean(0)[1:3], at_8[1:3], rtol=0.03)
    assert bool((moved >= v2 * 2 / 8 - 1e-6).all())
    (history,) = m.move_second_moment([1000 * v2], 8, 2)
    assert float((history / (1000 * v2)).min()) > 0.998
    ratio = m.batch_second_moment(8)[0] / m.batch_second_moment(2)[0]
    assert float(ratio.mean(0).min()) < 0.3  # what a ratio would do to the history: shrink it ~4x
    assert torch.equal(m.move_second_moment([v2], 2, 2)[0], v2)
    (back,) = m.move_second_moment([at_8.expand(reps, -1).clone()], 2, 8)
    assert torch.allclose(back.mean(0)[1:3], at_2[1:3], rtol=0.03)
    clip = 1.0
    s2, s8 = m.clip_scale_sq(2, clip), m.clip_scale_sq(8, clip)
    assert s2 < s8 < 1
    (clipped,) = m.move_second_moment([1000 * v2], 8, 2, clip)
    assert torch.allclose(clipped, (1000 * v2 - s2 * m.noise[0] * (1 / 2 - 1 / 8)) * (s8 / s2), rtol=1e-5)


def test_gradient_moments_leave_out_non_finite_gradients():
    grads = [torch.ones(3), torch.full((3,), float("nan")), 3 * torch.ones(3)]
    m = gradient_moments(lambda i: [grads[i]], 3)
    assert m.n == 2 and torch.equal(m.mean[0], torch.full((3,), 2.0)) and torch.equal(m.mean_sq[0], torch.full((3,), 5.0))
    with pytest.raises(ValueError, match="only 1 of 2"):
        gradient_moments(lambda i: [grads[i + 1]], 2)


# --- through the Trainer: ConstantPrediction, B = 1/c^2 at every timestep ---------------------------
class ConstantPrediction(torch.nn.Module):
    """Prediction = a learnable constant volume w = c (as in test_training_controls): with the epsilon
    target and l2, B_simple = 1/c^2 per bucket and marginally; c = 0 makes G = 0 (B infinite)."""

    def __init__(self, shape, c: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((1, 1, *shape), c))

    def forward(self, x, timesteps=None, context=None):
        return self.w.expand(x.shape[0], *self.w.shape[1:])


def probe_trainer(tiny_root, monkeypatch, c: float, seed: int, overrides: dict | None = None):
    from conftest import make_params
    from voxdiff.data.cache import open_cache
    from voxdiff.training import trainer as trainer_mod
    from voxdiff.runtime.distributed import init_runtime

    monkeypatch.setattr(trainer_mod, "build_network", lambda model, classes, **kw: ConstantPrediction((16, 16, 16), c))
    cfg = {"seed": seed, "train.max_steps": 3, "train.max_samples": 0, "diffusion.prediction": "epsilon",
           "diffusion.loss": "l2", "train.gns_buckets": 4, "train.gns_bucket_samples": 4, "train.gns_probe_samples": 16,
           **(overrides or {})}
    return trainer_mod.Trainer(make_params(cfg), tiny_root, init_runtime("cpu", "fp32"),
                               open_cache(tiny_root / "data" / "processed"))


def test_trainer_probe_covers_one_over_c_squared_marginally_and_per_bucket(tiny_root, monkeypatch):
    c, truth = 0.5, 4.0
    covered = 0
    for seed in range(10):
        out = probe_trainer(tiny_root, monkeypatch, c, seed).bucket_noise_scale()
        assert out["gns_marginal"] == pytest.approx(truth, rel=0.25), out
        covered += out["gns_marginal_lo"] <= truth <= out["gns_marginal_hi"]
        if seed == 0:
            for b in range(4):
                assert out[f"gns_t{b}"] == pytest.approx(truth, rel=0.3), out
                assert out[f"gns_t{b}_lo"] < out[f"gns_t{b}"] < out[f"gns_t{b}_hi"] and out[f"gns_t{b}_dropped"] == 0
    assert covered >= 8, covered  # nominal 90 %


def test_trainer_probe_in_adams_coordinates_after_the_first_step(tiny_root, monkeypatch):
    """No Adam state before the first step: no gns_marginal_adam. After one step with a gradient of equal
    size in every coordinate, P is uniform and the weighted B equals the plain one exactly; the optimizer
    state is left as it was."""
    tr = probe_trainer(tiny_root, monkeypatch, 0.5, seed=0)
    assert "gns_marginal_adam" not in tr.bucket_noise_scale()
    w = tr.net.w
    w.grad = torch.full_like(w, 0.1)
    tr.opt.step()
    tr.opt.zero_grad(set_to_none=True)
    v_before = tr.opt.state[w]["exp_avg_sq"].clone()
    out = tr.bucket_noise_scale()
    assert out["gns_marginal_adam"] == pytest.approx(out["gns_marginal"], rel=1e-6)
    assert out["gns_marginal_adam_lo"] == pytest.approx(out["gns_marginal_lo"], rel=1e-6)
    assert torch.equal(tr.opt.state[w]["exp_avg_sq"], v_before) and w.grad is None


def test_trainer_probe_with_zero_gradient_reports_unresolvable(tiny_root, monkeypatch):
    out = probe_trainer(tiny_root, monkeypatch, 0.0, seed=0).bucket_noise_scale()
    for prefix in ("gns_marginal", *(f"gns_t{b}" for b in range(4))):
        assert out[prefix] is None and out[f"{prefix}_hi"] is None, (prefix, out)
        assert 0.0 <= out[f"{prefix}_lo"] < math.inf


def test_trainer_moves_adams_second_moment_to_its_batch(tiny_root, monkeypatch):
    """On the constant prediction (per-coordinate gradient 2(w - eps)/d: G^2 + sigma^2/B = (4/d^2)(c^2 + 1/B)),
    a state trained 300 steps at effective batch 1 restored into trainers at effective batch 1 and 8 holds batch 1's
    v_hat in both (the control: 3.3x batch 8's); moved, each holds (4/d^2)(c^2 + 1/B) of its own B within 5 %
    (mean over the d coordinates), read back through adam_preconditioner (tested against Adam's own update).
    Its first moment, step count and the weights are left as they were."""
    import copy

    c, d = 0.5, 16 ** 3

    def v_hat_mean(tr) -> float:
        (P,) = adam_preconditioner(tr.opt, [tr.net.w])
        return float(((1 / P - tr.opt.param_groups[0]["eps"]) ** 2).mean())

    at_1 = {"train.batch_size": 1, "train.grad_clip": 0.0}
    source = probe_trainer(tiny_root, monkeypatch, c, seed=0, overrides={**at_1, "train.accumulate_every": 1,
                                                                          "train.max_steps": 300})
    from voxdiff.training import trainer as trainer_mod

    with monkeypatch.context() as mp:  # Adam's moments warmed over 300 steps, w kept (lr ~ 0)
        mp.setattr(trainer_mod, "lr_at", lambda *a: 1e-12)
        for _ in range(300):
            source.train_step()
    state = source.state(False, None)
    for accumulate in (1, 8):
        tr = probe_trainer(tiny_root, monkeypatch, c, seed=0, overrides={**at_1, "train.accumulate_every": accumulate})
        tr.restore(copy.deepcopy(state))
        assert v_hat_mean(tr) == pytest.approx(4 / d ** 2 * (c ** 2 + 1), rel=0.05)
        w = tr.net.w
        adam = tr.opt.state[w]
        m_before, step, w_before = adam["exp_avg"].clone(), float(adam["step"]), w.detach().clone()
        tr.move_adam_second_moment(tr.gradient_moments(64), trained_batch=1)
        assert v_hat_mean(tr) == pytest.approx(4 / d ** 2 * (c ** 2 + 1 / accumulate), rel=0.05), accumulate
        assert torch.equal(adam["exp_avg"], m_before) and float(adam["step"]) == step == 300
        assert torch.equal(w.detach(), w_before)
