"""3D convolutions at batch 1 on the CPU, routed to oneDNN.

PyTorch picks a convolution backend by a heuristic written for 2D images (aten ConvParams::use_mkldnn):
an fp32 CPU convolution with a 3x3x3 kernel goes to oneDNN only when the batch is > 1 or
N*C*D*H > 20480. At batch 1 nearly every 3D convolution of the demo network (16 channels at 32^3 is
16384) falls to `slow_conv3d` (im2col + GEMM), forward and backward: a micro-batch-1 training step took
1.25 s per sample on 2 AVX2 cores against 0.46 s at micro-batch 2 (benchmarks: `conv_batch1`). PyTorch
has no switch for this, so `BatchOneConv3d` calls oneDNN's convolution directly at batch 1 and writes
the two gradients as oneDNN convolutions too (the standard identities below), about 10x faster per layer.
Micro-batch 1 is med-ddpm's setting and the study's, and sampling runs at batch 1: all of them gain.

Every other case (CUDA, batch > 1, bf16/fp16 or autocast, groups or dilation, torch.compile) takes
nn.Conv3d's own path unchanged. Tests: tests/test_cpu_conv.py (values and gradients against
F.conv3d, strides 1 and 2, kernels 1 and 3).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_ONES = (1, 1, 1)


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias, padding, stride=_ONES, dilation=_ONES) -> torch.Tensor:
    return torch.ops.aten.mkldnn_convolution(x, weight, bias, list(padding), list(stride), list(dilation), 1)


def _grad_input(grad: torch.Tensor, weight: torch.Tensor, shape, stride, padding) -> torch.Tensor:
    """The transposed convolution of `grad`: zeros inserted between its voxels at the stride, padded so
    that a stride-1 convolution with the flipped, transposed kernel returns the input's shape."""
    k = weight.shape[2:]
    if any(s > 1 for s in stride):
        n, c, *out = grad.shape
        spread = grad.new_zeros(n, c, *[(o - 1) * s + 1 for o, s in zip(out, stride)])
        spread[:, :, ::stride[0], ::stride[1], ::stride[2]] = grad
        grad = spread
    pads = []
    for size, spread, kk, p in zip(reversed(shape[2:]), reversed(grad.shape[2:]), reversed(k), reversed(padding)):
        left = kk - 1 - p
        pads += [left, size - (spread + 2 * left - kk + 1) + left]  # F.pad: last dim first; negative crops
    grad = F.pad(grad, pads)
    return _onednn(grad, weight.flip(2, 3, 4).transpose(0, 1).contiguous(), None, (0, 0, 0))


def _grad_weight(x: torch.Tensor, grad: torch.Tensor, kernel, stride, padding) -> torch.Tensor:
    """dL/dW[o, i] = sum over voxels of x[i] (shifted) * grad[o]: a convolution of the input's channels,
    as a batch, with the gradient's channels as kernels, dilated by the stride (batch 1 only)."""
    out = _onednn(x.transpose(0, 1), grad.transpose(0, 1), None, padding, dilation=stride)
    return out[:, :, :kernel[0], :kernel[1], :kernel[2]].transpose(0, 1).contiguous()


class _Conv3dBatchOne(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, stride, padding):
        ctx.save_for_backward(x, weight)
        ctx.stride, ctx.padding, ctx.has_bias = stride, padding, bias is not None
        return _onednn(x, weight, bias, padding, stride)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = _grad_input(grad, weight, x.shape, ctx.stride, ctx.padding)
        if ctx.needs_input_grad[1]:
            gw = _grad_weight(x, grad, weight.shape[2:], ctx.stride, ctx.padding)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = grad.sum((0, 2, 3, 4))
        return gx, gw, gb, None, None


def takes_onednn_path(conv: torch.nn.Conv3d, x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True where PyTorch's heuristic would send this convolution to slow_conv3d and oneDNN can take it.
    Only there: where PyTorch already picks oneDNN its own backward is the faster one at 64^3 (the weight
    gradient below is a convolution with a kernel the size of the volume)."""
    slow_in_torch = (x.dim() == 5 and x.shape[0] == 1 and x.shape[1] * x.shape[2] * x.shape[3] <= 20480
                     and not (weight.shape[-1] > 3 and weight.shape[-2] > 3))
    return (slow_in_torch and x.device.type == "cpu"
            and x.dtype == weight.dtype == torch.float32
            and conv.groups == 1 and conv.dilation == _ONES and conv.padding_mode == "zeros"
            and not isinstance(conv.padding, str)
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
            and torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled)


class BatchOneConv3d(torch.nn.Conv3d):
    """nn.Conv3d (same parameters and state dict) that runs batch 1 on the CPU through oneDNN."""

    def _conv_forward(self, input, weight, bias):
        if takes_onednn_path(self, input, weight):
            return _Conv3dBatchOne.apply(input.contiguous(), weight.contiguous(), bias,
                                         tuple(self.stride), tuple(self.padding))
        return super()._conv_forward(input, weight, bias)


def route_batch_one_convolutions(net: torch.nn.Module) -> int:
    """Make every plain nn.Conv3d of `net` a BatchOneConv3d (in place: the class only; weights, hooks and
    the state dict are untouched). Returns how many were changed."""
    changed = 0
    for module in net.modules():
        if type(module) is torch.nn.Conv3d:
            module.__class__ = BatchOneConv3d
            changed += 1
    return changed


def plain_convolutions(net: torch.nn.Module) -> int:
    """The inverse of route_batch_one_convolutions: every BatchOneConv3d of `net` back to torch.nn.Conv3d
    (in place, the class only), so that a pickle of `net` names no voxdiff class. Returns how many."""
    changed = 0
    for module in net.modules():
        if type(module) is BatchOneConv3d:
            module.__class__ = torch.nn.Conv3d
            changed += 1
    return changed
