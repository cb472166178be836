"""Multipole Attention (MANO) in a shifted-window block (Swin, SwinV2): level 0 is the block's own window attention.

The layer sits where the window attention was and is called as it was, on the windows of the shifted, padded grid
and the shift mask. Level 0 is the carried W-MSA on exactly those windows (its bias table or SwinV2's cosine
scores and CPB, and the mask included); the coarse levels run on the block's H×W grid (rebuilt from the windows,
`WindowCall`), coarsened by `rate` with the block's window at every level, and their V-cycle correction is
partitioned back into the block's windows:

    y = W-MSA(x; bias, mask) + w₀·U(Z¹),   U = 0 (γ = 0) at the "preserve" init: exact at init

The coarse levels have no relative-position bias (the table is the level-0 window's) and no shift. SwinV2's coarse
levels keep the cosine form (q̂·L, k̂). `MANOConfig.window` does not apply: every level uses the block's window.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.cosine_window_carry import CarriedCosineWindowAttention
from vca_patch.layers.staged_carry import CarriedWindowAttention
from vca_patch.layers.window_call import WindowCall
from vca_patch.layers.window_terms import CarriedWindowTerms
from vca_patch.targets.mano.layer import MultipoleAttention
from vca_patch.targets.mano.levels import plan_levels


class WindowedMultipole(CarriedWindowTerms, MultipoleAttention):
    """MANO over a windowed block: level 0 the carried window attention; see the module docstring.

    `window_source` (set by the adapter) returns the current call's `WindowCall`.
    """

    mode = "multipole"

    def __init__(self, dim: int, num_heads: int, **kwargs: Any) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self.window_source: Callable[[], WindowCall | None] | None = None

    def use_cosine_levels(self) -> None:
        """Coarse levels as SwinV2 attends: q̂·L against k̂, SDPA scale 1 (after `carry_cosine_terms`)."""
        self.scale = 1.0

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super()._qkv(x)
        if self.cosine:
            q = F.normalize(q, dim=-1) * self.logit_scale().to(q.dtype).view(1, -1, 1, 1)
            k = F.normalize(k, dim=-1)
        return q, k, v

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x: [B·nW, kh·kw, C] windows (as the block partitioned them), mask: the shift mask or None ->
        [B·nW, kh·kw, C_out]."""
        call = self.window_source() if self.window_source is not None else None
        if call is None:
            raise RuntimeError(
                f"{type(self).__name__} needs its block's grid: it is called inside the patched model's block "
                "(whose hook records the grid, window and shift of the call)"
            )
        y = self.window_attention(x, mask)  # level 0: the block's own W-MSA
        levels = plan_levels(call.grid, min(call.window), self.rate, self.levels, self.pad)
        if len(levels) == 1:
            return y
        grid = call.windows_to_grid(x)  # [B, H, W, C]
        correction = self.coarse_correction(grid.permute(0, 3, 1, 2), levels)  # [B, C', H, W]
        return y + self.proj_drop(call.grid_to_windows(correction.permute(0, 2, 3, 1)))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", level 0 = the block's window attention" + (", cosine" if self.cosine else "")


def build_window_mano(carried: CarriedWindowAttention, **kwargs: Any) -> WindowedMultipole:
    """The MANO replacement of one Swin/SwinV2 window attention (`kwargs`: rate, levels, down, up, prefix, pad)."""
    settings = dict(carried.settings)
    window = settings.pop("window", None) or [7, 7]
    layer = CarriedAttention.instantiate(carried, WindowedMultipole, window=int(min(window)), **kwargs)
    if isinstance(carried, CarriedCosineWindowAttention):
        layer.carry_cosine_terms(
            carried.logit_scale, carried.position_mlp, carried.coords_table, carried.position_index,
            names=carried.cosine_names,
        )  # fmt: skip
        layer.use_cosine_levels()
    elif carried.bias_module is not None:
        layer.carry_window_bias_module(carried.bias_module_name, carried.bias_module)
    else:
        layer.carry_window_bias(carried.bias_table, carried.bias_index)
    grid = settings.get("grid")
    if grid is not None:
        levels = plan_levels(tuple(grid), layer.window, layer.rate, layer.levels, layer.pad)
        grids = [f"{level.grid[0]}x{level.grid[1]}" for level in levels]
        settings["grid"] = f"window {window[0]}x{window[1]} + multipole {'/'.join(grids)}"
    layer.hierarchical_settings = {**settings, "mode": "multipole"}
    return layer
