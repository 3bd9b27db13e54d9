"""What training holds fixed across accumulate_every, and how it stops: validation counted in samples,
the EMA half-life in force, Adam's SDE scaling rule, the noise-scale wiring through Trainer against an
analytic truth, one host read per step for the probe, and Ctrl-C at a window boundary."""

from __future__ import annotations

import csv
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml

from conftest import REPO, make_params, uninterrupted_run, without_timing
from voxdiff.training import trainer as trainer_mod
from voxdiff.data.cache import open_cache
from voxdiff.runtime.distributed import init_runtime
from voxdiff.params import validate
from voxdiff.training.schedule import adam_settings, ema_halflife, ema_rampup_end, plan_budget
from voxdiff.pipeline.train import run_training
from voxdiff.training.trainer import GradProbe, Trainer


def val_samples(root: Path) -> list[int]:
    with open(root / "metrics" / "val_curve.tsv") as fh:
        return [int(r["samples_seen"]) for r in csv.DictReader(fh, delimiter="\t")]


# --- validation at equal samples ------------------------------------------------------------------
@pytest.mark.parametrize("batch,k,expected", [(1, 1, [4, 8, 12, 16]), (1, 4, [4, 8, 12, 16]), (2, 4, [8, 16])])
def test_validation_is_counted_in_samples(tiny_root, batch, k, expected):
    """val_every_samples=4: every run validates at the same samples (k=1 and k=4 alike); an effective
    batch larger than the cadence validates after every step."""
    p = make_params({"train.max_samples": 16, "train.batch_size": batch, "train.accumulate_every": k,
                     "train.val_every_samples": 4, "train.checkpoint_every": 100})
    run_training(p, tiny_root, progress=False)
    assert val_samples(tiny_root) == expected


# --- EMA half-life --------------------------------------------------------------------------------
@pytest.mark.parametrize("params_file", ["params.yaml", "params-gpu.yaml"])
def test_shipped_ema_halflife_takes_effect_early(params_file):
    """The configured half-life is in force from at most a quarter of the budget on (before the fix the
    demo's stayed at 0.05 x samples seen, at most 25.6 of its 64 samples, for the whole run)."""
    p = validate(yaml.safe_load((REPO / params_file).read_text()))
    t = p.train
    total = plan_budget(t, 1).total_samples
    assert ema_rampup_end(t) <= 0.25 * total
    assert ema_halflife(t, int(ema_rampup_end(t)) + 1) == t.ema_halflife_samples
    assert ema_halflife(t, total) == t.ema_halflife_samples


def test_effective_ema_halflife_is_logged(tiny_root):
    p = make_params({"train.max_samples": 16, "train.batch_size": 1, "train.accumulate_every": 2,
                     "train.ema_halflife_samples": 2.0, "train.ema_rampup_ratio": 0.5})
    run_training(p, tiny_root, progress=False)
    with open(tiny_root / "metrics" / "train_curve.tsv") as fh:
        rows = list(csv.DictReader(fh, delimiter="\t"))
    assert [float(r["ema_halflife"]) for r in rows][:3] == [1.0, 2.0, 2.0]  # 0.5 x 2, then capped at 2


# --- Adam's SDE scaling rule ----------------------------------------------------------------------
def test_adam_sde_rule_known_numbers():
    """kappa = 16 / 4 = 4: lr x 2, 1 - beta x 4, eps / 2 (Malladi et al. 2022)."""
    t = make_params({"train.lr": 1.0e-4, "train.reference_batch": 4, "train.lr_scaling": "sde",
                     "train.adam_betas": [0.9, 0.999], "train.adam_eps": 1.0e-8}).train
    a = adam_settings(t, 16)
    assert a.lr == pytest.approx(2e-4)
    assert a.betas == pytest.approx((0.6, 0.996))
    assert a.eps == pytest.approx(0.5e-8)
    # At the reference batch nothing changes; sqrt scales the lr only.
    assert adam_settings(t, 4).betas == pytest.approx((0.9, 0.999))
    sqrt = make_params({"train.lr": 1.0e-4, "train.reference_batch": 4, "train.lr_scaling": "sqrt"}).train
    assert adam_settings(sqrt, 16).betas == pytest.approx((0.9, 0.999))


def test_adam_sde_rule_reaches_the_optimizer_and_refuses_negative_betas(tiny_root):
    from voxdiff.runtime.errors import ParamsError

    p = make_params({"train.batch_size": 2, "train.accumulate_every": 2, "train.reference_batch": 1,
                     "train.lr_scaling": "sde", "train.adam_betas": [0.9, 0.99]})
    tr = Trainer(p, tiny_root, init_runtime("cpu", "fp32"), open_cache(tiny_root / "data" / "processed"))
    assert tr.opt.param_groups[0]["betas"] == pytest.approx((0.6, 0.96))
    bad = make_params({"train.batch_size": 2, "train.accumulate_every": 8, "train.reference_batch": 1,
                       "train.lr_scaling": "sde"})
    with pytest.raises(ParamsError, match="train.lr_scaling=sde"):
        Trainer(bad, tiny_root, init_runtime("cpu", "fp32"), open_cache(tiny_root / "data" / "processed"))


# --- the trainer's noise-scale wiring against an analytic truth -------------------------------------
class ConstantPrediction(torch.nn.Module):
    """A 'network' whose prediction is a learnable constant volume w, whatever its input.

    With epsilon prediction and the l2 loss, sample i's loss is mean_v (w_v - eps_iv)^2 over d voxels,
    so its gradient is 2 (w - eps_i) / d: G = 2 w / d and Sigma = (4 / d^2) I, hence
    B_simple = tr(Sigma) / |G|^2 = d / |w|^2 = 1 / c^2 for w = c everywhere.
    """

    def __init__(self, shape, c: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((1, 1, *shape), c))

    def forward(self, x, timesteps=None, context=None):
        return self.w.expand(x.shape[0], *self.w.shape[1:])


@pytest.mark.parametrize("c,batch,k", [(0.5, 1, 4), (0.25, 2, 2)])
def test_trainer_noise_scale_matches_analytic_truth(tiny_root, monkeypatch, c, batch, k):
    shape = (16, 16, 16)
    monkeypatch.setattr(trainer_mod, "build_network", lambda model, classes, **kw: ConstantPrediction(shape, c))
    p = make_params({"train.batch_size": batch, "train.accumulate_every": k, "train.max_steps": 60,
                     "train.max_samples": 0, "train.lr": 1.0e-12, "train.warmup_samples": 0,
                     "train.grad_clip": 0.0, "train.gns_smoothing": 0.9, "diffusion.prediction": "epsilon",
                     "diffusion.loss": "l2"})
    tr = Trainer(p, tiny_root, init_runtime("cpu", "fp32"), open_cache(tiny_root / "data" / "processed"))
    for _ in range(60):
        rec = tr.train_step()
    truth = 1 / c ** 2
    assert rec["gns"] == pytest.approx(truth, rel=0.1)
    # Control: the same trainer with the loss factor the probe divides by left out is far off.
    monkeypatch.setattr(GradProbe, "record", lambda self, f, _real=GradProbe.record: _real(self, 1.0))
    tr2 = Trainer(p, tiny_root, init_runtime("cpu", "fp32"), open_cache(tiny_root / "data" / "processed"))
    for _ in range(60):
        rec2 = tr2.train_step()
    assert not rec2["gns"] == pytest.approx(truth, rel=0.5)


def test_probe_reads_the_device_once_per_step(tiny_root, monkeypatch):
    """GradProbe keeps its sums on the device: no host read while recording micro-batches, one per step
    (before: one float() per parameter tensor per micro-batch, a GPU sync each)."""
    p = make_params({"train.batch_size": 1, "train.accumulate_every": 4, "train.max_steps": 1, "train.max_samples": 0})
    tr = Trainer(p, tiny_root, init_runtime("cpu", "fp32"), open_cache(tiny_root / "data" / "processed"))
    reads = {"record": 0, "total": 0}
    where = {"now": None}
    real_float, real_item = torch.Tensor.__float__, torch.Tensor.item

    def counting_float(self):
        if where["now"]:
            reads[where["now"]] += 1
        return real_float(self)

    def counting_item(self):
        if where["now"]:
            reads[where["now"]] += 1
        return real_item(self)

    def tracked(name, real):
        def wrapped(self, *a, **kw):
            where["now"] = name
            try:
                return real(self, *a, **kw)
            finally:
                where["now"] = None
        return wrapped

    monkeypatch.setattr(torch.Tensor, "__float__", counting_float)
    monkeypatch.setattr(torch.Tensor, "item", counting_item)
    monkeypatch.setattr(GradProbe, "record", tracked("record", GradProbe.record))
    monkeypatch.setattr(GradProbe, "total", tracked("total", GradProbe.total))
    tr.train_step()
    assert reads == {"record": 0, "total": 1}


# --- Ctrl-C ---------------------------------------------------------------------------------------
def test_ctrl_c_during_validation_resumes_exactly(tiny_root, tmp_path, monkeypatch):
    """SIGINT arrives in the middle of a validation: training finishes that step (validation included),
    saves, stops; the rerun resumes and ends with the same weights and history as an uninterrupted run."""
    cfg = {"train.max_samples": 24, "train.batch_size": 1, "train.accumulate_every": 2,
           "train.val_every_samples": 4, "train.checkpoint_every": 100}
    ref = uninterrupted_run(tiny_root, tmp_path / "ref", make_params(cfg))

    real_validation = Trainer.validation_loss
    calls = {"n": 0}

    def interrupted_validation(self):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)  # lands inside validation
        return real_validation(self)

    monkeypatch.setattr(Trainer, "validation_loss", interrupted_validation)
    with pytest.raises(KeyboardInterrupt):
        run_training(make_params(cfg), tiny_root, progress=False)
    stopped = torch.load(tiny_root / "models" / "checkpoint.pt", weights_only=True)
    assert stopped["step"] == 4 and not stopped["finished"]
    assert stopped["history"][-1]["val_loss"] is not None  # the interrupted validation was completed

    monkeypatch.setattr(Trainer, "validation_loss", real_validation)
    run_training(make_params(cfg), tiny_root, progress=False)
    done = torch.load(tiny_root / "models" / "checkpoint.pt", weights_only=True)
    assert all(torch.equal(ref["model"][k], done["model"][k]) for k in ref["model"])
    assert without_timing(ref["history"]) == without_timing(done["history"])
    assert math.isfinite(done["history"][-1]["val_loss"])


def test_kept_copies_are_whole_states_and_change_nothing(tiny_root, tmp_path):
    """train.keep_checkpoints_at_samples: a copy where samples seen first reaches each point (at that step's end).
    The run ends as one without them, bit for bit (the key is operational), and a run resumed from a copy ends as
    the uninterrupted one: the copy is a whole training state, what `voxdiff advise --checkpoint` continues."""
    # no post-hoc EMA profiles: a run resumed from a copy elsewhere would need their snapshots up to it as well
    cfg = {"train.max_samples": 12, "train.batch_size": 1, "train.accumulate_every": 2, "train.checkpoint_every": 100,
           "train.phema_sigma_rels": []}
    ref = uninterrupted_run(tiny_root, tmp_path / "ref", make_params(cfg))
    run_training(make_params({**cfg, "train.keep_checkpoints_at_samples": [3, 8]}), tiny_root, progress=False)
    folder = tiny_root / "models" / "kept"
    assert sorted(p.name for p in folder.glob("*.pt")) == ["samples-00000004.pt", "samples-00000008.pt"]  # 2 a step
    done = torch.load(tiny_root / "models" / "checkpoint.pt", weights_only=True)
    assert done["fingerprint"] == ref["fingerprint"]
    for key in ("model", "ema"):
        assert all(torch.equal(ref[key][k], done[key][k]) for k in ref[key]), key

    copy = torch.load(folder / "samples-00000004.pt", weights_only=True)
    assert (copy["step"], copy["samples_seen"], copy["finished"]) == (2, 4, False)
    copy["mlflow_run_id"] = ""  # it names the run it was copied from, which must not be logged into a second time
    other = tmp_path / "from-copy"
    (other / "models").mkdir(parents=True)
    (other / "data").symlink_to(tiny_root / "data")
    torch.save(copy, other / "models" / "checkpoint.pt")
    run_training(make_params(cfg), other, progress=False)
    resumed = torch.load(other / "models" / "checkpoint.pt", weights_only=True)
    for key in ("model", "ema"):
        assert all(torch.equal(ref[key][k], resumed[key][k]) for k in ref[key]), key
    assert without_timing(resumed["history"]) == without_timing(ref["history"])

    # A fresh start (another lr) replaces the run, and its copies go with it
    run_training(make_params({**cfg, "train.lr": 5.0e-4}), tiny_root, progress=False)
    assert not list(folder.glob("*.pt"))


def test_a_kill_between_the_copy_and_the_checkpoint_writes_the_copy_again(tiny_root, tmp_path, monkeypatch):
    """The copy is written before models/checkpoint.pt: a process killed between the two resumes from the step
    before and writes the same copy again. (Written the other way round, the resumed run would start past the
    point and never write it: the negative control is the first assertion after the kill.)"""
    from voxdiff.training import checkpoint

    cfg = {"train.max_samples": 12, "train.batch_size": 1, "train.accumulate_every": 2, "train.checkpoint_every": 1,
           "train.phema_sigma_rels": [], "train.keep_checkpoints_at_samples": [4]}
    real_save = checkpoint.save
    copies = []

    def killed_after_the_copy(path, state):
        if Path(path).name == "checkpoint.pt" and copies:
            raise SystemExit("killed")  # between the copy and the checkpoint of the step that crossed 4 samples
        real_save(path, state)
        copies.extend([path] if Path(path).parent.name == "kept" else [])

    monkeypatch.setattr(checkpoint, "save", killed_after_the_copy)
    with pytest.raises(SystemExit):
        run_training(make_params(cfg), tiny_root, progress=False)
    monkeypatch.setattr(checkpoint, "save", real_save)
    folder = tiny_root / "models" / "kept"
    first = torch.load(folder / "samples-00000004.pt", weights_only=True)
    assert torch.load(tiny_root / "models" / "checkpoint.pt", weights_only=True)["samples_seen"] == 2
    (folder / "samples-00000004.pt").unlink()
    run_training(make_params(cfg), tiny_root, progress=False)  # resumes at 2 samples and crosses 4 again
    again = torch.load(folder / "samples-00000004.pt", weights_only=True)
    assert all(torch.equal(first["model"][k], again["model"][k]) for k in first["model"])
    assert first["samples_seen"] == again["samples_seen"] == 4


def test_kept_copy_points_are_validated_and_planned(tmp_path):
    import dataclasses

    from voxdiff.params import ParamsError
    from voxdiff.pipeline.plan import checkpoint_bytes, count_events, disk_needs, sizes_for

    cfg = {"train.max_samples": 12, "train.batch_size": 1, "train.accumulate_every": 2}
    p = make_params({**cfg, "train.keep_checkpoints_at_samples": [1, 3, 8]})
    events = count_events(p.train)
    assert events.kept == 3 and count_events(make_params(cfg).train).kept == 0
    assert count_events(p.train, start_step=2).kept == 1  # resumed at 4 samples: only 8 is still to come
    from voxdiff.pipeline.plan import measuring_params

    assert measuring_params(p, 2).train.keep_checkpoints_at_samples == ()  # --plan's measured steps keep no copies
    sizes = sizes_for(p, 3)
    need = lambda ev: sum(n for d in disk_needs(p, tmp_path, sizes, ev) for _, n in d.items)  # noqa: E731
    assert need(events) - need(dataclasses.replace(events, kept=0)) == 3 * checkpoint_bytes(sizes, p.train, events)
    with pytest.raises(ParamsError, match=r"train.keep_checkpoints_at_samples holds 13, past the run's end"):
        make_params({**cfg, "train.keep_checkpoints_at_samples": [4, 13]})
    for bad in ([4, 4], [0], "4", [2.5]):
        with pytest.raises(ParamsError, match="train.keep_checkpoints_at_samples"):
            make_params({**cfg, "train.keep_checkpoints_at_samples": bad})


def test_second_ctrl_c_mid_step_keeps_the_last_good_checkpoint(tiny_root, tmp_path, monkeypatch, request):
    """Two SIGINTs land right after optimizer step 3 moved the weights, before its counters advance (issue
    36 item 6): the first is deferred, the second acts at once. The checkpoint on disk must stay the step-2
    one, byte for byte (saving there wrote new weights under old counters, and the resumed run stepped them
    twice), and the rerun must end bit for bit where an uninterrupted run ends."""
    cfg = {"train.max_samples": 12, "train.batch_size": 1, "train.accumulate_every": 2,
           "train.val_every_samples": 4, "train.checkpoint_every": 2}
    ref = uninterrupted_run(tiny_root, tmp_path / "ref", make_params(cfg))

    ckpt = tiny_root / "models" / "checkpoint.pt"
    real_step = Trainer.optimizer_step
    good = {}
    # A user's shell gives Python its own SIGINT handler; a test earlier on this worker may have left another
    # (the second Ctrl-C then does what that one does): start from Python's, and put back what was there.
    outer = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, outer))

    def torn(self, n_window):
        out = real_step(self, n_window)
        if self.counters.step == 2:  # step 3's update is applied; counters still say 2
            good["bytes"] = ckpt.read_bytes()  # the periodic checkpoint of step 2
            os.kill(os.getpid(), signal.SIGINT)  # deferred to the step's end
            # Two signals pending at once run a Python handler once (CPython trips a flag per signal, and
            # torch's threads may take the delivery): send the second after the first was handled.
            deadline = time.monotonic() + 10
            while getattr(signal.getsignal(signal.SIGINT), "__name__", "") == "_handler":
                assert time.monotonic() < deadline, "the first SIGINT was never handled"
                time.sleep(0.001)
            os.kill(os.getpid(), signal.SIGINT)  # the previous handler is back: KeyboardInterrupt here
        return out

    monkeypatch.setattr(Trainer, "optimizer_step", torn)
    with pytest.raises(KeyboardInterrupt):
        run_training(make_params(cfg), tiny_root, progress=False)
    assert ckpt.read_bytes() == good["bytes"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.setattr(Trainer, "optimizer_step", real_step)
    run_training(make_params(cfg), tiny_root, progress=False)
    done = torch.load(ckpt, weights_only=True)
    assert done["step"] == ref["step"] == 6
    assert all(torch.equal(ref["model"][k], done["model"][k]) for k in ref["model"])


def test_flattening_compares_last_and_first_quarter_gains():
    from voxdiff.pipeline.train import flattening

    samples = [100, 200, 300, 400]
    # first quarter (100 -> 100): starts at the first validation; here: 1.0 at 100, 0.5 at 200 ...
    assert flattening([0, 100, 200, 300, 400], [1.0, 0.5, 0.4, 0.35, 0.34]) == pytest.approx(0.01 / 0.5)
    assert flattening(samples, [1.0, 1.0, 1.0, 1.0]) is None  # no first-quarter gain
    assert flattening([1, 2], [1.0, 0.5]) is None
    linear = flattening([0, 100, 200, 300, 400], [4.0, 3.0, 2.0, 1.0, 0.0])
    assert linear == pytest.approx(1.0)  # still falling as fast as at the start


# --- noise scale per timestep bucket -------------------------------------------------------------
def test_b_simple_from_gram_known_numbers():
    import numpy as np

    from voxdiff.training.gns import b_simple_from_gram, bucket_edges, jackknife_se

    rng = np.random.default_rng(0)
    mean = np.full(2000, 0.1)  # |G|^2 = 20; per-sample noise N(0, 1) per coordinate: tr(Sigma) = 2000
    g = mean + rng.standard_normal((64, 2000))
    b, trace, grad_sq = b_simple_from_gram(g @ g.T)
    assert trace == pytest.approx(2000, rel=0.05) and grad_sq == pytest.approx(20, rel=0.3)
    assert b == pytest.approx(100, rel=0.3) and jackknife_se(g[:8] @ g[:8].T) > 0
    assert bucket_edges(250, 4) == [(0, 62), (62, 125), (125, 188), (188, 250)]


def test_bucket_noise_scale_matches_truth_and_leaves_training_alone(tiny_root, monkeypatch):
    """With a constant prediction w = c and the epsilon target, every bucket's B_simple is 1/c^2; and a
    run with the probe equals a run without it, weights and every shared history field."""
    shape = (16, 16, 16)
    monkeypatch.setattr(trainer_mod, "build_network", lambda model, classes, **kw: ConstantPrediction(shape, 0.5))
    cfg = {"train.max_steps": 3, "train.max_samples": 0, "diffusion.prediction": "epsilon",
           "diffusion.loss": "l2", "train.gns_buckets": 4, "train.gns_bucket_samples": 8}
    tr = Trainer(make_params(cfg), tiny_root, init_runtime("cpu", "fp32"), open_cache(tiny_root / "data" / "processed"))
    values = tr.bucket_noise_scale()
    for b in range(4):
        assert values[f"gns_t{b}"] == pytest.approx(4.0, rel=0.25), values
        assert 0 < values[f"gns_t{b}_se"] < 2.0
    monkeypatch.undo()

    def run(every):
        p = make_params({"train.max_samples": 12, "train.gns_buckets_every_samples": every,
                         "train.gns_bucket_samples": 3, "train.val_every_samples": 4})
        run_training(p, tiny_root, progress=False)
        ck = torch.load(tiny_root / "models" / "checkpoint.pt", weights_only=True)
        (tiny_root / "models" / "checkpoint.pt").unlink()
        return ck

    on, off = run(4), run(0)
    assert all(torch.equal(on["model"][k], off["model"][k]) for k in on["model"])
    shared = ("step", "samples_seen", "train_loss", "val_loss", "grad_norm", "gns")
    assert [{k: h[k] for k in shared} for h in on["history"]] == [{k: h[k] for k in shared} for h in off["history"]]
    probed = [h for h in on["history"] if "gns_t0" in h]
    assert [h["samples_seen"] for h in probed] == [4, 8, 12] and not any("gns_t0" in h for h in off["history"])


# --- GPU-path wiring that a CPU can still check ------------------------------------------------------
def test_flash_attention_switch_keeps_the_network_and_is_on_for_cuda_only(tiny_root, monkeypatch):
    """MONAI's use_flash_attention (torch SDPA) gives the same outputs from the same weights; the trainer
    turns it on only for CUDA devices."""
    from voxdiff.diffusion.model import build_network

    p = make_params()
    torch.manual_seed(0)
    plain = build_network(p.model, 3)
    flash = build_network(p.model, 3, flash_attention=True)
    flash.load_state_dict(plain.state_dict())
    x, t = torch.randn(2, 4, 16, 16, 16), torch.tensor([3, 40])
    with torch.no_grad():
        assert torch.allclose(plain(x, timesteps=t), flash(x, timesteps=t), atol=1e-5)
    seen = []
    monkeypatch.setattr(trainer_mod, "build_network",
                        lambda model, classes, flash_attention=False: seen.append(flash_attention) or plain)
    Trainer(p, tiny_root, init_runtime("cpu", "fp32"), open_cache(tiny_root / "data" / "processed"))
    assert seen == [False]


def test_explicit_cuda_device_is_refused_under_torchrun(monkeypatch):
    """train.device: cuda:1 under torchrun would put every rank on GPU 1: refused with the key named."""
    from voxdiff.runtime.errors import VoxdiffError
    from voxdiff.runtime.distributed import pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(VoxdiffError, match="train.device is 'cuda:1' under torchrun"):
        pick_device("cuda:1", local_rank=1, world_size=2)
    assert pick_device("cuda", local_rank=1, world_size=2) == torch.device("cuda:1")
    assert pick_device("cuda:1", local_rank=0, world_size=1) == torch.device("cuda:1")


def test_sampling_runs_the_network_under_the_training_autocast():
    """Evaluation samples under the precision training used (bf16 where auto picks it): the autocast
    context wraps every network call of the sampler, and the result stays float32 in [-1, 1]."""
    import contextlib

    from voxdiff.diffusion import sampling
    from voxdiff.diffusion.model import build_network

    p = make_params()
    net = build_network(p.model, 3).eval()
    entered = []

    @contextlib.contextmanager
    def counting():
        entered.append(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            yield

    labels = torch.zeros(1, 16, 16, 16, dtype=torch.long)
    out = sampling.generate(net, p.diffusion, labels, 3, 4, seed=0, progress=False, autocast=counting)
    assert len(entered) == 4 and out.dtype == torch.float32 and out.abs().max() <= 1.0
