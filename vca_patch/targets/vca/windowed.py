"""VCA in place of shifted-window attention (Swin): global VCA over the block's full grid, alone or beside W-MSA.

The layer sits where the window attention was and is called as it was, on the windows of the shifted, padded grid
(and the shift mask). It rebuilds the block's H×W grid from them (`WindowCall`, per call), runs VCA over all H·W
tokens and partitions the result back into the block's windows:

    "global":   y = VCA(x)                                   the paper's placement; the relative-position bias,
                                                             the window locality and the shift mask are dropped
    "residual": y = W-MSA(x; bias, mask) + g ⊙ VCA(x),  g = 0  the original window attention kept (its bias table
                                                             and mask): exact at init, a global path to train

Both share the carried `qkv` and `proj`. The gate g is per output channel.

SwinV2 (`carry_cosine`): the window attention is cosine attention, softmax(L·q̂·k̂ᵀ + 16σ(CPB) + mask), with a
per-head scale L = exp(min(logit_scale, ln 100)) and a continuous position bias computed by an MLP from
log-spaced relative coordinates. The VCA branch keeps the cosine form: q and k are L2-normalised per head, the
pooled queries are renormalised and scaled by L (so Stage-I logits are L·cos, Stage-II logits L·τ·cos), and the
SDPA scale is 1. The CPB is a window term: "global" drops it, "residual" keeps it in the window branch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.window_call import WindowCall
from vca_patch.layers.window_terms import CarriedWindowTerms
from vca_patch.targets.vca.layer import InitMode, VisualContrastAttention

WindowMode = Literal["residual", "global"]


class UnitNorm(nn.Module):
    """x / ‖x‖ over the last dimension (SwinV2's cosine attention normalises q and k per head)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, dim=-1)


class WindowedVCA(CarriedWindowTerms, VisualContrastAttention):
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
        """Take the original relative-position bias table and its index ("residual" mode only)."""
        self._require_residual()
        super().carry_window_bias(table, index)

    def carry_window_bias_module(self, name: str, module: nn.Module) -> None:
        """Take the module holding the bias table and its index whole, under `name` ("residual" mode only)."""
        self._require_residual()
        super().carry_window_bias_module(name, module)

    def _require_residual(self) -> None:
        if self.mode != "residual":
            raise ValueError("only the residual mode keeps the window attention's bias")

    def carry_cosine(
        self,
        logit_scale: nn.Parameter,
        position_mlp: nn.Module | None = None,
        coords_table: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
        names: tuple[str, str] = ("logit_scale", "cpb_mlp"),
    ) -> None:
        """Make this a SwinV2 (cosine attention) layer: the logit scale is kept in both modes, the CPB MLP (with its
        coordinate table and pair index) in "residual" mode only; q and k are normalised, the SDPA scale is 1."""
        if self.mode == "residual" and position_mlp is None:
            raise ValueError("the residual mode keeps the window attention: it needs the CPB MLP, table and index")
        residual = self.mode == "residual"
        self.carry_cosine_terms(logit_scale, position_mlp if residual else None, coords_table, index, names)
        self.q_norm, self.k_norm = UnitNorm(), UnitNorm()
        self.scale = 1.0  # the per-head scale L rides on the pooled queries

    def pooled_queries(self, x: torch.Tensor, q: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """As VCA's; a cosine layer pools the normalised queries, renormalises each head and scales it by L."""
        pooled = super().pooled_queries(x, q, layout)
        if not self.cosine:
            return pooled
        B, n, _ = pooled.shape
        heads = F.normalize(pooled.view(B, n, self.num_heads, self.head_dim), dim=-1)
        return (heads * self.logit_scale().to(heads.dtype).view(1, 1, -1, 1)).reshape(B, n, self.attn_dim)

    def _fused_kernel_usable(self, x: torch.Tensor) -> bool:
        return not self.cosine and super()._fused_kernel_usable(x)  # the kernel has no cosine form

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

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}" + (", cosine=True" if self.cosine else "")
