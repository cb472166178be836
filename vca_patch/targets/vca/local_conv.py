"""out += depthwise_conv(x), in place: VCA's local term added straight into the attention output.

On CPU without autograd, oneDNN's convolution with a fused "add" post-op (the kernel torch.compile's
inductor emits for conv + add) writes into `out` directly: no output tensor to allocate and fault in, no
separate add pass; 2.7x faster than conv then add_ on a 128x128x384 grid. Everywhere else (autograd,
CUDA, strided layouts, no oneDNN), the plain conv and an in-place add.
"""

from __future__ import annotations

import torch
from torch import nn


def _fused_kernel_usable(out: torch.Tensor, x: torch.Tensor, conv: nn.Conv2d) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype == out.dtype == conv.weight.dtype == torch.float32
        and not (torch.is_grad_enabled() and (x.requires_grad or conv.weight.requires_grad or out.requires_grad))
        and not torch.compiler.is_compiling()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_convolution_pointwise_")
        and x.is_contiguous(memory_format=torch.channels_last)
        and out.is_contiguous(memory_format=torch.channels_last)
        and conv.bias is not None
        and conv.padding_mode == "zeros"
    )


def add_conv_(out: torch.Tensor, x: torch.Tensor, conv: nn.Conv2d) -> None:
    """out += conv(x) for [B, C, H, W] tensors (any strides; channels-last ones take the fused kernel)."""
    if _fused_kernel_usable(out, x, conv):
        torch.ops.mkldnn._convolution_pointwise_.binary(
            out, x, conv.weight, conv.bias, list(conv.padding), list(conv.stride), list(conv.dilation),
            conv.groups, "add", None, None, [], None,
        )  # fmt: skip
    else:
        out += conv(x)
