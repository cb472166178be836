"""timm ViT-style families: ViT/DeiT (+ distilled, registers, hybrid stems), EVA/EVA02, RoPE ViTs, BEiT, CaiT.

Attention that adds a learned pairwise (relative-position) bias is recognised by structure, whatever its class:
a `qkv`/`proj` module holding a `relative_position_bias_table` itself or in a child (or a child with `get_bias()`,
timm's RelPosBias/RelPosMlp), or taking a shared bias argument (`*rel_pos*`). It converts as approximate, the
bias named in the report, and is verified against softmax attention *with* that bias (`reference_biased_attention`).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vca_patch.families.base import AttentionSite, LayoutTracker, ModelAdapter, SkippedSite, attention_dropout_note
from vca_patch.families.call_shims import TokensOnly
from vca_patch.families.timm.base import create_timm_base, describe_timm_base
from vca_patch.families.timm.library import TIMM
from vca_patch.families.verify import eval_mode, float32_copy, record_verdict, relative_error
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.fused_qkv import FusedQKVView, QKVWithSeparateBias, SplitQKV
from vca_patch.layers.layout import TokenLayout, as_size

_BLOCK_INDEX = re.compile(r"(?:^|\.)blocks\.(\d+)\.")
# Constructor arguments recorded so the same base model can be rebuilt.
_RECORDED_ARGS = ("num_classes", "global_pool", "dynamic_img_size")


@dataclass(frozen=True)
class _Family:
    """How one timm attention class is converted."""

    dropped_kwargs: tuple[str, ...] = ()  # call arguments the replacement discards
    approximation: str | None = None  # what the conversion drops, when it is not exact
    verifiable: bool = True  # called plainly, the module is softmax attention a reference can reproduce
    pairwise_bias: bool = False  # adds a learned pairwise bias: verified against a reference that includes it


_SELF_ATTENTION = {
    "timm.layers.attention.Attention": _Family(),
    "timm.layers.attention.AttentionRope": _Family(("rope",), "rotary position embedding (rope) dropped"),
    "timm.models.eva.EvaAttention": _Family(("rope",), "rotary position embedding (rope) dropped"),
    "timm.models.beit.Attention": _Family(("shared_rel_pos_bias",), None, True, True),  # note: `bias_note`
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


def _bias_holder(module: nn.Module) -> nn.Module | None:
    """The module holding `module`'s own learned pairwise bias: itself (a `relative_position_bias_table`
    parameter), or a child with such a table or a `get_bias()` method; None without one."""
    if isinstance(getattr(module, "relative_position_bias_table", None), nn.Parameter):
        return module
    for child in module.children():
        if isinstance(getattr(child, "relative_position_bias_table", None), nn.Parameter) or callable(
            getattr(child, "get_bias", None)
        ):
            return child
    return None


def _bias_arguments(module: nn.Module) -> tuple[str, ...]:
    """The forward's arguments that carry a shared pairwise bias (`shared_rel_pos_bias`, `shared_rel_pos`, ...)."""
    return tuple(name for name in inspect.signature(module.forward).parameters if "rel_pos" in name)


def pairwise_bias(module: nn.Module) -> torch.Tensor | None:
    """The module's own pairwise bias [1, M, N, N], read from its table and index (`table[index]`); from the
    holder's `get_bias()` when the bias is generated (an MLP over relative coordinates). None without one."""
    holder = _bias_holder(module)
    if holder is None:
        return None
    table = getattr(holder, "relative_position_bias_table", None)
    index = getattr(holder, "relative_position_index", None)
    if isinstance(table, nn.Parameter) and isinstance(index, torch.Tensor):
        n = math.isqrt(index.numel())
        return table[index.reshape(-1)].reshape(n, n, -1).permute(2, 0, 1).unsqueeze(0)
    return holder.get_bias()


def bias_note(module: nn.Module) -> str:
    """The report's note naming the pairwise bias a conversion drops."""
    holder = _bias_holder(module)
    table = getattr(holder, "relative_position_bias_table", None) if holder is not None else None
    if isinstance(table, nn.Parameter):
        what = f"{type(holder).__name__}.relative_position_bias_table, {table.shape[0]}x{table.shape[1]} learned"
    elif holder is not None:
        what = f"{type(holder).__name__}, generated by {type(getattr(holder, 'mlp', holder)).__name__}"
    else:
        what = f"the shared bias passed as {'/'.join(_bias_arguments(module))}"
    return f"relative position bias dropped ({what}; VCA has no pairwise token bias)"


def _structural_family(module: nn.Module) -> _Family | None:
    """A `_Family` for attention with fused qkv/proj that adds a learned pairwise bias, whatever its class."""
    plain = isinstance(getattr(module, "qkv", None), nn.Linear) and isinstance(getattr(module, "proj", None), nn.Linear)
    if not plain or not isinstance(getattr(module, "num_heads", None), int):
        return None
    if _bias_holder(module) is None and not _bias_arguments(module):
        return None
    return _Family(_bias_arguments(module), None, True, True)


def reference_biased_attention(carried: CarriedAttention, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(s·q·kᵀ + bias)·v then proj, from `carried`'s weights, written out: x [B, N, C], bias [1|B, M, N, N]."""
    B, N, _ = x.shape
    M, d = carried.num_heads, carried.head_dim
    q, k, v = carried.qkv(x).view(B, N, 3, M, d).permute(2, 0, 3, 1, 4).unbind(0)
    q, k = carried.q_norm(q), carried.k_norm(k)
    weights = torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5 + bias, dim=-1)
    return carried.proj(carried.norm((weights @ v).transpose(1, 2).reshape(B, N, M * d)))


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
    library = TIMM

    def __init__(self) -> None:
        self._families: dict[str, _Family] = {}  # qualified class name -> family, the structural ones included

    def _family(self, module: nn.Module) -> _Family | None:
        name = _qualified_name(module)
        family = self._families.get(name) or _SELF_ATTENTION.get(name) or _structural_family(module)
        if family is not None:
            self._families[name] = family
        return family

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
            family = self._family(module) if _looks_like_attention(module) or hasattr(module, "qkv") else None
            class_name = type(module).__name__
            if family is not None:
                match = _BLOCK_INDEX.search(path + ".")
                if match is None:
                    skipped.append(SkippedSite(path, class_name, "not inside a transformer block"))
                    continue
                qkv = _fused_qkv(module)
                notes = [family.approximation] if family.approximation else []
                notes += [bias_note(module)] if family.pairwise_bias else []
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
            grid = (output.shape[1], output.shape[2])
        else:
            image_hw = tuple((args[0] if args else kwargs["x"]).shape[-2:])
            grid = module.dynamic_feat_size(image_hw) if hasattr(module, "dynamic_feat_size") else module.grid_size
            if grid[0] * grid[1] != output.shape[1]:
                raise RuntimeError(
                    f"patch embedding gave {output.shape[1]} tokens, expected a {grid[0]}x{grid[1]} grid"
                )
        return TokenLayout(self.num_prefix_tokens, (as_size(grid[0]), as_size(grid[1])))

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
        family = self._family(site.module)
        if family.dropped_kwargs:
            replacement.register_forward_pre_hook(TokensOnly(family.dropped_kwargs), with_kwargs=True)

    def verify(self, site: AttentionSite) -> AttentionSite:
        # Rope families called without rope are plain softmax attention; BEiT's bias and CaiT's talking
        # heads are not, so a reference cannot reproduce them by design (the report says what is dropped).
        family = self._family(site.module)
        if not family.verifiable:
            return site
        if family.pairwise_bias:
            return self._verify_with_bias(site, family)
        return super().verify(site)

    @torch.no_grad()
    def _verify_with_bias(self, site: AttentionSite, family: _Family) -> AttentionSite:
        """The module must equal softmax attention with its own bias (`pairwise_bias`), on the token count that bias
        is built for; a module without one is given a random shared bias (its bias argument) instead."""
        module, carried = float32_copy(site.module, self.carry(site))
        weight = next(module.parameters())
        if weight.is_meta:
            return site
        own = pairwise_bias(module)
        n = own.shape[-1] if own is not None else 1 + 4 * 4
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(2, n, site.dim, generator=generator).to(weight)
        takes_shared = own is None and family.dropped_kwargs  # a shared bias only where the module has none
        shared = torch.randn(1, site.num_heads, n, n, generator=generator).to(weight) if takes_shared else None
        with eval_mode(module):
            expected = module(x, **({family.dropped_kwargs[0]: shared} if shared is not None else {}))
        bias = sum(b for b in (own, shared) if b is not None)
        error = relative_error(reference_biased_attention(carried, x, bias), expected)
        return record_verdict(site, error, "softmax attention with the pairwise bias")

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
