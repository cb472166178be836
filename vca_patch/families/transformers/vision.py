"""Hugging Face transformers vision encoders (5.x layout): ViT, DeiT, DINOv2 (+registers), CLIP/SigLIP vision,
BEiT, ViT-MSN, I-JEPA and other encoders whose attention has q_proj/k_proj/v_proj and o_proj/out_proj.

Data2VecVision keeps the split layout (`attention.attention`: query/key/value; `attention.output.dense` after it)
and BEiT's relative-position bias, its own (computed from `resolution=`) or shared (passed in): the site is the
self-attention, its output projection stays where it is (the replacement's is the identity), the bias is dropped
and named, and verification runs against softmax attention that adds it.
"""

from __future__ import annotations

import inspect
import os
import re
from typing import Any

import torch
from torch import nn

from vca_patch.core.hub_access import is_hub_id
from vca_patch.families.base import AttentionSite, ModelAdapter, SkippedSite, attention_dropout_note
from vca_patch.families.call_shims import TokensOnly, TupleOutput
from vca_patch.families.timm.vit import reference_biased_attention
from vca_patch.families.transformers.library import TRANSFORMERS
from vca_patch.families.verify import TOLERANCE, eval_mode, float32_copy, reference_softmax_attention, relative_error
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.fused_qkv import SplitQKV
from vca_patch.layers.layout import TokenLayout, as_size
from vca_patch.layers.window_terms import PassThroughProjection

_LAYER_INDEX = re.compile(r"(?:^|\.)layers?\.(\d+)\.")
_OUTPUT_NAMES = ("o_proj", "out_proj")
_SPLIT_NAMES = ("query", "key", "value")  # Data2VecVision's self-attention (output projection outside it)
_TEXT_TOWER = re.compile(r"(?:^|\.)(?:text_(?:model|tower|encoder)|language_model)(?:\.|$)")
BIAS_APPROXIMATION = "relative position bias dropped (VCA has no pairwise token bias)"
_BIAS_NOTE_START = "relative position bias dropped"
# Hierarchical families (one grid per stage, windows or spatial reduction) have adapters of their own.
HIERARCHICAL_MODEL_TYPES = frozenset({"swin", "swinv2", "pvt", "pvt_v2"})


def _output_name(module: nn.Module) -> str | None:
    return next((name for name in _OUTPUT_NAMES if isinstance(getattr(module, name, None), nn.Linear)), None)


def _output_projection(module: nn.Module) -> nn.Linear | None:
    name = _output_name(module)
    return None if name is None else getattr(module, name)


def _is_qkv_attention(module: nn.Module) -> bool:
    projections = (getattr(module, name, None) for name in ("q_proj", "k_proj", "v_proj"))
    return all(isinstance(p, nn.Linear) for p in projections) and _output_projection(module) is not None


def _is_split_biased_attention(module: nn.Module) -> bool:
    """BEiT-style self-attention in the split layout (Data2VecVision): query/key/value Linear layers, no output
    projection of its own, and a `relative_position_bias` call argument."""
    projections = (getattr(module, name, None) for name in _SPLIT_NAMES)
    if not all(isinstance(p, nn.Linear) for p in projections) or _output_projection(module) is not None:
        return False
    return "relative_position_bias" in inspect.signature(module.forward).parameters


def _split_bias_note(model: nn.Module) -> str:
    """The note naming the pairwise bias a split-layout BEiT-style model adds to its attention logits."""
    holders = [m for m in model.modules() if isinstance(getattr(m, "relative_position_bias_table", None), nn.Parameter)]
    if not holders:
        return BIAS_APPROXIMATION
    table = holders[0].relative_position_bias_table
    return (
        f"{_BIAS_NOTE_START} ({type(holders[0]).__name__}.relative_position_bias_table, {table.shape[0]}x"
        f"{table.shape[1]} learned, {len(holders)} table(s), added to the attention logits; VCA has no pairwise "
        "token bias)"
    )


class SplitBiasedCall:
    """Forward pre-hook: Data2VecVision calls its self-attention positionally, as (hidden_states, output_attentions,
    relative_position_bias, interpolate_pos_encoding, resolution); the replacement takes the tokens alone (the bias
    is dropped, as the report says; the grid comes from the token layout)."""

    names = ("hidden_states", "output_attentions", "relative_position_bias", "interpolate_pos_encoding", "resolution")

    def __init__(self) -> None:
        self.tokens_only = TokensOnly(dropped=("relative_position_bias", "resolution", "output_attentions"))

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        return self.tokens_only(module, (), {**dict(zip(self.names, args, strict=False)), **kwargs})


def _unsupported_attention(module: nn.Module, path: str, sites: list[AttentionSite]) -> bool:
    """Named like a self-attention leaf (not a block, not inside a matched site) but not in the known layout."""
    name = type(module).__name__
    looks = name.endswith(("Attention", "SelfAttention")) and not isinstance(module, nn.MultiheadAttention)
    inside = any(path.startswith(s.path + ".") for s in sites)
    has_attention_child = any(type(c).__name__.endswith("Attention") for c in module.children())
    return looks and not inside and not has_attention_child and not _is_qkv_attention(module)


def _num_heads(module: nn.Module) -> int:
    for name in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(module, name, None), int):
            return getattr(module, name)
    return module.config.num_attention_heads


def _patch_conv(embeddings: nn.Module) -> nn.Conv2d:
    convs = [m for m in embeddings.modules() if isinstance(m, nn.Conv2d)]
    if not convs:
        raise ValueError(f"{type(embeddings).__name__} has no patch convolution")
    return convs[0]


def _grid(conv: nn.Conv2d, height: int, width: int) -> tuple[int, int]:
    (kh, kw), (sh, sw) = conv.kernel_size, conv.stride
    return (height - kh) // sh + 1, (width - kw) // sw + 1


def _uses_relative_position_bias(config: Any) -> bool:
    return bool(
        getattr(config, "use_relative_position_bias", False)
        or getattr(config, "use_shared_relative_position_bias", False)
    )


def _bias_note(model: nn.Module) -> str | None:
    """The note naming the learned pairwise bias the model passes to its attention as the mask (BEiT-style
    `relative_position_bias_table`, found by structure whatever the module is called), or None without one."""
    holders = [m for m in model.modules() if isinstance(getattr(m, "relative_position_bias_table", None), nn.Parameter)]
    if not holders:
        return BIAS_APPROXIMATION if _uses_relative_position_bias(model.config) else None
    table = holders[0].relative_position_bias_table
    return (
        f"{_BIAS_NOTE_START} ({type(holders[0]).__name__}.relative_position_bias_table, {table.shape[0]}x"
        f"{table.shape[1]} learned, {len(holders)} table(s), passed to attention as its mask; VCA has no pairwise "
        "token bias)"
    )


class HFVisionAdapter(ModelAdapter):
    """Converts the vision self-attention of Hugging Face transformers encoders; text towers are never touched."""

    name = "hf-vision"
    library = TRANSFORMERS

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        if getattr(getattr(model, "config", None), "model_type", None) in HIERARCHICAL_MODEL_TYPES:
            return False
        return type(model).__module__.startswith("transformers.") and cls._find_embeddings(model) is not None

    @staticmethod
    def _find_embeddings(model: nn.Module) -> tuple[str, nn.Module] | None:
        for path, module in model.named_modules():
            is_vision_embedding = path.split(".")[-1] == "embeddings" and not _TEXT_TOWER.search(path)
            if is_vision_embedding and any(isinstance(m, nn.Conv2d) for m in module.modules()):
                return path, module
        return None

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        bias_dropped = _bias_note(model)
        sites: list[AttentionSite] = []
        skipped: list[SkippedSite] = []
        for path, module in model.named_modules():
            class_name = type(module).__name__
            if _is_split_biased_attention(module) and (match := _LAYER_INDEX.search(path + ".")) is not None:
                notes = [_split_bias_note(model), *filter(None, [attention_dropout_note(module)])]
                dim, heads = module.query.in_features, _num_heads(module)
                sites.append(AttentionSite(path, module, int(match.group(1)), dim, heads, notes))
            elif _unsupported_attention(module, path, sites):
                reason = (
                    f"no adapter for {type(module).__module__}.{class_name}: expected q_proj/k_proj/v_proj and "
                    "o_proj/out_proj Linear layers (the transformers 5.x layout)"
                )
                skipped.append(SkippedSite(path, class_name, reason))
            elif isinstance(module, nn.MultiheadAttention):
                skipped.append(
                    SkippedSite(path, class_name, "attention pooling head (cross-attention), not token self-attention")
                )
            elif _is_qkv_attention(module):
                match = _LAYER_INDEX.search(path + ".")
                if _TEXT_TOWER.search(path) or "Text" in class_name:
                    skipped.append(
                        SkippedSite(path, class_name, "text tower / language model (causal attention): never patched")
                    )
                elif match is None:
                    skipped.append(SkippedSite(path, class_name, "not inside an encoder layer"))
                else:
                    notes = [bias_dropped] if bias_dropped else []
                    notes += filter(None, [attention_dropout_note(module)])
                    sites.append(
                        AttentionSite(
                            path, module, int(match.group(1)), module.q_proj.in_features, _num_heads(module), notes
                        )
                    )
        return sites, skipped

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return self._find_embeddings(model)[1]

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        pixels = args[0] if args else kwargs["pixel_values"]
        tokens = output[0] if isinstance(output, tuple) else output  # BEiT also returns the patch grid
        grid = _grid(_patch_conv(module), *pixels.shape[-2:])
        return TokenLayout(as_size(tokens.shape[1]) - grid[0] * grid[1], grid)

    @torch.no_grad()
    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        embeddings = self.embedding_module(model)
        conv = _patch_conv(embeddings)
        size = getattr(getattr(model.config, "vision_config", model.config), "image_size", None)
        if size is None or conv.weight.is_meta:
            return None
        height, width = (size, size) if isinstance(size, int) else size
        pixels = torch.zeros(1, conv.in_channels, height, width, dtype=conv.weight.dtype, device=conv.weight.device)
        return self.layout_from_embedding(embeddings, (pixels,), {}, embeddings(pixels))

    def carry(self, site: AttentionSite) -> CarriedAttention:
        attn = site.module
        if _is_split_biased_attention(attn):  # the output projection (attention.output.dense) stays outside
            return CarriedAttention(
                qkv=SplitQKV(attn, _SPLIT_NAMES), proj=PassThroughProjection(attn.all_head_size),
                num_heads=site.num_heads, head_dim=attn.attention_head_size,
            )  # fmt: skip
        return CarriedAttention(
            qkv=SplitQKV(attn),  # q_proj/k_proj/v_proj, read from the module (and then the replacement)
            proj=_output_projection(attn),
            num_heads=site.num_heads,
            head_dim=attn.q_proj.out_features // site.num_heads,
            proj_name=_output_name(attn),
        )

    def call_original(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x)[0]

    def verify(self, site: AttentionSite) -> AttentionSite:
        """As the generic check; where the model passes a pairwise bias as the mask, also with a random bias given
        as `attention_mask` against softmax attention that adds it. Split-layout BEiT-style attention
        (Data2VecVision): against softmax attention that adds its own bias and a random shared one."""
        if _is_split_biased_attention(site.module):
            error = self._split_bias_error(site)
            site.verified = None if error is None else error < TOLERANCE
            if site.verified is False:
                site.notes.append(f"reference softmax attention with the relative-position bias differs by {error:.2g}")
            return site
        site = super().verify(site)
        if site.verified and any(note.startswith(_BIAS_NOTE_START) for note in site.notes):
            error = self._bias_error(site)
            site.verified = error is None or error < TOLERANCE
            if not site.verified:
                site.notes.append(f"reference softmax attention with the pairwise bias differs by {error:.2g}")
        return site

    @torch.no_grad()
    def _bias_error(self, site: AttentionSite) -> float | None:
        module, carried = float32_copy(site.module, self.carry(site))
        weight = next(module.parameters())
        if weight.is_meta:
            return None
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(2, 17, site.dim, generator=generator).to(weight)
        bias = torch.randn(1, site.num_heads, 17, 17, generator=generator).to(weight)
        with eval_mode(module):
            expected = module(x, attention_mask=bias)[0]
        return relative_error(reference_biased_attention(carried, x, bias), expected)

    @torch.no_grad()
    def _split_bias_error(self, site: AttentionSite) -> float | None:
        """Relative error of the module against softmax attention adding its own bias (from `resolution=`, on a
        3x4 grid: a transposed grid would show) and, second, also a random shared bias passed in."""
        module, carried = float32_copy(site.module, self.carry(site))
        weight = next(module.parameters())
        if weight.is_meta:
            return None
        grid, patch = (3, 4), module.config.patch_size
        tokens = 1 + grid[0] * grid[1]
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(2, tokens, site.dim, generator=generator).to(weight)
        shared = torch.randn(1, site.num_heads, tokens, tokens, generator=generator).to(weight)
        own = module.relative_position_bias(grid, False, dim_size=tokens) if module.has_relative_position_bias else 0
        errors = []
        with eval_mode(module):
            for extra in (None, shared):
                expected = module(x, False, extra, False, (grid[0] * patch, grid[1] * patch))[0]
                bias = own + (0 if extra is None else extra)
                reference = (
                    reference_biased_attention(carried, x, bias)
                    if isinstance(bias, torch.Tensor)
                    else reference_softmax_attention(carried, x)
                )
                errors.append(relative_error(reference, expected))
        return max(errors)

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        if _is_split_biased_attention(site.module):
            replacement.register_forward_pre_hook(SplitBiasedCall(), with_kwargs=True)
            replacement.register_forward_hook(TupleOutput())
            return
        mask_is_bias = any(note.startswith(_BIAS_NOTE_START) for note in site.notes)
        replacement.register_forward_pre_hook(TokensOnly(mask_is_bias=mask_is_bias), with_kwargs=True)
        replacement.register_forward_hook(TupleOutput())

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        name = getattr(model.config, "_name_or_path", "") or None
        return {
            "library": "transformers",
            "architecture": type(model).__name__,
            "config": model.config.to_dict(),
            "hf_hub_id": name if is_hub_id(name) and not os.path.exists(name) else None,  # ./m, ../m: local
            "license": None,
        }

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        import transformers

        config = dict(description["config"])
        model_cls = getattr(transformers, description["architecture"])
        config_obj = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
        return model_cls(config_obj)
