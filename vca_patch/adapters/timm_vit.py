"""timm ViT-style families: ViT/DeiT (+ distilled, registers, hybrid stems), EVA/EVA02, RoPE ViTs, BEiT, CaiT."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..attention import CarriedAttention, TokenLayout
from ..attention.fused_qkv import FusedQKVView, QKVWithSeparateBias, SplitQKV
from .base import AttentionSite, LayoutTracker, ModelAdapter, SkippedSite, attention_dropout_note
from .call_shims import TokensOnly
from .timm_base import create_timm_base, describe_timm_base

_BLOCK_INDEX = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
# Constructor arguments recorded so the same base model can be rebuilt.
_RECORDED_ARGS = ("num_classes", "global_pool", "dynamic_img_size")


@dataclass(frozen=True)
class _Family:
    """How one timm attention class is converted."""

    dropped_kwargs: tuple[str, ...] = ()  # call arguments the replacement discards
    approximation: str | None = None  # what the conversion drops, when it is not exact
    verifiable: bool = True  # called plainly, the module is softmax attention a reference can reproduce


_SELF_ATTENTION = {
    "timm.layers.attention.Attention": _Family(),
    "timm.layers.attention.AttentionRope": _Family(("rope",), "rotary position embedding (rope) dropped"),
    "timm.models.eva.EvaAttention": _Family(("rope",), "rotary position embedding (rope) dropped"),
    "timm.models.beit.Attention": _Family(
        ("shared_rel_pos_bias",), "relative position bias dropped (VCA has no pairwise token bias)", False
    ),
    "timm.models.cait.TalkingHeadAttn": _Family((), "talking-heads mixing (proj_l, proj_w) dropped", False),
}
_NOT_SELF_ATTENTION = {
    "AttentionPoolLatent": "attention pooling head (cross-attention), not token self-attention",
    "ClassAttn": "class attention (CLS queries only), not token self-attention",
}


def _qualified_name(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__name__}"


def _named_like_attention(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "attention" in name or name.endswith("attn")


def _looks_like_attention(module: nn.Module) -> bool:
    """Named like attention and not merely a block that contains one."""
    return _named_like_attention(module) and not any(_named_like_attention(c) for c in module.children())


def _fused_qkv(attn: nn.Module) -> nn.Module | FusedQKVView:
    """The fused qkv projection, read from the module's own members: `qkv`, `qkv` + `q_bias`/`v_bias` (BEiT, EVA),
    or `q_proj`/`k_proj`/`v_proj` (EVA unfused)."""
    if isinstance(getattr(attn, "qkv", None), nn.Linear):
        if getattr(attn, "q_bias", None) is not None and attn.qkv.bias is None:
            return QKVWithSeparateBias(attn)
        return attn.qkv
    return SplitQKV(attn)


class TimmViTAdapter(ModelAdapter):
    """Converts the token self-attention of timm ViT-style models; other attention is listed as skipped."""

    name = "timm-vit"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return (
            type(model).__module__.startswith("timm.")
            and hasattr(model, "patch_embed")
            and hasattr(model, "num_prefix_tokens")
        )

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        sites: list[AttentionSite] = []
        skipped: list[SkippedSite] = []
        for path, module in model.named_modules():
            family = _SELF_ATTENTION.get(_qualified_name(module))
            class_name = type(module).__name__
            if family is not None:
                match = _BLOCK_INDEX.search(path + ".")
                if match is None:
                    skipped.append(SkippedSite(path, class_name, "not inside a transformer block"))
                    continue
                qkv = _fused_qkv(module)
                notes = [family.approximation] if family.approximation else []
                notes += filter(None, [attention_dropout_note(module)])
                sites.append(AttentionSite(path, module, int(match.group(1)), qkv.in_features, module.num_heads, notes))
            elif _looks_like_attention(module) and not any(path.startswith(s.path + ".") for s in sites):
                reason = _NOT_SELF_ATTENTION.get(class_name, f"no adapter for {_qualified_name(module)}")
                skipped.append(SkippedSite(path, class_name, reason))
        return sites, skipped

    @staticmethod
    def _num_prefix_tokens(model: nn.Module) -> int:
        # CaiT appends its class token only after the self-attention blocks.
        return 0 if hasattr(model, "blocks_token_only") else int(model.num_prefix_tokens)

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        grid = getattr(model.patch_embed, "grid_size", None)
        return TokenLayout(self._num_prefix_tokens(model), tuple(int(g) for g in grid)) if grid else None

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return model.patch_embed

    def install_layout_tracker(self, model: nn.Module) -> LayoutTracker:
        self.num_prefix_tokens = self._num_prefix_tokens(model)  # timm adds prefix tokens after the patch embed
        return super().install_layout_tracker(model)

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        if output.ndim == 4:  # NHWC (dynamic_img_size)
            grid = (int(output.shape[1]), int(output.shape[2]))
        else:
            image_hw = tuple((args[0] if args else kwargs["x"]).shape[-2:])
            grid = module.dynamic_feat_size(image_hw) if hasattr(module, "dynamic_feat_size") else module.grid_size
            if grid[0] * grid[1] != output.shape[1]:
                raise RuntimeError(
                    f"patch embedding gave {output.shape[1]} tokens, expected a {grid[0]}x{grid[1]} grid"
                )
        return TokenLayout(self.num_prefix_tokens, (int(grid[0]), int(grid[1])))

    def carry(self, site: AttentionSite) -> CarriedAttention:
        attn = site.module
        qkv = _fused_qkv(attn)
        identity = nn.Identity()
        return CarriedAttention(
            qkv=qkv,
            proj=attn.proj,
            num_heads=attn.num_heads,
            head_dim=qkv.out_features // 3 // attn.num_heads,
            q_norm=getattr(attn, "q_norm", identity),
            k_norm=getattr(attn, "k_norm", identity),
            norm=getattr(attn, "norm", identity),
            gate=getattr(attn, "gate", None),
            proj_drop=getattr(attn, "proj_drop", identity),
        )

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        # timm calls attention as attn(x, attn_mask=...), which the replacements take as they are (refusing a
        # mask themselves); only families with extra call arguments need a hook to drop them (a hook makes every
        # call take nn.Module's slow path: ~10 µs a layer).
        family = _SELF_ATTENTION[_qualified_name(site.module)]
        if family.dropped_kwargs:
            replacement.register_forward_pre_hook(TokensOnly(family.dropped_kwargs), with_kwargs=True)

    def verify(self, site: AttentionSite) -> AttentionSite:
        # Rope families called without rope are plain softmax attention; BEiT's bias and CaiT's talking
        # heads are not, so a reference cannot reproduce them by design (the report says what is dropped).
        if not _SELF_ATTENTION[_qualified_name(site.module)].verifiable:
            return site
        return super().verify(site)

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        args = {key: getattr(model, key) for key in _RECORDED_ARGS if hasattr(model, key)}
        embed = model.patch_embed
        if getattr(embed, "dynamic_img_pad", False):
            args["dynamic_img_pad"] = True
        if getattr(embed, "img_size", None) is not None:
            args["img_size"] = list(embed.img_size)
        if hasattr(embed, "proj") and hasattr(embed.proj, "in_channels"):
            args["in_chans"] = embed.proj.in_channels
        return describe_timm_base(model, args)

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        return create_timm_base(description)
