"""Flux (`FluxTransformer2DModel`) in diffusers: the token layout from `img_ids`, the double- and single-stream joint
attention's processors, and their verification with the rotary embedding.

Flux packs the latent into 2×2 patches before `x_embedder` (a Linear), so no module sees a [B, C, H, W] latent: a
forward pre-hook on the model reads the image position ids (`img_ids`, rows (0, row, col) row-major, in packed
units) and opens the call's layout scope with that grid. Text comes first in Flux's joint sequence, and the
rotary embedding (`image_rotary_emb`, (cos, sin) over [text; image]) is applied to every query and key: it is
Flux's only positional signal and is never dropped (`JointVisualContrastAttention.rope_contrast`). Single-stream
blocks concatenate [text; image] before the attention, which shares one q/k/v and has no output projection: the
text length is the sequence's length less the grid's H·W.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import TokenLayout
from ..attention.joint_vca import CarriedJointAttention, CarriedSingleStreamAttention, rotate
from ..attention.layout import open_scope
from .base import LayoutTracker
from .diffusers_joint import _relative, reference_joint_attention
from .diffusers_processor import CarriedLayerProcessor
from .verify import eval_mode, float32_copy

FLUX_MODELS = ("FluxTransformer2DModel",)


def is_flux(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.") and type(model).__name__ in FLUX_MODELS


def flux_grid(img_ids: torch.Tensor, num_tokens: int) -> tuple[int, int]:
    """(H, W) of Flux image ids [N, 3] = (0, row, col) row-major over an H×W grid; a clear error otherwise."""
    ids = img_ids[0] if img_ids.ndim == 3 else img_ids
    if ids.ndim != 2 or ids.shape[0] != num_tokens or ids.shape[1] != 3:
        raise ValueError(f"img_ids must be [{num_tokens}, 3] for {num_tokens} image tokens, got {tuple(ids.shape)}")
    height, width = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    rows = torch.arange(height, device=ids.device).repeat_interleave(width)
    cols = torch.arange(width, device=ids.device).repeat(height)
    expected = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).to(ids.dtype)
    if height * width != num_tokens or not torch.equal(ids, expected):
        raise ValueError(
            "vca_patch needs Flux image ids (0, row, col) over one row-major grid starting at (0, 0); got others "
            "(several images, as in Kontext or IP conditioning, or an offset grid): not supported"
        )
    return height, width


class FluxLayoutHook:
    """Forward pre-hook (with kwargs) on a patched Flux model: opens the call's layout scope from `img_ids`."""

    def __init__(self, tracker: LayoutTracker) -> None:
        self.tracker = tracker

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        img_ids = args[4] if len(args) > 4 else kwargs.get("img_ids")
        if img_ids is None:
            raise ValueError("a patched Flux model needs img_ids (the image tokens' position ids)")
        open_scope(self.tracker, TokenLayout(0, flux_grid(img_ids, hidden.shape[1])))


class FluxJointLayerProcessor(CarriedLayerProcessor):
    """Processor for a Flux double-stream attention converted to `JointVisualContrastAttention`: image tokens,
    text tokens and the rotary embedding of [text; image] in; (image output, text output) out, as FluxAttnProcessor."""

    def __call__(  # type: ignore[override]
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        layout: TokenLayout | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        owner = self.owner(attn)
        if encoder_hidden_states is None or image_rotary_emb is None:
            raise TypeError(f"{owner} needs encoder_hidden_states and image_rotary_emb (Flux double-stream attention)")
        self.refuse_mask(owner, attention_mask)
        self.bind(attn)
        return self.layer(hidden_states, encoder_hidden_states, layout=layout, rotary=image_rotary_emb)


class FluxSingleLayerProcessor(CarriedLayerProcessor):
    """Processor for a Flux single-stream attention converted to `SingleStreamVisualContrastAttention`: the
    [text; image] sequence and its rotary embedding in, the unprojected attention output out, as FluxAttnProcessor."""

    def __call__(  # type: ignore[override]
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        layout: TokenLayout | None = None,
    ) -> torch.Tensor:
        owner = self.owner(attn)
        if encoder_hidden_states is not None:
            raise TypeError(f"{owner} is single-stream attention over [text; image]; it got encoder_hidden_states")
        self.refuse_mask(owner, attention_mask)
        self.bind(attn)
        return self.layer(hidden_states, layout=layout, rotary=image_rotary_emb)


def reference_single_attention(
    carried: CarriedSingleStreamAttention, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """Softmax attention over one sequence [B, S, C] written out from `carried` (norms, then rotary (cos, sin)
    [S, d] with interleaved pairs): [B, S, M·d], unprojected."""
    B, S, _ = x.shape
    M, d = carried.num_heads, carried.head_dim
    q, k, v = carried.qkv(x).view(B, S, 3, M, d).permute(2, 0, 3, 1, 4).unbind(0)  # [B, M, S, d]
    q, k = carried.q_norm(q), carried.k_norm(k)
    if rotary is not None:
        q, k = (rotate(t, *rotary) for t in (q, k))
    weights = torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5, dim=-1)
    return (weights @ v).transpose(1, 2).reshape(B, S, M * d)


def random_rotary(num_tokens: int, head_dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [S, d] of random angles, pairs interleaved as Flux's `FluxPosEmbed` gives them."""
    angles = torch.rand(num_tokens, head_dim // 2, generator=generator, dtype=torch.float64) * 6.3
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


@torch.no_grad()
def flux_verification_error(attn: nn.Module, carried: CarriedJointAttention) -> float | None:
    """Largest relative error of the two output streams, module vs the written-out reference (text first, random
    rotary embedding), on a random probe in float32 at least."""
    weight = next(attn.parameters())
    if weight.is_meta:
        return None
    attn, carried = float32_copy(attn, carried)  # checked in float32
    weight = next(attn.parameters())
    generator = torch.Generator().manual_seed(0)
    image = torch.randn(2, 17, carried.dim, generator=generator).to(weight)
    text = torch.randn(2, 5, carried.add_q_proj.in_features, generator=generator).to(weight)
    cos, sin = (t.to(weight) for t in random_rotary(22, carried.head_dim, generator))
    with eval_mode(attn):
        expected: Any = attn(hidden_states=image, encoder_hidden_states=text, image_rotary_emb=(cos, sin))
    if not (isinstance(expected, tuple) and len(expected) == 2):
        raise TypeError("the Flux attention did not return (image output, text output)")
    got = reference_joint_attention(carried, image, text, image_first=False, rotary=(cos, sin))
    return max(_relative(g, e) for g, e in zip(got, expected, strict=True))


@torch.no_grad()
def single_verification_error(attn: nn.Module, carried: CarriedSingleStreamAttention) -> float | None:
    """Relative error of a Flux single-stream attention's output against the written-out reference (random
    rotary embedding), on a random [text; image] probe in float32 at least."""
    weight = next(attn.parameters())
    if weight.is_meta:
        return None
    attn, carried = float32_copy(attn, carried)
    weight = next(attn.parameters())
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 22, carried.dim, generator=generator).to(weight)
    cos, sin = (t.to(weight) for t in random_rotary(22, carried.head_dim, generator))
    with eval_mode(attn):
        expected = attn(hidden_states=x, image_rotary_emb=(cos, sin))
    if not isinstance(expected, torch.Tensor):
        raise TypeError("the Flux single-stream attention did not return one tensor")
    return _relative(reference_single_attention(carried, x, (cos, sin)), expected)
