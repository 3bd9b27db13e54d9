"""Post-hoc EMA: a reconstruction from the snapshots matches an EMA of the same length tracked directly."""

from __future__ import annotations

import math

import pytest
import torch
from ema_pytorch import KarrasEMA

from voxdiff.errors import ParamsError
from voxdiff.training import posthoc_ema
from conftest import make_params


def flat(net: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


def train_with_profiles(folder, steps: int = 200, snapshot_every: int = 10, direct_sigma_rel: float = 0.07):
    """A small regression net trained with Adam; profiles 0.05/0.10 snapshotted, and one EMA of
    `direct_sigma_rel` tracked directly alongside as the truth."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    make_copy = lambda: torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))  # noqa: E731
    tracker = posthoc_ema.ProfileTracker(net, make_copy, (0.05, 0.10), folder)
    direct = KarrasEMA(net, sigma_rel=direct_sigma_rel, update_every=1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    x = torch.randn(256, 8)
    y = torch.sin(x.sum(1, keepdim=True))
    for step in range(1, steps + 1):
        i = torch.randint(0, 256, (4,))
        loss = (net(x[i]) - y[i]).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        tracker.update()
        direct.update()
        if step % snapshot_every == 0:
            tracker.snapshot()
    return net, tracker, direct


def test_reconstruction_matches_a_directly_tracked_ema(tmp_path):
    net, tracker, direct = train_with_profiles(tmp_path / "phema")
    truth = flat(direct.ema_model)
    rebuilt = flat(tracker.reconstruct(0.07))
    assert ((rebuilt - truth).norm() / truth.norm()).item() <= 1e-4
    # Negative controls: another EMA length, and the raw weights, are far off by the same measure,
    # so the match above is not a tolerance any EMA would pass.
    other = flat(tracker.reconstruct(0.15))
    assert ((other - truth).norm() / truth.norm()).item() > 1e-3
    assert ((flat(net) - truth).norm() / truth.norm()).item() > 1e-3


def test_snapshots_are_named_by_profile_and_step_and_newer_ones_can_be_dropped(tmp_path):
    _, tracker, _ = train_with_profiles(tmp_path / "phema", steps=40, snapshot_every=10)
    assert [p.name for p in tracker.snapshots()] == sorted(f"{i}.{s}.pt" for i in (0, 1) for s in (10, 20, 30, 40))
    assert not list((tmp_path / "phema").glob(".*"))  # no temporary files left behind
    tracker.drop_snapshots_after(20)
    assert [p.name for p in tracker.snapshots()] == ["0.10.pt", "0.20.pt", "1.10.pt", "1.20.pt"]
    tracker.drop_snapshots_after(0)
    assert tracker.snapshots() == []
    with pytest.raises(FileNotFoundError):
        tracker.reconstruct(0.07)


def test_profile_state_round_trips(tmp_path):
    _, tracker, _ = train_with_profiles(tmp_path / "a", steps=30)
    _, fresh, _ = train_with_profiles(tmp_path / "b", steps=3)
    fresh.load_state_dict(tracker.state_dict())
    assert fresh.step == tracker.step == 30
    for a, b in zip(tracker.phema.ema_models, fresh.phema.ema_models):
        assert torch.equal(flat(a.ema_model), flat(b.ema_model))


def test_names_and_the_classic_ema_on_the_sigma_rel_axis():
    assert posthoc_ema.metric_name(0.07) == "phema_val_loss_sr070"
    assert posthoc_ema.metric_name(0.2) == "phema_val_loss_sr200"
    # half-life 64 samples read at 1536 samples: mean life 64 / ln 2 = 92.3 samples = 0.0601 of the run
    assert posthoc_ema.classic_ema_sigma_rel(64, 1536) == pytest.approx(64 / math.log(2) / 1536)
    assert posthoc_ema.classic_ema_sigma_rel(64, 1536) == pytest.approx(0.0601, abs=1e-4)


@pytest.mark.parametrize("key, value", [
    ("train.phema_sigma_rels", [0.05]),            # one profile cannot reconstruct anything
    ("train.phema_sigma_rels", [0.05, 0.05]),      # not distinct
    ("train.phema_sigma_rels", [0.05, 0.3]),       # gamma < 0 above 1/sqrt(12)
    ("train.phema_eval_sigma_rels", [0.0]),
    ("train.phema_eval_sigma_rels", []),           # profiles on, nothing to reconstruct
    ("train.phema_eval_sigma_rels", "0.1"),
])
def test_bad_phema_params_name_the_key(key, value):
    with pytest.raises(ParamsError, match=key.replace(".", r"\.")):
        make_params({key: value})


def test_phema_can_be_switched_off():
    p = make_params({"train.phema_sigma_rels": [], "train.phema_eval_sigma_rels": []})
    assert p.train.phema_sigma_rels == ()
