"""VCA in place of shifted-window attention (Swin): global VCA over the block's full grid, alone or beside W-MSA.

The layer sits where the window attention was and is called as it was, on the windows of the shifted, padded grid
(and the shift mask). It rebuilds the block's H×W grid from them (`WindowCall`, per call), runs VCA over all H·W
tokens and partitions the result back into the block's windows:

    "global":   y = VCA(x)                                   the paper's placement; the relative-position bias,
                                                             the window locality and the shift mask are dropped
    "residual": y = W-MSA(x; bias, mask) + g ⊙ VCA(x),  g = 0  the original window attention kept (its bias table
                                                             and mask): exact at init, a global path to train

Both share the carried `qkv` and `proj`. The gate g is per output channel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .layout import TokenLayout
from .vca import InitMode, VisualContrastAttention
from .window_call import WindowCall

WindowMode = Literal["residual", "global"]


class WindowedVCA(VisualContrastAttention):
    """VCA over a windowed block's full grid; `mode` "global" or "residual" (see the module docstring).

    `window_source` (set by the adapter) returns the current call's `WindowCall`. In "residual" mode the
    original `relative_position_bias_table` is carried under its name (`carry_window_bias`) and the window
    attention is recomputed from the carried weights exactly as the original did.
    """

    def __init__(self, dim: int, num_heads: int, *, mode: WindowMode = "residual", **kwargs) -> None:
        if mode not in ("residual", "global"):
            raise ValueError(f"mode must be 'residual' or 'global', got {mode!r}")
        super().__init__(dim, num_heads, **kwargs)
        self.mode = mode
        self.window_source: Callable[[], WindowCall | None] | None = None
        self.residual_gate = (
            nn.Parameter(torch.zeros(self.proj.out_features, **self.factory_kwargs)) if mode == "residual" else None
        )

    @torch.no_grad()
    def reset_vca_parameters(self, mode: InitMode = "preserve") -> None:
        """As `VisualContrastAttention`'s; the residual gate always starts at 0 (the layer = W-MSA)."""
        super().reset_vca_parameters(mode)
        if getattr(self, "residual_gate", None) is not None:
            self.residual_gate.zero_()

    def carry_window_bias(self, table: nn.Parameter, index: torch.Tensor) -> None:
        """Take the original relative-position bias table (a parameter) and its index (a non-persistent buffer)."""
        if self.mode != "residual":
            raise ValueError("only the residual mode keeps the window attention's bias")
        self._carry("relative_position_bias_table", table)
        self.register_buffer("relative_position_index", index, persistent=False)

    def carry_window_bias_module(self, name: str, module: nn.Module) -> None:
        """Take the module that holds the bias table and its index (`relative_position_bias_table`,
        `relative_position_index`) whole, under its original name (transformers' `relative_position_bias`)."""
        if self.mode != "residual":
            raise ValueError("only the residual mode keeps the window attention's bias")
        self._carry(name, module)
        self._bias_module_name = name

    _bias_module_name: str | None = None

    def _bias_table_and_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bias_module_name is not None:
            owner = self._modules[self._bias_module_name]
            return owner.relative_position_bias_table, owner.relative_position_index
        return self._parameters["relative_position_bias_table"], self.relative_position_index

    def carried_members(self) -> dict:
        members = super().carried_members()
        if "relative_position_bias_table" in self._parameters:
            members["relative_position_bias_table"] = self._parameters["relative_position_bias_table"]
        if self._bias_module_name is not None:
            members[self._bias_module_name] = self._modules[self._bias_module_name]
        return members

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B·nW, kh·kw, C] windows (as the block partitioned them), mask: the shift mask [nW, kh·kw, kh·kw] or
        None -> [B·nW, kh·kw, C_out]."""
        call = self.window_source() if self.window_source is not None else None
        if call is None:
            raise RuntimeError(
                f"{type(self).__name__} needs its block's grid: it is called inside the patched model's block "
                "(whose hook records the grid, window and shift of the call)"
            )
        grid = call.windows_to_grid(x)  # [B, H, W, C]
        B, H, W, C = grid.shape
        y = super().forward(grid.reshape(B, H * W, C), layout=TokenLayout(0, (H, W)))  # [B, H·W, C_out]
        y = call.grid_to_windows(y.view(B, H, W, -1))
        if self.mode == "global":
            return y
        return torch.addcmul(self.window_attention(x, mask), y, self.residual_gate.to(y.dtype))

    def window_attention(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """The carried W-MSA: softmax(s·q·kᵀ + bias + mask)·v per window, then proj (as timm's WindowAttention)."""
        B_, N, _ = x.shape
        M = self.num_heads
        q, k, v = self.qkv(x).view(B_, N, 3, M, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        table, index = self._bias_table_and_index()
        bias = table[index.view(-1)].view(N, N, M).permute(2, 0, 1).unsqueeze(0)  # [1,M,N,N]
        if mask is not None:
            nW = mask.shape[0]
            bias = (bias + mask.to(bias.dtype).unsqueeze(1)).unsqueeze(0).expand(B_ // nW, -1, -1, -1, -1)
            bias = bias.reshape(B_, M, N, N)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=self.scale)
        return self.proj_drop(self.proj(o.transpose(1, 2).reshape(B_, N, self.attn_dim)))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"
