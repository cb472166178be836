"""Carried weights of joint (image + text) attention: MM-DiT (SD3/SD3.5) and Flux single-stream blocks.

Library-neutral: the families fill them, a target's builder turns them into its layer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from vca_patch.layers.carried import CarriedAttention, VariantRequired

TEXT_PROJECTIONS = ("add_q_proj", "add_k_proj", "add_v_proj")
TEXT_NORMS = {"norm_added_q": "added_q_norm", "norm_added_k": "added_k_norm"}  # diffusers name -> carry field
IMAGE_NORMS = {"norm_q": "q_norm", "norm_k": "k_norm"}


@dataclass
class CarriedJointAttention(CarriedAttention):
    """Carried weights of a joint attention: the image stream as in `CarriedAttention` (q_norm/k_norm are the
    image norms), plus the text stream's projections, norms and output projection (None: the text output is
    returned unprojected, as in SD3's last, `context_pre_only` block)."""

    add_q_proj: nn.Linear | None = None
    add_k_proj: nn.Linear | None = None
    add_v_proj: nn.Linear | None = None
    added_q_norm: nn.Module = field(default_factory=nn.Identity)
    added_k_norm: nn.Module = field(default_factory=nn.Identity)
    to_add_out: nn.Module | None = None

    kind: ClassVar[str] = "joint (image + text)"  # how errors name this attention

    def text_qkv(self, context: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Text q (normed), k (normed), v per head: [B, M, L, d] each."""
        B, L, _ = context.shape
        q, k, v = (
            p(context).view(B, L, self.num_heads, self.head_dim).transpose(1, 2) for p in self._text_projections()
        )
        return self.added_q_norm(q), self.added_k_norm(k), v

    def _text_projections(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        projections = (self.add_q_proj, self.add_k_proj, self.add_v_proj)
        if any(p is None for p in projections):
            raise ValueError("joint attention needs add_q_proj, add_k_proj and add_v_proj")
        return projections  # type: ignore[return-value]

    def instantiate(self, layer_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
        """Refused (`VariantRequired`): a target that takes joint attention builds its own variant from the carry."""
        raise VariantRequired(self.kind, layer_cls, self)


class NoOutputProjection(nn.Identity):
    """Stands in for the output projection of an attention that has none (Flux single-stream attention: the
    block's `proj_out` reads the attention output together with the MLP branch)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.in_features = self.out_features = features


@dataclass
class CarriedSingleStreamAttention(CarriedAttention):
    """Carried weights of a single-stream joint attention (Flux `single_transformer_blocks.*.attn`): one q/k/v
    for text and image tokens, per-head norms `q_norm`/`k_norm`, no output projection (`NoOutputProjection`)."""

    kind: ClassVar[str] = "single-stream joint"

    def instantiate(self, layer_cls: type[nn.Module], **kwargs: Any) -> nn.Module:
        """Refused (`VariantRequired`): a target that takes joint attention builds its own variant from the carry."""
        raise VariantRequired(self.kind, layer_cls, self)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with interleaved pairs (Flux's `apply_rotary_emb`, use_real_unbind_dim=-1) on
    [B, M, S, d] with cos, sin [S, d], computed in at least float32."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    real, imag = x.to(dtype).unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(-2)
    return (x.to(dtype) * cos.to(dtype) + rotated * sin.to(dtype)).to(x.dtype)
