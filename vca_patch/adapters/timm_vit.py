"""timm ViT family: `VisionTransformer` and subclasses (DeiT, distilled DeiT, register ViTs, ...)."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from ..attention import CarriedAttention, TokenLayout
from .base import AttentionSite, ModelAdapter, SkippedSite

_BLOCK_INDEX = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
# Constructor arguments recorded so the same base model can be rebuilt.
_RECORDED_ARGS = ("num_classes", "global_pool", "dynamic_img_size")


def _timm_attention_class() -> type[nn.Module]:
    from timm.layers import Attention

    return Attention


def _looks_like_attention(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "attention" in name or name.endswith("attn")


class TimmViTAdapter(ModelAdapter):
    """Converts timm's fused-qkv softmax self-attention (`timm.layers.Attention`) in ViT-style models."""

    name = "timm-vit"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return (
            type(model).__module__.startswith("timm.")
            and hasattr(model, "patch_embed")
            and hasattr(model, "num_prefix_tokens")
        )

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        attention_cls = _timm_attention_class()
        sites: list[AttentionSite] = []
        skipped: list[SkippedSite] = []
        for path, module in model.named_modules():
            if type(module) is attention_cls:
                match = _BLOCK_INDEX.search(path + ".")
                if match is None:
                    skipped.append(SkippedSite(path, type(module).__name__, "not inside a transformer block"))
                    continue
                notes = []
                if module.attn_drop.p > 0:
                    notes.append(f"attention dropout p={module.attn_drop.p} has no place in VCA")
                sites.append(
                    AttentionSite(path, module, int(match.group(1)), module.qkv.in_features, module.num_heads, notes)
                )
            elif _looks_like_attention(module) and not any(path.startswith(s.path + ".") for s in sites):
                reason = (
                    "attention pooling head (cross-attention), not token self-attention"
                    if "pool" in type(module).__name__.lower()
                    else f"no adapter for {type(module).__module__}.{type(module).__name__}"
                )
                skipped.append(SkippedSite(path, type(module).__name__, reason))
        return sites, skipped

    def num_prefix_tokens(self, model: nn.Module) -> int:
        return int(model.num_prefix_tokens)

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        grid = getattr(model.patch_embed, "grid_size", None)
        return TokenLayout(self.num_prefix_tokens(model), tuple(int(g) for g in grid)) if grid else None

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return model.patch_embed

    def grid_from_embedding(self, module: nn.Module, args: tuple, output: Any) -> tuple[int, int]:
        if output.ndim == 4:  # NHWC (dynamic_img_size)
            return int(output.shape[1]), int(output.shape[2])
        image_hw = tuple(args[0].shape[-2:])
        grid = module.dynamic_feat_size(image_hw) if hasattr(module, "dynamic_feat_size") else module.grid_size
        if grid[0] * grid[1] != output.shape[1]:
            raise RuntimeError(f"patch embedding gave {output.shape[1]} tokens, expected a {grid[0]}x{grid[1]} grid")
        return int(grid[0]), int(grid[1])

    def carry(self, site: AttentionSite) -> CarriedAttention:
        attn = site.module
        return CarriedAttention(
            qkv=attn.qkv,
            proj=attn.proj,
            num_heads=attn.num_heads,
            head_dim=attn.head_dim,
            q_norm=attn.q_norm,
            k_norm=attn.k_norm,
            norm=attn.norm,
            gate=attn.gate,
            proj_drop=attn.proj_drop,
        )

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        cfg = dict(getattr(model, "pretrained_cfg", None) or {})
        args = {key: getattr(model, key) for key in _RECORDED_ARGS if hasattr(model, key)}
        embed = model.patch_embed
        if getattr(embed, "dynamic_img_pad", False):
            args["dynamic_img_pad"] = True
        if getattr(embed, "img_size", None) is not None:
            args["img_size"] = list(embed.img_size)
        if hasattr(embed, "proj") and hasattr(embed.proj, "in_channels"):
            args["in_chans"] = embed.proj.in_channels
        return {
            "library": "timm",
            "architecture": cfg.get("architecture") or type(model).__name__,
            "pretrained_tag": cfg.get("tag"),
            "hf_hub_id": cfg.get("hf_hub_id"),
            "license": cfg.get("license"),
            "model_args": args,
        }

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        import timm

        name = description["architecture"]
        if description.get("pretrained_tag"):
            name = f"{name}.{description['pretrained_tag']}"
        return timm.create_model(name, pretrained=False, **description.get("model_args", {}))
