"""Hugging Face transformers PVT v1 (`PvtModel`, `PvtForImageClassification`): spatial-reduction attention
converted as PVTv2's (`hf_pvt`), with the reduction kept (exact carry) or dropped (`pvt_mode="paper"`).

The attention is `encoder.block.{stage}.{block}.attention.self` (`PvtEfficientSelfAttention`: `query`, `key`,
`value`, `sequence_reduction` conv k = s = R, `layer_norm`), called `(hidden_states, height, width,
output_attentions)`; its output projection `attention.output.dense` stays outside it, so the replacement
(`SpatialReductionVCA`) carries no projection of its own (`OutsideProjection`) and the block applies `dense` to
its output as before: proj(o + DWC(v)) is unchanged by where proj sits. The last stage prepends a CLS token: a
prefix token there (transformers only runs that stage without a reduction). The grid comes from each call's
height and width; λ_init follows the global block index over all stages.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from vca_patch.families.base import AttentionSite, SkippedSite
from vca_patch.families.timm.pvt import conv_output_size, reduction_attention_error, stage_grid_text
from vca_patch.families.transformers.pvt import HFPvtAdapter, call_with_height_width
from vca_patch.families.verify import on_meta, record_verdict
from vca_patch.layers.fused_qkv import SplitQKV
from vca_patch.layers.staged_carry import CarriedReductionAttention

_V1_MODULE = "transformers.models.pvt.modeling_pvt"
_SITE = re.compile(r"(?:^|\.)encoder\.block\.(\d+)\.(\d+)\.attention\.self$")
_QKV_NAMES = ("query", "key", "value")
_REDUCTION_NAMES = ("sequence_reduction", "layer_norm")


class OutsideProjection(nn.Module):
    """The identity, standing for an output projection the original module's parent applies (PVT v1's
    `attention.output.dense`): Linear-shaped (`in_features`, `out_features`), no parameters, no state-dict key."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.in_features = self.out_features = features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def extra_repr(self) -> str:
        return f"features={self.in_features} (projected by the parent module)"


class HFPvtV1Adapter(HFPvtAdapter):
    """Converts transformers PVT v1 spatial-reduction attention to `SpatialReductionVCA`; see the module docstring."""

    name = "hf-pvt-v1"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return type(model).__module__ == _V1_MODULE

    def stage_grids(self, model: nn.Module) -> list[tuple[int, int]]:
        """Each stage's grid at the config's image size (conv arithmetic of the patch embeddings)."""
        size = model.config.image_size
        grid = (size, size) if isinstance(size, int) else tuple(size)
        grids = []
        for embedding in self._encoder(model).patch_embeddings:
            grid = conv_output_size(grid, embedding.projection)
            grids.append(grid)
        return grids

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        sites: list[AttentionSite] = []
        grids = self.stage_grids(model)
        embeddings = self._encoder(model).patch_embeddings
        index = 0
        for path, attn in model.named_modules():
            match = _SITE.search(path)
            if match is None or type(attn).__name__ != "PvtEfficientSelfAttention":
                continue
            stage = int(match.group(1))
            prefix = int(embeddings[stage].cls_token is not None)
            text = stage_grid_text(grids[stage], getattr(attn, "sequence_reduction", None), cls_token=bool(prefix))
            settings = {"stage": stage, "grid": text, "prefix": prefix}
            heads = attn.num_attention_heads
            sites.append(self.staged_site(path, attn, index, attn.hidden_size, heads, stage, settings, grids[stage]))
            index += 1
        return sites, []

    def carry(self, site: AttentionSite) -> CarriedReductionAttention:
        attn = site.module
        stage, settings, grid = self._stages[site.path]
        sr = getattr(attn, "sequence_reduction", None)
        return CarriedReductionAttention(
            qkv=SplitQKV(attn, _QKV_NAMES), proj=OutsideProjection(attn.all_head_size),
            num_heads=attn.num_attention_heads, head_dim=attn.attention_head_size, stage=stage,
            settings={key: value for key, value in settings.items() if key != "prefix"}, grid=grid, sr=sr,
            reduction_norm=attn.layer_norm if sr is not None else None, reduction_names=_REDUCTION_NAMES,
        )  # fmt: skip

    @torch.no_grad()
    def verify(self, site: AttentionSite) -> AttentionSite:
        """The module must equal spatial-reduction softmax attention built from its query/key/value and reduction
        (on a non-square grid, so a transposed grid would show; the last stage's CLS token in front)."""
        module = site.module
        if on_meta(module):
            return site
        carried = self.carry(site)
        prefix = self._stages[site.path].settings["prefix"]

        def call(attn: nn.Module, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
            expected = call_with_height_width(attn, x, grid)  # transformers' own error, if any, comes first
            if prefix and carried.sr is not None:
                raise ValueError("a CLS token before a spatial reduction: transformers' PvtModel cannot run this stage")
            return expected

        ratio = int(module.sequences_reduction_ratio)
        error = reduction_attention_error(module, carried, site.dim, ratio, call, prefix=prefix)
        return record_verdict(site, error, "spatial-reduction attention")
