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

from vca_patch.families.base import LayoutTracker
from vca_patch.families.diffusers.joint import joint_verification_error, random_rotary
from vca_patch.families.diffusers.processor import CarriedLayerProcessor
from vca_patch.families.verify import Probe, eval_mode, on_meta, relative_error
from vca_patch.layers.joint_carry import CarriedJointAttention, CarriedSingleStreamAttention, rotate
from vca_patch.layers.layout import TokenLayout, open_scope

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


class FluxLayerProcessor(CarriedLayerProcessor):
    """Flux's call convention (`FluxAttnProcessor`: `attn, hidden_states, encoder_hidden_states, attention_mask,
    image_rotary_emb`, plus vca_patch's `layout=`); the subclasses say which streams they take."""

    def __call__(  # type: ignore[override]
        self,
        attn: nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        layout: TokenLayout | None = None,
    ) -> Any:
        owner = self.owner(attn)
        self.check_streams(owner, encoder_hidden_states, image_rotary_emb)
        self.refuse_mask(owner, attention_mask)
        self.bind(attn)
        return self.run(hidden_states, encoder_hidden_states, layout=layout, rotary=image_rotary_emb)


class FluxJointLayerProcessor(FluxLayerProcessor):
    """Processor for a Flux double-stream attention converted to `JointVisualContrastAttention`: image tokens,
    text tokens and the rotary embedding of [text; image] in; (image output, text output) out, as FluxAttnProcessor."""

    def check_streams(
        self, owner: str, encoder_hidden_states: torch.Tensor | None, rotary: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        if encoder_hidden_states is None or rotary is None:
            raise TypeError(f"{owner} needs encoder_hidden_states and image_rotary_emb (Flux double-stream attention)")

    def run(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None, **kwargs: Any) -> Any:
        return self.layer(hidden_states, encoder_hidden_states, **kwargs)


class FluxSingleLayerProcessor(FluxLayerProcessor):
    """Processor for a Flux single-stream attention converted to `SingleStreamVisualContrastAttention`: the
    [text; image] sequence and its rotary embedding in, the unprojected attention output out, as FluxAttnProcessor."""

    def check_streams(
        self, owner: str, encoder_hidden_states: torch.Tensor | None, rotary: tuple[torch.Tensor, ...] | None = None
    ) -> None:
        if encoder_hidden_states is not None:
            raise TypeError(f"{owner} is single-stream attention over [text; image]; it got encoder_hidden_states")


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


@torch.no_grad()
def flux_verification_error(attn: nn.Module, carried: CarriedJointAttention) -> float | None:
    """Largest relative error of the two output streams, module vs the written-out reference (text first, random
    rotary embedding), on a random probe in float32 at least."""
    return joint_verification_error(attn, carried, image_first=False, rotary=True, family="Flux")


@torch.no_grad()
def single_verification_error(attn: nn.Module, carried: CarriedSingleStreamAttention) -> float | None:
    """Relative error of a Flux single-stream attention's output against the written-out reference (random
    rotary embedding), on a random [text; image] probe in float32 at least."""
    if on_meta(attn):
        return None
    probe = Probe.of(attn, carried)
    x = probe.randn(2, 22, carried.dim)
    cos, sin = (t.to(probe.weight) for t in random_rotary(22, carried.head_dim, probe.generator))
    with eval_mode(probe.module):
        expected = probe.module(hidden_states=x, image_rotary_emb=(cos, sin))
    if not isinstance(expected, torch.Tensor):
        raise TypeError("the Flux single-stream attention did not return one tensor")
    return relative_error(reference_single_attention(probe.carried, x, (cos, sin)), expected)
