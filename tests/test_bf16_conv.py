"""bf16 conv3d against fp32 at every convolution shape of the network (issue 36 item 12; PyTorch issue 169688:
AMX's bf16 kernel is wrong when the output width is 1 and the width stride above 1)."""

from __future__ import annotations


import pytest
import torch
import yaml

from conftest import REPO
from voxdiff.diffusion import bf16_check
from voxdiff.params import load, validate


def _network_and_shapes(params):
    """The shapes the check collects, and every Conv3d call of a real forward pass (counted apart)."""
    from voxdiff.diffusion.model import build_network

    calls = []
    with torch.device("meta"):
        net = build_network(params.model, len(params.data.label_values))
    for m in net.modules():
        if isinstance(m, torch.nn.Conv3d):
            m.register_forward_pre_hook(lambda conv, args: calls.append((conv, tuple(args[0].shape[2:]))))
    with torch.no_grad():
        net(torch.empty(1, 1 + len(params.data.label_values), *params.preprocess.shape, device="meta"),
            timesteps=torch.zeros(1, dtype=torch.long, device="meta"))
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv3d)]
    return convs, calls, bf16_check.conv_shapes(params.model, len(params.data.label_values), params.preprocess.shape)


def width_one_params():
    """The demo network with a fourth level on a 32x32x8 grid: the width halves 8 -> 4 -> 2 -> 1, so the last
    downsampling is a stride-2 convolution to an output width of 1 (the case of the AMX fault)."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["preprocess"]["shape"] = [32, 32, 8]
    raw["model"].update(channels=[16, 32, 32, 64], attention_levels=[False, False, False, True])
    raw["train"]["device"] = "cpu"
    return raw


@pytest.mark.parametrize("name", ["params.yaml", "params-gpu.yaml"])
def test_bf16_conv3d_matches_fp32_at_every_layer_shape(name):
    """The demo grid (32^3) and the GPU preset (128^3, five levels): every Conv3d of the network is called
    in the forward pass, each call's shape is among those checked, and each matches fp32 within bf16's
    rounding here."""
    params = load(REPO / name)
    convs, calls, shapes = _network_and_shapes(params)
    assert {id(c) for c, _ in calls} == {id(c) for c in convs}  # the forward pass meets every Conv3d
    for conv, grid in calls:
        assert bf16_check.ConvShape(conv.in_channels, conv.out_channels, grid, conv.kernel_size, conv.stride,
                                    conv.padding) in shapes
    results = bf16_check.check_network(params.model, len(params.data.label_values), params.preprocess.shape)
    assert {r.shape for r in results} == {bf16_check.capped(s) for s in shapes}
    bad = [f"{r.shape.describe()}: {r.error:.3g}" for r in results if not r.ok]
    assert not bad, bad
    assert all(0 < r.error for r in results)  # bf16 rounding is there: the comparison sees the bf16 kernel


def amx_fault_here() -> bool:
    """Whether this CPU's bf16 conv3d has PyTorch issue 169688's fault, read directly (not through bf16_check): a
    stride-2 convolution to an output width of 1 against fp32. A CPU with the fault is off by about the output's
    own size or gives NaN (seen, from one call to the next, on an Intel Xeon with AMX); bf16's rounding is ~0.3 %."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 32, 8, 8, 2, generator=gen), 0.05 * torch.randn(32, 32, 3, 3, 3, generator=gen)
    ref = F.conv3d(x, w, stride=2, padding=1)
    out = F.conv3d(x.bfloat16(), w.bfloat16(), stride=2, padding=1).float()
    return not bool((out - ref).abs().max() <= 0.1 * ref.abs().max())  # the faulty kernel also writes NaN (seen)


def test_the_cap_keeps_the_width_one_strided_case():
    """A grid whose width halves down to 1: the stride-2 convolution to an output width of 1, the case of
    the AMX fault, is checked at its own width, and found wrong exactly where this CPU has the fault."""
    params = validate(width_one_params())
    results = bf16_check.check_network(params.model, len(params.data.label_values), params.preprocess.shape)
    faulty = [r for r in results if r.shape.out_grid[2] == 1 and r.shape.stride[2] > 1]
    assert faulty, [r.shape.describe() for r in results]
    assert all(r.ok != amx_fault_here() for r in faulty), [(r.shape.describe(), r.error) for r in faulty]
    assert all(r.ok for r in results if r not in faulty)  # the other shapes match on either kind of CPU
    assert all(max(r.shape.grid[:2]) <= bf16_check.CAP_DH for r in results)  # cheap: depth, height capped


def test_a_wrong_bf16_kernel_is_reported(monkeypatch):
    """Negative control: a bf16 convolution that is wrong where AMX's is (output width 1, width stride > 1)
    fails the check, and the summary names the layer and the fix."""
    real = bf16_check.F.conv3d

    def amx_like(x, w, b=None, stride=(1, 1, 1), padding=0, *rest):  # F.conv3d is torch's: every caller
        out = real(x, w, b, stride, padding, *rest)
        if x.dtype == torch.bfloat16 and out.shape[-1] == 1 and stride[2] > 1:
            return out.flip(1)  # the right numbers in the wrong places: as large as the output itself
        return out

    monkeypatch.setattr(bf16_check.F, "conv3d", amx_like)
    params = validate(width_one_params())
    results = bf16_check.check_network(params.model, len(params.data.label_values), params.preprocess.shape)
    bad = [r for r in results if not r.ok]
    assert bad and all(r.shape.out_grid[2] == 1 and r.shape.stride[2] == 2 for r in bad)
    line = bf16_check.summary(results, params.preprocess.shape)
    assert line.startswith("WRONG on this CPU") and "stride 2x2x2" in line and "train.precision: fp32" in line


def test_doctor_checks_bf16_convolutions_on_the_users_grid(tmp_path):
    # `voxdiff doctor` in this process (test_params_cli runs it as a subprocess; a second interpreter costs ~6 s)
    from click.testing import CliRunner

    from voxdiff.cli import main

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(width_one_params()))
    out = CliRunner().invoke(main, ["doctor", "--root", str(tmp_path)])
    assert out.exit_code == 0, out.output
    line = next(line for line in out.output.splitlines() if line.startswith("bf16 conv3d"))
    if amx_fault_here():  # the user is told, with the layer and the way round it
        assert "WRONG on this CPU" in line and "4x4x1" in line and "train.precision: fp32" in line, line
    else:
        assert line.split(None, 2)[2].startswith("ok: ") and "of the network at 32x32x8 match fp32" in line, line
