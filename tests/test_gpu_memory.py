"""GPU memory refused up front, in one line (issue 36 item 9): a pure function of (estimate, free memory) that
the CPU tests, called where training and `voxdiff train --plan` start on CUDA."""

from __future__ import annotations

import pytest
import torch

from conftest import REPO, make_params
from voxdiff.runtime.errors import VoxdiffError
from voxdiff.params import load
from voxdiff.pipeline import plan


# --- item 9: GPU memory ---------------------------------------------------------------------------------
def test_gpu_memory_refusal_names_estimate_free_memory_and_the_micro_batch_that_fits():
    """A pure function of (estimate, free): the GPU preset's estimate against 80, 40 and 16 GB free."""
    p = load(REPO / "params-gpu.yaml")
    e = plan.memory_estimate(p, len(p.data.label_values), "bf16")
    assert 1e9 < e.fixed < 2e9 and 10e9 < e.per_sample < 25e9  # 41 M weights; activations at 128^3
    assert plan.memory_refusal(e, 80 * 10**9, 1, 2, 1, "cuda:0") is None  # the preset: micro-batch 1 x 2
    line = plan.memory_refusal(e, 40 * 10**9, 4, 2, 1, "cuda:0")  # effective batch 8 at micro-batch 4
    fits = e.fitting(40 * 10**9)
    assert fits == 2 and "\n" not in line
    assert line.startswith("cuda:0: not enough GPU memory for train.batch_size 4: a training step needs ~")
    assert f"{plan.fmt_bytes(e.at(4))} (estimated" in line and "40.00 GB are free" in line
    assert line.endswith("micro-batch 2 fits: set train.batch_size: 2 and train.accumulate_every: 4 to keep the "
                         "effective batch 8")
    assert "not even micro-batch 1 fits: set model.activation_checkpointing: true" in plan.memory_refusal(
        e, 16 * 10**9, 1, 2, 1, "cuda:0")
    # the suggestion keeps the effective batch exactly: a micro-batch that divides batch x accumulate
    assert plan.memory_refusal(e, 40 * 10**9, 3, 1, 2, "cuda:1").endswith(
        "set train.batch_size: 1 and train.accumulate_every: 3 to keep the effective batch 6")


def test_the_activation_estimate_is_what_autograd_keeps_in_a_real_forward():
    """The meta-device count equals the bytes autograd saves in a real CPU forward of the demo network with
    the fused attention (as CUDA runs it; on the CPU too)."""
    from voxdiff.diffusion.model import build_network

    p = load(REPO / "params.yaml")
    classes = len(p.data.label_values)
    full, half = plan.activation_bytes(p, classes)
    net = build_network(p.model, classes, flash_attention=True)
    saved = {}
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.__setitem__(id(t), t) or t, lambda t: t):
        out = net(torch.zeros(1, 1 + classes, *p.preprocess.shape), timesteps=torch.zeros(1, dtype=torch.long))
    real = sum(t.numel() * t.element_size() for t in saved.values())
    # 0.2 % apart: the CPU's fused kernel keeps a few more small tensors than q, k, v, output and log-sum-exp
    assert full == pytest.approx(real, rel=0.01) and half == pytest.approx(full / 2, rel=0.01)
    assert out.grad_fn is not None
    assert plan.memory_estimate(p, classes, "fp32").per_sample == full


def test_training_on_cuda_is_refused_before_any_weight_when_the_step_cannot_fit(tiny_root, monkeypatch):
    """check_gpu_memory reads CUDA's free memory (here 1 GB: the CUDA query is the one thing faked, no GPU
    here) and refuses the configured micro-batch in one line; training calls it before building the trainer."""
    import inspect

    from voxdiff.pipeline import train

    p = make_params({"preprocess.shape": [64, 64, 64], "train.batch_size": 16})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10**9, 80 * 10**9))
    with pytest.raises(VoxdiffError, match=r"^cuda:0: not enough GPU memory for train.batch_size 16: .* 1\.00 GB "
                                           r"are free; micro-batch \d+ fits"):
        plan.check_gpu_memory(p, torch.device("cuda:0"), 3, 1, "bf16")
    source = inspect.getsource(train._run)
    assert source.index("plan.check_gpu_memory(") < source.index("Trainer(params, root, rt, cache)")


def test_the_plan_prints_the_gpu_memory_estimate(tiny_root):
    p = make_params({"train.max_samples": 8, "train.gns_probe_samples": 4})
    out: list[str] = []
    result = plan.run_plan(p, tiny_root, steps=1, echo=out.append)
    mem = result["memory_estimate"]
    assert mem == plan.memory_estimate(p, 3, "fp32").__dict__
    line = next(line for line in out if line.lstrip().startswith("GPU memory"))
    need = mem["fixed"] + p.train.batch_size * mem["per_sample"]
    assert f"estimated {plan.fmt_bytes(need)} at micro-batch {p.train.batch_size}" in line
