"""The trainer's core properties, each with a control that shows the test can fail."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import make_params
from voxdiff.training import trainer as trainer_mod
from voxdiff.data.cache import open_cache
from voxdiff.runtime.distributed import init_runtime
from voxdiff.training.schedule import ema_beta, lr_at, plan_budget, scaled_lr
from voxdiff.training.trainer import Trainer


def train_weights(root, overrides: dict) -> tuple[dict, Trainer]:
    """Run every optimizer step of the budget in-process; return the final weights and the trainer."""
    p = make_params({"train.grad_clip": 0.0, **overrides})
    rt = init_runtime("cpu", p.train.precision)
    tr = Trainer(p, root, rt, open_cache(root / "data" / "processed"))
    while tr.counters.step < tr.budget.total_steps:
        tr.counters.history.append(tr.train_step())
    return {k: v.detach().clone() for k, v in tr.net.state_dict().items()}, tr


def max_rel_diff(a: dict, b: dict) -> float:
    num = math.sqrt(sum(float((a[k] - b[k]).double().square().sum()) for k in a))
    den = math.sqrt(sum(float(a[k].double().square().sum()) for k in a))
    return num / den


# --- accumulation equivalence ---------------------------------------------------------------------
def test_accumulation_equals_big_batch(tiny_root):
    """4x1, 1x4 and 2x2 follow the same trajectory over 3 optimizer steps (fp32, CPU)."""
    big, _ = train_weights(tiny_root, {"train.batch_size": 4, "train.accumulate_every": 1, "train.max_steps": 3, "train.max_samples": 0})
    acc, _ = train_weights(tiny_root, {"train.batch_size": 1, "train.accumulate_every": 4, "train.max_steps": 3, "train.max_samples": 0})
    mix, _ = train_weights(tiny_root, {"train.batch_size": 2, "train.accumulate_every": 2, "train.max_steps": 3, "train.max_samples": 0})
    assert max_rel_diff(big, acc) <= 1e-5
    assert max_rel_diff(big, mix) <= 1e-5
    # Control: a different effective batch is a different trajectory, far beyond the tolerance.
    other, _ = train_weights(tiny_root, {"train.batch_size": 2, "train.accumulate_every": 1, "train.max_steps": 3, "train.max_samples": 0})
    assert max_rel_diff(big, other) > 1e-3


def test_short_last_window_is_exact(tiny_root):
    """A sample budget of 10 with effective batch 4 ends on a window of 2 samples: still exact."""
    cfg = {"train.max_samples": 10}
    big, tb = train_weights(tiny_root, {**cfg, "train.batch_size": 4, "train.accumulate_every": 1})
    acc, ta = train_weights(tiny_root, {**cfg, "train.batch_size": 1, "train.accumulate_every": 4})
    assert tb.counters.step == ta.counters.step == 3 and ta.counters.samples_seen == 10
    assert max_rel_diff(big, acc) <= 1e-5


@pytest.mark.parametrize("wrong", ["mean_over_k", "extra_1_over_b"])
def test_negative_control_misnormalised_loss_is_caught(tiny_root, monkeypatch, wrong):
    """The equivalence check fails when the loss is normalised the common wrong ways: each micro-batch's
    loss a mean over its own samples (the reduction's default), then divided by k or by the window."""
    real_losses, real_weight = Trainer.losses, trainer_mod.micro_batch_weight

    def mean_per_micro_batch(self, *args):
        per_sample = real_losses(self, *args)
        return per_sample / len(per_sample)

    weights = {"mean_over_k": lambda n_window, budget: 1.0 / budget.accumulate_every,  # HF 2024, Lightning
               "extra_1_over_b": real_weight}  # med-ddpm: loss.sum()/B on an already averaged loss
    monkeypatch.setattr(Trainer, "losses", mean_per_micro_batch)
    monkeypatch.setattr(trainer_mod, "micro_batch_weight", weights[wrong])
    cfg = {"train.max_samples": 10}
    big, _ = train_weights(tiny_root, {**cfg, "train.batch_size": 4, "train.accumulate_every": 1})
    acc, _ = train_weights(tiny_root, {**cfg, "train.batch_size": 1, "train.accumulate_every": 4})
    assert max_rel_diff(big, acc) > 1e-4


def test_activation_checkpointing_keeps_the_trajectory(tiny_root):
    plain, _ = train_weights(tiny_root, {"train.max_steps": 2, "train.max_samples": 0})
    ckpt, _ = train_weights(tiny_root, {"train.max_steps": 2, "train.max_samples": 0, "model.activation_checkpointing": True})
    assert max_rel_diff(plain, ckpt) <= 1e-5


# --- once per optimizer step ----------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_step_side_effects_happen_once_per_window(tiny_root, monkeypatch, precision):
    counts = {"opt": 0, "clip": 0, "unscale": 0, "update": 0, "ema": 0, "backward": 0}
    p = make_params({"train.batch_size": 1, "train.accumulate_every": 3, "train.max_samples": 7,
                     "train.precision": precision, "train.grad_clip": 1.0})
    rt = init_runtime("cpu", precision)
    tr = Trainer(p, tiny_root, rt, open_cache(tiny_root / "data" / "processed"))

    def spy(obj, name, key):
        real = getattr(obj, name)

        def wrapped(*a, **k):
            counts[key] += 1
            return real(*a, **k)

        monkeypatch.setattr(obj, name, wrapped)

    spy(tr.opt, "step", "opt")
    spy(tr.scaler, "unscale_", "unscale")
    spy(tr.scaler, "update", "update")
    spy(tr.ema, "update_parameters", "ema")
    spy(torch.nn.utils, "clip_grad_norm_", "clip")
    real_backward = torch.Tensor.backward

    def backward(self, *a, **k):
        counts["backward"] += 1
        return real_backward(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "backward", backward)
    lrs = []
    while tr.counters.step < tr.budget.total_steps:
        rec = tr.train_step()
        lrs.append(rec["lr"])
    steps = tr.budget.total_steps
    assert steps == 3 and tr.counters.samples_seen == 7  # windows of 3, 3, 1
    assert counts["backward"] == 7  # one per non-empty micro-batch
    assert counts["clip"] == counts["unscale"] == counts["update"] == steps
    assert counts["ema"] + tr.counters.skipped_steps == steps == tr.counters.ema_updates + tr.counters.skipped_steps
    if precision == "fp32":
        assert counts["opt"] == steps and tr.counters.skipped_steps == 0
    assert len(lrs) == steps


def test_fp16_overflow_is_counted_not_divergence(tiny_root):
    """A huge loss scale overflows fp16 gradients: the step is skipped and counted, EMA untouched."""
    p = make_params({"train.precision": "fp16", "train.max_steps": 2, "train.max_samples": 0})
    rt = init_runtime("cpu", "fp16")
    tr = Trainer(p, tiny_root, rt, open_cache(tiny_root / "data" / "processed"))
    tr.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 60)
    before = {k: v.clone() for k, v in tr.net.state_dict().items()}
    tr.train_step()
    assert tr.counters.skipped_steps == 1 and tr.counters.ema_updates == 0
    assert max_rel_diff(before, tr.net.state_dict()) == 0.0
    assert tr.scaler.get_scale() < 2.0 ** 60


# --- budget, LR, EMA arithmetic -------------------------------------------------------------------
def test_budget_in_steps_and_samples():
    p = make_params({"train.batch_size": 2, "train.accumulate_every": 3, "train.max_samples": 25})
    b = plan_budget(p.train, world_size=1)
    assert (b.effective_batch, b.total_steps, b.total_samples) == (6, 5, 25)
    assert list(b.window(4)) == [24]
    assert b.micro_batches(4, 0) == [[24], [], []]
    p = make_params({"train.batch_size": 2, "train.accumulate_every": 3, "train.max_steps": 5, "train.max_samples": 0})
    b = plan_budget(p.train, world_size=2)
    assert (b.effective_batch, b.total_steps, b.total_samples) == (12, 5, 60)
    # Two ranks share each window round-robin; together they cover it exactly once.
    r0, r1 = b.micro_batches(1, 0), b.micro_batches(1, 1)
    assert sorted(i for m in r0 + r1 for i in m) == list(range(12, 24))
    assert r0[0] == [12, 13] and r1[0] == [14, 15]


def test_lr_scaling_and_warmup():
    base = {"train.lr": 1.0e-4, "train.reference_batch": 2, "train.warmup_samples": 100}
    for rule, factor in (("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)):
        t = make_params({**base, "train.lr_scaling": rule}).train
        assert scaled_lr(t, 8) == pytest.approx(1e-4 * factor)
        assert lr_at(t, 8, 50, 1000) == pytest.approx(0.5e-4 * factor)
        assert lr_at(t, 8, 500, 1000) == pytest.approx(1e-4 * factor)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_lr_decays_to_lr_min_over_the_budget_in_samples(schedule):
    t = make_params({"train.lr": 1.0e-3, "train.lr_min": 1.0e-5, "train.warmup_samples": 100,
                     "train.lr_schedule": schedule}).train
    assert lr_at(t, 4, 50, 1100) == pytest.approx(0.5e-3)        # warm-up unchanged
    assert lr_at(t, 4, 100, 1100) == pytest.approx(1e-3)         # peak right after it
    assert lr_at(t, 4, 600, 1100) == pytest.approx(0.5 * (1e-3 + 1e-5))  # half way: both shapes at the mean
    assert lr_at(t, 4, 1100, 1100) == pytest.approx(1e-5)        # lr_min at the end of the budget
    quarter = lr_at(t, 4, 350, 1100)
    expected = 1e-5 + (1e-3 - 1e-5) * (0.5 * (1 + math.cos(math.pi / 4)) if schedule == "cosine" else 0.75)
    assert quarter == pytest.approx(expected)
    # Counted in samples: the same sample count gets the same LR at every effective batch.
    assert lr_at(t, 1, 600, 1100) == lr_at(t, 4, 600, 1100)
    constant = make_params({"train.warmup_samples": 100, "train.lr_schedule": "constant"}).train
    assert lr_at(constant, 4, 1100, 1100) == pytest.approx(constant.lr)  # negative control


def test_logged_lr_reaches_lr_min_at_the_last_step(tiny_root):
    _, tr = train_weights(tiny_root, {"train.batch_size": 1, "train.accumulate_every": 2, "train.max_steps": 4,
                                      "train.max_samples": 0, "train.lr_schedule": "linear",
                                      "train.lr_min": 1.0e-5, "train.lr": 1.0e-3})
    lrs = [h["lr"] for h in tr.counters.history]
    assert lrs[-1] == pytest.approx(1e-5) and lrs == sorted(lrs, reverse=True)


def test_logged_lr_follows_the_rule(tiny_root):
    _, tr = train_weights(tiny_root, {"train.batch_size": 1, "train.accumulate_every": 4, "train.max_steps": 2,
                                      "train.max_samples": 0, "train.lr_scaling": "linear",
                                      "train.reference_batch": 2, "train.lr": 1.0e-3})
    assert tr.opt.param_groups[0]["lr"] == pytest.approx(2e-3)


def test_ema_halflife_is_counted_in_samples():
    t = make_params({"train.ema_halflife_samples": 64.0, "train.ema_rampup_ratio": 0.0}).train
    # Eight steps of 8 samples decay the EMA as much as one step of 64 samples: half.
    assert ema_beta(t, 8, 1000) ** 8 == pytest.approx(0.5)
    assert ema_beta(t, 64, 1000) == pytest.approx(0.5)


# --- determinism and divergence ---------------------------------------------------------------------
def test_same_params_same_bits(tiny_root):
    a, ta = train_weights(tiny_root, {"train.max_samples": 6})
    b, tb = train_weights(tiny_root, {"train.max_samples": 6})
    assert all(torch.equal(a[k], b[k]) for k in a)
    strip = lambda h: [{k: v for k, v in r.items() if k not in ("wall_time", "samples_per_s", "peak_memory_mb")} for r in h]
    assert strip(ta.counters.history) == strip(tb.counters.history)
    c, _ = train_weights(tiny_root, {"train.max_samples": 6, "seed": 1})
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_nan_loss_stops_with_the_step(tiny_root):
    import numpy as np

    from voxdiff.runtime.errors import TrainingDiverged

    images = np.load(tiny_root / "data/processed/images.npy")
    images[:4] = np.nan  # every training subject
    np.save(tiny_root / "data/processed/images.npy", images)
    p = make_params({"train.max_samples": 6})
    tr = Trainer(p, tiny_root, init_runtime("cpu", "fp32"), open_cache(tiny_root / "data" / "processed"))
    with pytest.raises(TrainingDiverged, match="optimizer step 1"):
        tr.train_step()
