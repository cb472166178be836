"""timm PVTv2 (`pvt_v2_*`): spatial-reduction attention converted with its reduction kept (exact carry), or
dropped (`VCAConfig.pvt_mode="paper"`: global VCA over full-resolution keys, the paper's placement; approximate).

Each stage has its own grid, and PVT hands every attention call its `feat_size`, so the layer takes the layout
from the call. λ_init follows the global block index over all stages (0 … depth−1). The `*_li` models' attention
is already linear (keys pooled to 7×7) and is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.families.base import AttentionSite, SkippedSite
from vca_patch.families.timm.base import describe_timm_base
from vca_patch.families.timm.staged import TimmStagedAdapter
from vca_patch.families.verify import Probe, eval_mode, on_meta, record_verdict, relative_error
from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.q_kv_view import QAndKV
from vca_patch.layers.staged_carry import CarriedReductionAttention

_RECORDED_ARGS = ("num_classes", "global_pool")
LINEAR_ATTENTION_REASON = "linear attention already (keys pooled to 7x7): nothing for VCA to make linear"
# The site note of a replacement that dropped the spatial reduction (`note_dropped_reduction`).
PAPER_MODE_NOTE = (
    "pvt_mode='paper': spatial reduction (conv + LayerNorm) dropped, global VCA over the full-resolution keys "
    "(kv reads the block input, not the reduced grid it was trained on: fine-tune)"
)


def _is_pvt_v2(model: nn.Module) -> bool:
    return type(model).__module__ == "timm.models.pvt_v2" and hasattr(model, "stages")


def conv_output_size(size: tuple[int, int], conv: nn.Conv2d) -> tuple[int, int]:
    """The spatial output size of `conv` on a `size` input."""
    return tuple(
        (s + 2 * p - d * (k - 1) - 1) // st + 1
        for s, p, d, k, st in zip(size, conv.padding, conv.dilation, conv.kernel_size, conv.stride, strict=True)
    )


def _input_size(model: nn.Module) -> tuple[int, int]:
    size = (getattr(model, "pretrained_cfg", None) or {}).get("input_size") or (3, 224, 224)
    return int(size[-2]), int(size[-1])


def reference_reduction_attention(carried: CarriedReductionAttention, x: torch.Tensor, grid: tuple[int, int]):
    """Spatial-reduction softmax attention from `carried`'s weights, written out: [B, H·W, C] -> [B, H·W, C]."""
    B, N, C = x.shape
    M, d = carried.num_heads, carried.head_dim
    (w_q, b_q), (w_k, b_k), (w_v, b_v) = carried.qkv.projections()
    reduced = x
    if carried.sr is not None:
        reduced = carried.sr(x.transpose(1, 2).reshape(B, C, *grid)).flatten(2).transpose(1, 2)
        reduced = carried.reduction_norm(reduced)
    q = F.linear(x, w_q, b_q).view(B, N, M, d).transpose(1, 2)
    k, v = (F.linear(reduced, w, b).view(B, -1, M, d).transpose(1, 2) for w, b in ((w_k, b_k), (w_v, b_v)))
    weights = torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5, dim=-1)
    return carried.proj((weights @ v).transpose(1, 2).reshape(B, N, M * d))


def stage_grid_text(grid: tuple[int, int], sr: nn.Conv2d | None, *, cls_token: bool = False) -> str:
    """The report's grid of a spatial-reduction site: "HxW" (" + CLS"), then the keys' grid after `sr`, if any."""
    text = f"{grid[0]}x{grid[1]}" + (" + CLS" if cls_token else "")
    if sr is not None:
        keys = conv_output_size(grid, sr)
        text += f", keys {keys[0]}x{keys[1]} (sr {sr.stride[0]})"
    return text


@torch.no_grad()
def reduction_attention_error(
    module: nn.Module,
    carried: CarriedReductionAttention,
    dim: int,
    ratio: int,
    call: Callable[[nn.Module, torch.Tensor, tuple[int, int]], torch.Tensor],
    prefix: int = 0,
) -> float:
    """Relative error of `call(module, tokens, grid)` against `reference_reduction_attention` on random
    [2, prefix + H·W, dim] tokens over a (2R, 3R) grid, R = max(ratio, 2): not square, so a transposed grid would
    show (a half-precision module checked in float32)."""
    ratio = max(ratio, 2)
    grid = (2 * ratio, 3 * ratio)
    probe = Probe.of(module, carried)
    x = probe.randn(2, prefix + grid[0] * grid[1], dim)
    with eval_mode(probe.module):
        expected = call(probe.module, x, grid)
    return relative_error(reference_reduction_attention(probe.carried, x, grid), expected)


def note_dropped_reduction(replacement: nn.Module, site: AttentionSite) -> None:
    """Say in the site's notes (so the report calls it approximate, and strict refuses it) when the replacement
    dropped the module's spatial reduction (`pvt_mode="paper"`)."""
    dropped = getattr(replacement, "hierarchical_settings", {}).get("mode") == "reduction-dropped"
    if dropped and PAPER_MODE_NOTE not in site.notes:
        site.notes.append(PAPER_MODE_NOTE)


class TimmPVTAdapter(TimmStagedAdapter):
    """Converts timm PVTv2 spatial-reduction attention to `SpatialReductionVCA` (q, kv, sr, norm, proj carried)."""

    name = "timm-pvt"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return _is_pvt_v2(model)

    def stage_grids(self, model: nn.Module) -> list[tuple[int, int]]:
        """Each stage's grid at the model's native input size (conv arithmetic of the patch embeddings)."""
        grid = conv_output_size(_input_size(model), model.patch_embed.proj)
        grids = []
        for stage in model.stages:
            if stage.downsample is not None:
                grid = conv_output_size(grid, stage.downsample.proj)
            grids.append(grid)
        return grids

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        sites: list[AttentionSite] = []
        skipped: list[SkippedSite] = []
        index = 0
        for i, (stage, grid) in enumerate(zip(model.stages, self.stage_grids(model), strict=True)):
            for j, block in enumerate(stage.blocks):
                path, attn = f"stages.{i}.blocks.{j}.attn", block.attn
                if getattr(attn, "pool", None) is not None:
                    skipped.append(SkippedSite(path, type(attn).__name__, LINEAR_ATTENTION_REASON))
                else:
                    settings = {"stage": i, "grid": stage_grid_text(grid, attn.sr)}
                    sites.append(self.staged_site(path, attn, index, attn.dim, attn.num_heads, i, settings, grid))
                index += 1
        return sites, skipped

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        return TokenLayout(0, self.stage_grids(model)[0])

    def carry(self, site: AttentionSite) -> CarriedReductionAttention:
        attn = site.module
        stage, settings, grid = self._stages[site.path]
        return CarriedReductionAttention(
            qkv=QAndKV(attn), proj=attn.proj, num_heads=attn.num_heads, head_dim=attn.head_dim,
            proj_drop=attn.proj_drop, stage=stage, settings=settings, grid=grid, sr=attn.sr, reduction_norm=attn.norm,
        )  # fmt: skip

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        """PVT calls `attn(x, feat_size)`, which `SpatialReductionVCA` takes as it is."""
        note_dropped_reduction(replacement, site)

    @torch.no_grad()
    def verify(self, site: AttentionSite) -> AttentionSite:
        """The module must equal spatial-reduction softmax attention built from its q, kv, sr, norm and proj."""
        module = site.module
        if on_meta(module):
            return site
        carried = self.carry(site)
        ratio = carried.sr.stride[0] if carried.sr is not None else 1
        error = reduction_attention_error(module, carried, site.dim, ratio, lambda m, x, grid: m(x, grid))
        return record_verdict(site, error, "spatial-reduction attention")

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        args = {key: getattr(model, key) for key in _RECORDED_ARGS if hasattr(model, key)}
        args["in_chans"] = model.patch_embed.proj.in_channels
        return describe_timm_base(model, args)
