"""VCA over spatially reduced keys (PVT's spatial-reduction attention converted with its reduction kept).

    q      = q(x)                                  full-resolution queries                 [B, N, C]
    x_r    = norm(sr(x on the H×W grid))           the carried reduction (conv k = s = R, LN)  [B, N/R², C]
    k, v   = kv(x_r)                               reduced keys and values
    t±     = avgpool(q) + e±                       contrast tokens pooled from the full-resolution queries
    Stage I over the N/R² reduced keys, Stage II for all N queries (as `VisualContrastAttention`), and the
    local term DWC₃ₓ₃(bilinear_upsample(v → H×W)) (Agent-PVT's upsampling), zero at init.

The carried `q`, `kv`, `sr`, `norm` and `proj` see exactly the inputs they were trained on; only the softmax over
the reduced keys becomes the pooled-query factorisation. Without a reduction (R = 1) this is plain VCA.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vca_patch.layers.fused_qkv import carried_member
from vca_patch.layers.layout import TokenLayout, record_layout, resolve_layout
from vca_patch.targets.vca.layer import VisualContrastAttention


class SpatialReductionVCA(VisualContrastAttention):
    """VCA whose keys and values come from a carried spatial reduction (`sr` conv + `norm`), or plain VCA without.

    Built like `VisualContrastAttention` around a q/kv view (`QAndKV`, or q/k/v: `SplitQKV`); `carry_reduction`
    then registers the original `sr` and `norm` under their names (PVT's `norm` is the reduction's LayerNorm, so
    this layer applies no norm before `proj`). Called as PVT calls its attention: `layer(x, feat_size)`.
    """

    _reduction_names: tuple[str, str] = ("sr", "norm")

    @torch.no_grad()
    def carry_reduction(
        self, sr: nn.Module | None, norm: nn.Module | None, names: tuple[str, str] = ("sr", "norm")
    ) -> None:
        """Take the original reduction conv and LayerNorm (both None: no reduction), under their original
        `names` (timm: sr, norm; transformers: spatial_reduction, layer_norm)."""
        if (sr is None) != (norm is None):
            raise ValueError("a spatial reduction needs both its conv (sr) and its norm")
        if sr is not None:
            self._reduction_names = tuple(names)
            self._carry(names[0], sr)
            self._modules[names[1]] = norm  # "norm" replaces the Identity: PVT's name for the reduction norm

    @property
    def sr(self) -> nn.Module | None:
        return self._modules.get(self._reduction_names[0])

    @property
    def reduction_norm(self) -> nn.Module:
        return self._modules[self._reduction_names[1]]

    def carried_members(self) -> dict:
        members = super().carried_members()
        if self.sr is not None:
            members.update(zip(self._reduction_names, (self.sr, self.reduction_norm), strict=True))
        return members

    def forward(
        self,
        x: torch.Tensor,
        feat_size: Sequence[int] | None = None,
        *,
        layout: TokenLayout | None = None,
    ) -> torch.Tensor:
        """x: [B, P + H·W, C] on the grid `feat_size` = (H, W) (or `layout`) -> [B, P + H·W, C_out].

        Tokens beyond the grid's H·W are prefix tokens in front (PVT v1's last-stage CLS): they take part without
        a reduction only."""
        if feat_size is not None:
            grid = (int(feat_size[0]), int(feat_size[1]))
            prefix = x.shape[1] - grid[0] * grid[1]
            if prefix < 0:
                raise ValueError(f"{type(self).__name__}: {x.shape[1]} tokens do not fill the {grid[0]}x{grid[1]} grid")
            layout = TokenLayout(prefix, grid)
        if self.sr is None:
            return super().forward(x, layout=layout)
        layout = resolve_layout(type(self).__name__, x.shape[1], layout, self.layout_source)
        if layout.num_prefix_tokens:
            raise ValueError(f"{type(self).__name__} takes patch tokens only, got {layout.num_prefix_tokens} prefix")
        q, k, v, local_values = self.project_reduced(x, layout)
        trains = q.requires_grad or v.requires_grad or self.contrast_embed_pos.requires_grad
        if self.recompute_in_backward and torch.is_grad_enabled() and trains:
            out = checkpoint(self.attend, x, q, k, v, layout, local_values, use_reentrant=False)
        else:
            out = self.attend(x, q, k, v, layout, local_values)
        return record_layout(out, layout)

    def project_reduced(
        self, x: torch.Tensor, layout: TokenLayout
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, M, N, d]; k, v [B, M, N/R², d] from the reduced grid; v upsampled to the H×W grid [B, M, N, d]."""
        B, _, C = x.shape
        H, W = layout.grid
        names = self._qkv_layout[1]  # (q, kv) or (q, k, v)
        q = self._heads(carried_member(self, names[0])(x))
        reduced = self.sr(x.transpose(1, 2).reshape(B, C, H, W))  # [B, C, h, w]
        h, w = reduced.shape[-2:]
        reduced = self.reduction_norm(reduced.flatten(2).transpose(1, 2))  # [B, h·w, C]
        if len(names) == 2:
            kv = carried_member(self, names[1])(reduced).view(B, h * w, 2, self.num_heads, self.head_dim)
            k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # [B, M, h·w, d]
        else:
            k, v = (self._heads(carried_member(self, name)(reduced)) for name in names[1:])
        v_grid = v.transpose(1, 2).reshape(B, h, w, self.attn_dim).permute(0, 3, 1, 2)  # [B, C, h, w]
        upsampled = F.interpolate(v_grid, size=(H, W), mode="bilinear", align_corners=False)
        local_values = self._heads(upsampled.flatten(2).transpose(1, 2))  # [B, M, N, d]
        return q, k, v, local_values

    def _fused_kernel_usable(self, x: torch.Tensor) -> bool:
        return self.sr is None and super()._fused_kernel_usable(x)  # the kernel takes keys on the query grid

    def project_out(self, x: torch.Tensor, o: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """proj(o): PVT has no norm or gate before its output projection (`norm` is the reduction's)."""
        return self.proj_drop(self._project(o, into))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", reduction={'none' if self.sr is None else tuple(self.sr.stride)}"
