"""DDIM moves from each scheduled timestep to the next one in its own list (issue 19, item 5).

MONAI 1.6.1's DDIMScheduler places its timesteps by linspace(T - 1, 0, n).round() but steps to
t - T // n; voxdiff's sampler (sampling.ScheduleDDIM) steps to the next scheduled timestep instead.
"""

from __future__ import annotations

import pytest
import torch

from conftest import make_params

CASES = [(250, 50, 4), (1000, 50, 19), (50, 7, 6)]  # (T, DDIM steps, transitions MONAI 1.6.1 gets wrong)
X0 = 0.5


class X0Probe(torch.nn.Module):
    """A network predicting the clean image X0 everywhere (diffusion.prediction "sample") that records the
    timestep and the noisy image the sampler hands it at every step."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # generate() takes the device from the parameters
        self.calls: list[tuple[int, torch.Tensor]] = []

    def forward(self, x, timesteps, context=None):
        self.calls.append((int(timesteps[0]), x[:, :1].double().clone()))
        return torch.full_like(x[:, :1], X0)


def wrong_transitions(calls, alphas_cumprod) -> list[tuple[int, int]]:
    """The (t, t_next) transitions after which the image the network sees is not at t_next's noise level.

    With a constant x0 prediction a DDIM step (eta 0) keeps the implied noise eps = (x - sqrt(a) x0) /
    sqrt(1 - a) unchanged when it lands at the level the next call is labelled with; landing anywhere else
    changes it (measured: by 5e-4 or more of its size here, against float32 rounding of 2e-6)."""
    a = alphas_cumprod.double()
    eps = [(x - a[t].sqrt() * X0) / (1 - a[t]).sqrt() for t, x in calls]
    return [(calls[i][0], calls[i + 1][0]) for i in range(len(calls) - 1)
            if (eps[i + 1] - eps[i]).abs().max() > 1e-4 * eps[i].abs().max()]


def diffusion(T):
    return make_params({"diffusion.timesteps": T, "diffusion.prediction": "sample"}).diffusion


LABELS = torch.zeros(1, 4, 4, 4, dtype=torch.long)
LABELS[:, 1:3, 1:3, 1:3] = 1


@pytest.mark.parametrize("T,steps,monai_wrong", CASES)
def test_every_ddim_step_lands_on_the_next_scheduled_timestep(T, steps, monai_wrong):
    from voxdiff.diffusion import sampling

    probe = X0Probe()
    out = sampling.generate(probe, diffusion(T), LABELS, 2, steps, seed=3, progress=False)
    scheduler = sampling.make_scheduler(diffusion(T), "ddim", steps)
    assert [t for t, _ in probe.calls] == scheduler.timesteps.tolist()
    assert probe.calls[0][0] == T - 1 and probe.calls[-1][0] == 0 and len(probe.calls) == steps
    assert wrong_transitions(probe.calls, scheduler.alphas_cumprod) == []
    # The last step goes from timestep 0 to the clean image: exactly the network's x0.
    assert torch.allclose(out, torch.full_like(out, X0), atol=1e-6)


@pytest.mark.parametrize("T,steps,monai_wrong", CASES)
def test_monai_ddim_scheduler_fails_the_same_check(T, steps, monai_wrong):
    """Negative control: MONAI's own DDIMScheduler, run by MONAI's inferer on the same probe."""
    from monai.inferers import DiffusionInferer
    from monai.networks.schedulers import DDIMScheduler

    from voxdiff.diffusion.sampling import as_one_hot, initial_noise

    d = diffusion(T)
    plain = DDIMScheduler(num_train_timesteps=T, schedule=d.schedule, prediction_type="sample", clip_sample=True)
    plain.set_timesteps(steps)
    probe = X0Probe()
    DiffusionInferer(plain).sample(input_noise=initial_noise(3, 0, 0, (4, 4, 4)), diffusion_model=probe,
                                   scheduler=plain, conditioning=as_one_hot(LABELS, 2), mode="concat",
                                   verbose=False)
    wrong = wrong_transitions(probe.calls, plain.alphas_cumprod)
    assert len(wrong) == monai_wrong and len(probe.calls) - 1 == steps - 1, wrong
    if T == 250:
        assert wrong == [(219, 213), (158, 152), (97, 91), (36, 30)]


def test_ddim_step_matches_monai_where_monai_is_right():
    """Where T // n is the spacing (T = 50, 50 steps; T = 250, 50 steps at 249 -> 244) the step is MONAI's, for
    every prediction type: only the previous timestep changed."""
    from monai.networks.schedulers import DDIMScheduler

    from voxdiff.diffusion import sampling

    g = torch.Generator().manual_seed(0)
    x, out = torch.randn(2, 1, 4, 4, 4, generator=g), torch.randn(2, 1, 4, 4, 4, generator=g) * 0.5
    for T, steps, t in [(50, 50, 30), (250, 50, 249)]:
        for prediction in ("epsilon", "sample", "v_prediction"):
            d = make_params({"diffusion.timesteps": T, "diffusion.prediction": prediction}).diffusion
            ours = sampling.make_scheduler(d, "ddim", steps)
            plain = DDIMScheduler(num_train_timesteps=T, schedule=d.schedule, prediction_type=prediction,
                                  clip_sample=True)
            plain.set_timesteps(steps)
            for a, b in zip(ours.step(out, t, x), plain.step(out, t, x)):
                assert torch.allclose(a, b, atol=1e-6), (T, prediction)
            for eta in (0.5,):  # the stochastic variant too, from the same generator state
                a = ours.step(out, t, x, eta=eta, generator=torch.Generator().manual_seed(1))[0]
                b = plain.step(out, t, x, eta=eta, generator=torch.Generator().manual_seed(1))[0]
                assert torch.allclose(a, b, atol=1e-6), (T, prediction, eta)
    with pytest.raises(ValueError, match="not one of the 50 scheduled"):
        sampling.make_scheduler(diffusion(250), "ddim", 50).step(out, 248, x)
