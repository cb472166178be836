"""Read an attention module's input to its output projection: what calibration fits against (recovery's driver
for the original attention, a target's closed-form fits for its own layer)."""

from __future__ import annotations

import torch
from torch import nn

from vca_patch.layers.layout import TokenLayout


def projection_input(
    module: nn.Module, x: torch.Tensor, layout: TokenLayout | None, proj: nn.Module | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input of the output projection `proj` (default module.proj), module output) for input x.

    `proj` is passed when `module` is an original attention module whose output projection has another name
    (transformers' o_proj/out_proj): it is the same Linear the replacement layer carries. `layout=` is passed
    to the module unless None. The output is the module's tensor (transformers modules return (output, weights)).
    """
    seen: list[torch.Tensor] = []
    handle = (proj or module.proj).register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        out = module(x) if layout is None else module(x, layout=layout)
    finally:
        handle.remove()
    return seen[0], out[0] if isinstance(out, tuple) else out
