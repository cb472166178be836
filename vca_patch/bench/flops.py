"""Analytic multiply-accumulate (MAC) counts of a ViT forward pass, per attention target.

Per block with N tokens of C channels: the token-wise Linear layers, Σ in·out·N (12·N·C² for qkv + proj + a 4×
MLP), plus the attention's count from the registry in `vca_patch.layers.macs` (each target registers its own);
the patch embedding once per image. The head is ignored (O(C²)). FLOPs = 2 × MACs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

import vca_patch.targets  # noqa: F401  (registers the built-in targets' MAC counts)
from vca_patch.layers.macs import (  # noqa: F401  (re-exported: the registry lives with the layers)
    ATTENTION_MACS,
    AttentionMacs,
    AttentionShape,
    attention_macs,
    register_attention_macs,
    softmax_attention_macs,
)


@dataclass(frozen=True)
class ModelShape:
    """What the MAC count needs from a ViT: per-block token-wise linear MACs per token, heads, prefix."""

    depth: int
    dim: int
    num_heads: int
    num_prefix_tokens: int
    patch_size: tuple[int, int]
    in_chans: int
    linear_macs_per_token: float  # Σ in·out of each block's token-wise Linear layers
    embed_macs_per_patch: float  # patch embedding: C·in_chans·p²

    def grid(self, resolution: tuple[int, int]) -> tuple[int, int]:
        return resolution[0] // self.patch_size[0], resolution[1] // self.patch_size[1]


def model_shape(model: nn.Module) -> ModelShape:
    """Read a timm ViT-style model (`blocks`, `patch_embed`, `num_prefix_tokens`); BenchError for any other."""
    from vca_patch.bench.errors import BenchError

    missing = [a for a in ("blocks", "patch_embed", "num_prefix_tokens", "embed_dim") if not hasattr(model, a)]
    if missing or not len(model.blocks) or not hasattr(model.blocks[0], "attn"):
        what = f"it has no {', '.join(missing)}" if missing else "it has no attention blocks"
        raise BenchError(
            f"{type(model).__name__} is not a ViT-style timm model that bench can measure ({what}); "
            "bench needs one with patch_embed and blocks, e.g. deit_small_patch16_224"
        )
    blocks = list(model.blocks)
    linear = [sum(m.in_features * m.out_features for m in b.modules() if isinstance(m, nn.Linear)) for b in blocks]
    embed = model.patch_embed
    patch = tuple(embed.patch_size)
    dim = int(model.embed_dim)
    in_chans = int(embed.proj.in_channels)
    attn = blocks[0].attn
    return ModelShape(
        depth=len(blocks),
        dim=dim,
        num_heads=int(attn.num_heads),
        num_prefix_tokens=int(model.num_prefix_tokens),
        patch_size=(int(patch[0]), int(patch[1])),
        in_chans=in_chans,
        linear_macs_per_token=sum(linear) / len(blocks),
        embed_macs_per_patch=float(dim * in_chans * patch[0] * patch[1]),
    )


def model_macs(shape: ModelShape, resolution: tuple[int, int], target: str = "softmax", config: Any = None) -> float:
    """MACs of one image's forward pass; blocks outside `config.layers` (when set) stay softmax."""
    grid = shape.grid(resolution)
    layer = AttentionShape(shape.num_prefix_tokens, grid, shape.dim, shape.num_heads)
    layers = getattr(config, "layers", None)
    total = layer.num_patches * shape.embed_macs_per_patch
    for i in range(shape.depth):
        patched = target != "softmax" and (layers is None or i in layers)
        total += layer.num_tokens * shape.linear_macs_per_token
        total += attention_macs(target if patched else "softmax", layer, config)
    return total
