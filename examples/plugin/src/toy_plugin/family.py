"""The family `toy-vit`: a tiny hand-written ViT (`ToyViT`), its adapter and its library hooks.

The adapter tells surgery where the attention is and how to rebuild the model; the library (`ToyLibrary`) lets
`vca-patch convert toy-vit-tiny` build the model by name and lets `from_pretrained` check and rebuild a saved one."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.core.errors import ConfigError, UnsafeConfigError
from vca_patch.families import AttentionSite, ModelAdapter, ModelLibrary, SkippedSite, register_family
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.layout import TokenLayout

FAMILY = "toy-vit"
LIBRARY = "toy"
# The models `vca-patch convert NAME` builds: name -> ToyViT options. Plain ints only: they go into config.json.
TOY_MODELS: dict[str, dict[str, int]] = {
    "toy-vit-tiny": {"img_size": 32, "patch_size": 8, "dim": 32, "depth": 2, "num_heads": 4, "num_classes": 10},
}
OPTIONS = frozenset(TOY_MODELS["toy-vit-tiny"])


class PatchEmbed(nn.Module):
    """Non-overlapping patches to tokens; `img_size` and `proj` are what vca-patch reads the input size from."""

    def __init__(self, img_size: int, patch_size: int, dim: int) -> None:
        super().__init__()
        self.img_size, self.patch_size = (img_size, img_size), patch_size
        self.proj = nn.Conv2d(3, dim, patch_size, stride=patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # [B, H·W, C]


class ToyAttention(nn.Module):
    """Softmax self-attention with a fused qkv Linear and an output Linear."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.proj(o.transpose(1, 2).reshape(B, N, C))


class ToyBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ToyAttention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ToyViT(nn.Module):
    """A class token, a learned position table, `depth` blocks and a linear head on the class token."""

    def __init__(
        self, img_size: int = 32, patch_size: int = 8, dim: int = 32, depth: int = 2, num_heads: int = 4,
        num_classes: int = 10,
    ) -> None:  # fmt: skip
        super().__init__()
        self.options = {"img_size": img_size, "patch_size": patch_size, "dim": dim, "depth": depth,
                        "num_heads": num_heads, "num_classes": num_classes}  # fmt: skip
        self.patch_embed = PatchEmbed(img_size, patch_size, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + (img_size // patch_size) ** 2, dim) * 0.02)
        self.blocks = nn.ModuleList(ToyBlock(dim, num_heads) for _ in range(depth))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, num_classes)
        self.num_classes = num_classes

    def forward_features(self, images: torch.Tensor) -> torch.Tensor:
        """The final normed tokens [B, 1 + H·W, C]: what `fidelity` compares token by token (timm's convention)."""
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        """Class logits from the class token (`fidelity` compares their top-1 when `num_classes` is set)."""
        return self.head(features[:, 0])

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(images))


class ToyLibrary(ModelLibrary):
    """How checkpoints of ToyViTs are checked (before anything is built) and how models are built by name."""

    name = LIBRARY
    load_priority = 50  # asked before timm (90), which claims every name

    def check_base(self, base: dict[str, Any], where: str) -> None:
        """Only {"library": "toy", "architecture": "ToyViT", "options": {known option: int}} is rebuilt."""
        options = base.get("options")
        if (
            set(base) - {"hf_hub_id"} != {"library", "architecture", "options"}
            or base["architecture"] != "ToyViT"
            or not isinstance(options, dict)
            or set(options) != OPTIONS
            or not all(type(value) is int and 0 < value <= 4096 for value in options.values())
        ):
            raise UnsafeConfigError(f"{where}: base = {base!r} is not allowed: expected a ToyViT description")

    def claims(self, name: str) -> bool:
        return name in TOY_MODELS

    def load(
        self, name: str, *, pretrained: bool = True, weights: Path | None = None, model_args: dict[str, Any] | None
    ) -> nn.Module:
        if pretrained and weights is None:
            raise ConfigError(f"{name} has no pretrained weights: pass --no-pretrained (random) or --weights FILE")
        model = ToyViT(**{**TOY_MODELS[name], **(model_args or {})})
        if weights is not None:
            from safetensors.torch import load_file

            model.load_state_dict(load_file(str(weights)))
        return model


@register_family  # also found through the entry point; registering the same class twice is a no-op
class ToyViTAdapter(ModelAdapter):
    """Where a ToyViT's attention is, its token layout, and how to describe and rebuild it."""

    name = FAMILY
    library = ToyLibrary()

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return isinstance(model, ToyViT)

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        dim, heads = model.options["dim"], model.options["num_heads"]
        sites = [AttentionSite(f"blocks.{i}.attn", block.attn, i, dim, heads) for i, block in enumerate(model.blocks)]
        return sites, []

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return model.patch_embed

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        _, _, height, width = args[0].shape  # the images
        return TokenLayout(1, (height // module.patch_size, width // module.patch_size))  # one class token

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        side = model.options["img_size"] // model.options["patch_size"]
        return TokenLayout(1, (side, side))

    def carry(self, site: AttentionSite) -> CarriedAttention:
        attn = site.module
        head_dim = site.dim // site.num_heads
        return CarriedAttention(qkv=attn.qkv, proj=attn.proj, num_heads=attn.num_heads, head_dim=head_dim)

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        pass  # ToyBlock calls attn(x) -> x, as every replacement is called

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        return {"library": LIBRARY, "architecture": "ToyViT", "options": dict(model.options)}

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        return ToyViT(**description["options"])  # runs under the meta device when a save is checked
