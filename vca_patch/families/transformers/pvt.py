"""Hugging Face transformers PVTv2 (`PvtV2Model`, `PvtV2ForImageClassification`, `PvtV2Backbone`):
spatial-reduction attention converted with its reduction kept (exact carry), as timm's (`timm_pvt`).

`PvtV2SelfAttention` holds `query`, `key`, `value`, `proj`, the reduction `spatial_reduction` (conv k = s = R) and
`layer_norm`, and is called `attention(hidden_states=, height=, width=, output_attentions=)`, returning a tuple.
The replacement (`SpatialReductionVCA`) keeps those names (state-dict keys unchanged) and takes the grid from the
call's height and width; λ_init follows the global block index over all stages. `linear_attention` models are
skipped (already linear). `VCAConfig.pvt_mode="paper"` drops the reduction (approximate). PVT v1 (`PvtModel`) has
an adapter of its own (`hf_pvt_v1`).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vca_patch.families.base import AttentionSite, SkippedSite
from vca_patch.families.timm.pvt import (
    LINEAR_ATTENTION_REASON,
    conv_output_size,
    note_dropped_reduction,
    reduction_attention_error,
    stage_grid_text,
)
from vca_patch.families.transformers.staged import HFStagedAdapter
from vca_patch.families.verify import on_meta, record_verdict
from vca_patch.layers.fused_qkv import SplitQKV
from vca_patch.layers.layout import TokenLayout, as_size
from vca_patch.layers.staged_carry import CarriedReductionAttention

_V2_MODULE = "transformers.models.pvt_v2.modeling_pvt_v2"
_SITE = re.compile(r"(?:^|\.)layers\.(\d+)\.blocks\.(\d+)\.attention$")
_QKV_NAMES = ("query", "key", "value")
_REDUCTION_NAMES = ("spatial_reduction", "layer_norm")


class PvtCallShim:
    """Forward pre-hook: `attention(hidden_states=, height=, width=, output_attentions=)` -> `layer(x, (H, W))`.

    Asking for attention weights (`output_attentions=True`) is an error: VCA has no N×N attention map.
    """

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        names = ("hidden_states", "height", "width", "output_attentions")
        values = dict(zip(names, args, strict=False)) | kwargs
        unknown = sorted(set(values) - set(names) - {"layout"})
        if unknown:
            raise TypeError(f"{type(module).__name__} (patched by vca_patch) takes no argument(s) {unknown}")
        if values.get("output_attentions"):
            raise ValueError(
                f"{type(module).__name__} (patched by vca_patch) has no attention weights to output: "
                "call the model with output_attentions=False"
            )
        x, height, width = values["hidden_states"], values["height"], values["width"]
        return (x, (int(height), int(width))), {}


def call_with_height_width(module: nn.Module, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The output tokens of `module(hidden_states, height, width)`, as transformers' PVT layers call attention."""
    return module(x, grid[0], grid[1])[0]


class OneTuple:
    """Forward hook: return `(output,)`, as `PvtV2SelfAttention` does without `output_attentions`."""

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> tuple[torch.Tensor]:
        return (output,)


class HFPvtAdapter(HFStagedAdapter):
    """Converts transformers PVTv2 spatial-reduction attention to `SpatialReductionVCA`; see the module docstring."""

    name = "hf-pvt"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return type(model).__module__ == _V2_MODULE

    @staticmethod
    def _encoder(model: nn.Module) -> nn.Module:
        return next(m for m in model.modules() if type(m).__name__ in ("PvtV2Encoder", "PvtEncoder"))

    def stage_grids(self, model: nn.Module) -> list[tuple[int, int]]:
        """Each stage's grid at the config's image size (conv arithmetic of the overlapping patch embeddings)."""
        size = model.config.image_size
        grid = (size, size) if isinstance(size, int) else tuple(size)
        grids = []
        for layer in self._encoder(model).layers:
            grid = conv_output_size(grid, layer.patch_embedding.proj)
            grids.append(grid)
        return grids

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        sites: list[AttentionSite] = []
        skipped: list[SkippedSite] = []
        grids = self.stage_grids(model)
        index = 0
        for path, attn in model.named_modules():
            match = _SITE.search(path)
            if match is None or type(attn).__name__ != "PvtV2SelfAttention":
                continue
            stage = int(match.group(1))
            if attn.linear_attention:
                skipped.append(SkippedSite(path, type(attn).__name__, LINEAR_ATTENTION_REASON))
            else:
                text = stage_grid_text(grids[stage], getattr(attn, "spatial_reduction", None))
                settings = {"stage": stage, "grid": text}
                heads = attn.num_attention_heads
                sites.append(
                    self.staged_site(path, attn, index, attn.hidden_size, heads, stage, settings, grids[stage])
                )
            index += 1
        return sites, skipped

    def embedding_module(self, model: nn.Module) -> nn.Module:
        encoder = self._encoder(model)
        return encoder.layers[0].patch_embedding if hasattr(encoder, "layers") else encoder.patch_embeddings[0]

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        _, height, width = output  # (tokens, height, width): stage 1's grid
        return TokenLayout(0, (as_size(height), as_size(width)))

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        return TokenLayout(0, self.stage_grids(model)[0])

    def carry(self, site: AttentionSite) -> CarriedReductionAttention:
        attn = site.module
        stage, settings, grid = self._stages[site.path]
        sr = getattr(attn, "spatial_reduction", None)
        return CarriedReductionAttention(
            qkv=SplitQKV(attn, _QKV_NAMES), proj=attn.proj, num_heads=attn.num_attention_heads,
            head_dim=attn.attention_head_size, proj_drop=attn.proj_drop, stage=stage, settings=settings,
            grid=grid, sr=sr,
            reduction_norm=attn.layer_norm if sr is not None else None, reduction_names=_REDUCTION_NAMES,
        )  # fmt: skip

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        replacement.register_forward_pre_hook(PvtCallShim(), with_kwargs=True)
        replacement.register_forward_hook(OneTuple())
        note_dropped_reduction(replacement, site)

    @torch.no_grad()
    def verify(self, site: AttentionSite) -> AttentionSite:
        """The module must equal spatial-reduction softmax attention built from its query/key/value, reduction
        and proj (on a non-square grid, so a transposed grid would show)."""
        module = site.module
        if on_meta(module):
            return site
        ratio = module.spatial_reduction_ratio
        error = reduction_attention_error(module, self.carry(site), site.dim, ratio, call_with_height_width)
        return record_verdict(site, error, "spatial-reduction attention")
