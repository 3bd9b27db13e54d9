"""Network and noise scheduler, built from params (MONAI's network / scheduler / inferer split)."""

from __future__ import annotations

import copy

import torch
from monai.inferers import DiffusionInferer
from monai.networks.nets import DiffusionModelUNet
from monai.networks.schedulers import DDPMScheduler

from voxdiff.diffusion.cpu_conv import plain_convolutions, route_batch_one_convolutions
from voxdiff.params import Diffusion, Model


def build_network(model: Model, num_classes: int, flash_attention: bool = False) -> DiffusionModelUNet:
    """3D UNet whose input is the noisy image concatenated with the one-hot label map (med-ddpm style).

    flash_attention: MONAI's switch to torch's fused scaled_dot_product_attention; the callers turn it on
    for CUDA devices (same weights and results, less memory for the attention at 16^3 in the GPU preset).
    """
    net = DiffusionModelUNet(
        spatial_dims=3,
        in_channels=1 + num_classes,
        out_channels=1,
        channels=model.channels,
        attention_levels=model.attention_levels,
        num_res_blocks=model.num_res_blocks,
        norm_num_groups=model.norm_num_groups,
        num_head_channels=model.num_head_channels,
        use_flash_attention=flash_attention,
    )
    route_batch_one_convolutions(net)  # batch 1 on the CPU: oneDNN instead of slow_conv3d (cpu_conv.py)
    if model.activation_checkpointing:
        enable_activation_checkpointing(net)
    return net


def enable_activation_checkpointing(net: torch.nn.Module) -> None:
    """Recompute each down/up block's activations during backward (memory for time).

    MONAI's DiffusionModelUNet has no switch for this, so wrap the blocks' forward in
    torch.utils.checkpoint (non-reentrant: works with no_sync/DDP and autocast).
    """
    from torch.utils.checkpoint import checkpoint

    blocks = list(net.down_blocks) + [net.middle_block] + list(net.up_blocks)
    for block in blocks:
        plain = block.forward

        def forward(*args, _plain=plain, **kwargs):
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

        block.forward = forward


def portable_network(net: torch.nn.Module) -> torch.nn.Module:
    """A CPU copy of `net` made of MONAI and torch classes only (MLflow's pickled model): the convolutions
    back to torch.nn.Conv3d (cpu_conv.plain_convolutions) and no activation checkpointing (an inference
    needs none), so it loads where voxdiff is not installed. `net` itself is left as it is."""
    plain = copy.deepcopy(net).to("cpu")
    plain_convolutions(plain)
    for module in plain.modules():
        module.__dict__.pop("forward", None)  # enable_activation_checkpointing's wrapper: the class's forward
    return plain


def build_scheduler(diffusion: Diffusion) -> DDPMScheduler:
    return DDPMScheduler(
        num_train_timesteps=diffusion.timesteps,
        schedule=diffusion.schedule,
        prediction_type=diffusion.prediction,
        clip_sample=True,
    )


def build_inferer(scheduler) -> DiffusionInferer:
    return DiffusionInferer(scheduler)


def one_hot(labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """[B, D, H, W] class indices -> [B, C, D, H, W] float one-hot, the network's condition."""
    return torch.nn.functional.one_hot(labels.long(), num_classes).permute(0, 4, 1, 2, 3).float()
