"""Does bf16 conv3d give the fp32 result on this CPU, at every convolution shape of the network?

PyTorch issue 169688: on CPUs with AMX, oneDNN's bf16 BRGEMM convolution returns wrong numbers (errors
larger than the output) when a conv3d's innermost output width is 1 and its width stride is above 1; fp32
and fp16 take other kernels and are right. bf16 autocast on the CPU (train.precision: bf16, or auto on a
CPU with native bf16) sends every convolution of the network through that kernel, so a grid whose width
halves down to 1 (e.g. 128x128x16 with five levels) would train on wrong numbers without any error.

The check runs each convolution layer of a real network (built by model.build_network, its shapes taken
by forward pre-hooks from a forward pass on the meta device: nothing is allocated) alone, at batch 1, on
random input, in bf16 (as CPU autocast casts it) and in fp32, and compares. To stay cheap at 128^3 (a
second or two a preset on 2 cores, against ~20 s at 16^3 per layer), depth and height above CAP_DH voxels
are cut to CAP_DH and the width above CAP_W to CAP_W, each keeping its remainder by the stride. The
channels, kernels and strides are the layer's own, and so is every width up to CAP_W: an output width of
1 needs an input width of a few voxels, so those layers run at their own width.

Tolerance: bf16 rounds the input and the weight each to 8 significant bits (relative error <= 2^-9), so
each product is off by <= ~2^-8 of its size, and the fp32-accumulated sum rounded to bf16 by another 2^-9
of the output: |bf16 - fp32| <= 1.5 * 2^-8 * (|x| conv |w| + |b|). TOLERANCE = 2^-6 gives that bound a
margin of 2.7x; the reported fault is wrong by more than the output itself.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

CAP_DH = 8   # depth and height
CAP_W = 16   # width, the innermost dimension (the one the fault is in)
TOLERANCE = 2.0 ** -6  # of |x| conv |w| + |b|, elementwise


@dataclasses.dataclass(frozen=True)
class ConvShape:
    """One convolution layer as it runs at batch 1: its input's channels and grid, and its settings."""
    in_channels: int
    out_channels: int
    grid: tuple[int, int, int]      # input D, H, W
    kernel: tuple[int, int, int]
    stride: tuple[int, int, int]
    padding: tuple[int, int, int]

    @property
    def out_grid(self) -> tuple[int, ...]:
        return tuple((n + 2 * p - k) // s + 1 for n, k, s, p in zip(self.grid, self.kernel, self.stride, self.padding))

    def describe(self) -> str:
        return (f"conv {self.in_channels}->{self.out_channels} kernel {'x'.join(map(str, self.kernel))} stride "
                f"{'x'.join(map(str, self.stride))} on {'x'.join(map(str, self.grid))} -> "
                f"{'x'.join(map(str, self.out_grid))}")


def conv_shapes(model, num_classes: int, grid) -> list[ConvShape]:
    """Every distinct conv3d shape of params' network (model: the params.yaml `model` section) on `grid`,
    in the order the forward pass meets them: forward pre-hooks on every Conv3d of a network built by
    model.build_network, run once on the meta device."""
    from voxdiff.diffusion.model import build_network

    found: list[ConvShape] = []

    def hook(conv, args):
        if conv.groups != 1 or tuple(conv.dilation) != (1, 1, 1) or isinstance(conv.padding, str):
            raise ValueError(f"unexpected convolution in the network: {conv}")  # none in MONAI's UNet
        shape = ConvShape(conv.in_channels, conv.out_channels, tuple(args[0].shape[2:]), tuple(conv.kernel_size),
                          tuple(conv.stride), tuple(conv.padding))
        if shape not in found:
            found.append(shape)

    with torch.device("meta"):
        net = build_network(dataclasses.replace(model, activation_checkpointing=False), num_classes)
    convs = [m for m in net.modules() if isinstance(m, torch.nn.Conv3d)]
    handles = [m.register_forward_pre_hook(hook) for m in convs]
    try:
        with torch.no_grad():
            net(torch.empty(1, 1 + num_classes, *grid, device="meta"),
                timesteps=torch.zeros(1, dtype=torch.long, device="meta"))
    finally:
        for h in handles:
            h.remove()
    return found


def capped(shape: ConvShape, cap_dh: int = CAP_DH, cap_w: int = CAP_W) -> ConvShape:
    """The shape with each grid size above its cap cut to the cap plus its remainder by the stride (the
    output's parity stays); sizes up to the cap (every output of width 1) are kept."""
    grid = tuple(n if n <= cap else cap + n % s for n, s, cap in zip(shape.grid, shape.stride, (cap_dh, cap_dh, cap_w)))
    return dataclasses.replace(shape, grid=grid)


@dataclasses.dataclass(frozen=True)
class ConvResult:
    shape: ConvShape        # as run (capped)
    error: float            # max |bf16 - fp32| / (|x| conv |w| + |b|), over the output
    ok: bool


def check_shape(shape: ConvShape, seed: int = 0) -> ConvResult:
    """One layer alone at batch 1: F.conv3d of random bf16-rounded input and weights, in bf16 (what CPU
    autocast runs) against fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, shape.in_channels, *shape.grid, generator=g)
    fan_in = shape.in_channels * shape.kernel[0] * shape.kernel[1] * shape.kernel[2]
    w = torch.randn(shape.out_channels, shape.in_channels, *shape.kernel, generator=g) / fan_in ** 0.5
    b = 0.1 * torch.randn(shape.out_channels, generator=g)
    args = dict(stride=shape.stride, padding=shape.padding)
    with torch.no_grad():
        low = F.conv3d(x.bfloat16(), w.bfloat16(), b.bfloat16(), **args).float()
        x, w, b = x.bfloat16().float(), w.bfloat16().float(), b.bfloat16().float()  # the same inputs in fp32
        exact = F.conv3d(x, w, b, **args)
        bound = F.conv3d(x.abs(), w.abs(), b.abs(), **args)
    error = float(((low - exact).abs() / (bound + 1e-30)).max()) if exact.numel() else 0.0
    return ConvResult(shape, error, error <= TOLERANCE)


def check_network(model, num_classes: int, grid) -> list[ConvResult]:
    """check_shape on every distinct (capped) conv3d shape of the network on `grid`."""
    shapes = []
    for s in conv_shapes(model, num_classes, grid):
        c = capped(s)
        if c not in shapes:
            shapes.append(c)
    return [check_shape(s, seed=i) for i, s in enumerate(shapes)]


def summary(results: list[ConvResult], grid) -> str:
    """One line: all layers right (with the worst error against the tolerance), or the first wrong one."""
    where = "x".join(map(str, grid))
    bad = [r for r in results if not r.ok]
    if bad:
        r = max(bad, key=lambda r: r.error)
        return (f"WRONG on this CPU: {len(bad)} of {len(results)} conv3d shapes of the network at {where} differ "
                f"from fp32 beyond bf16's rounding (worst {r.error:.3g} of the bound, tolerance {TOLERANCE:.3g}: "
                f"{r.shape.describe()}); train and sample with train.precision: fp32 (PyTorch issue 169688)")
    worst = max((r.error for r in results), default=0.0)
    return (f"ok: {len(results)} conv3d shapes of the network at {where} match fp32 within bf16's rounding "
            f"(worst {worst:.2g} of the bound, tolerance {TOLERANCE:.3g})")
