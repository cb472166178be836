"""Joint (image + text) attention of diffusers MM-DiTs (SD3/SD3.5 `JointAttnProcessor2_0`): carry and verification.

The carry reads the image stream (`to_q/to_k/to_v`, `to_out`, `norm_q/norm_k`) and the text stream
(`add_q_proj/add_k_proj/add_v_proj`, `norm_added_q/norm_added_k`, `to_add_out`) of one `Attention` module.
Verification runs the module's own processor on random image and text tokens and compares both output streams
with a softmax attention written out from the carried weights, in the model's token order (image first for SD3).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vca_patch.families.verify import Probe, eval_mode, on_meta, relative_error
from vca_patch.layers.fused_qkv import SplitQKV
from vca_patch.layers.joint_carry import CarriedJointAttention

_QKV = ("to_q", "to_k", "to_v")
_TEXT_QKV = ("add_q_proj", "add_k_proj", "add_v_proj")


def joint_structure_problem(attn: nn.Module) -> str | None:
    """Why a joint attention module does not have the layout `carry_joint` reads, or None."""
    text = [getattr(attn, n, None) for n in _TEXT_QKV]
    if not all(isinstance(p, nn.Linear) for p in text):
        return "expected add_q_proj/add_k_proj/add_v_proj Linear layers"
    if len({p.out_features for p in text} | {attn.to_q.out_features}) != 1:
        return "text and image projections differ in width"
    add_out = getattr(attn, "to_add_out", None)
    if add_out is not None and not isinstance(add_out, nn.Linear):
        return "to_add_out is not a Linear"
    return None


def _optional(attn: nn.Module, name: str) -> nn.Module:
    module = getattr(attn, name, None)
    return nn.Identity() if module is None else module


def carry_joint(attn: nn.Module) -> CarriedJointAttention:
    """Both streams' modules of a diffusers joint `Attention` (the modules themselves, not copies)."""
    return CarriedJointAttention(
        qkv=SplitQKV(attn, _QKV),
        proj=attn.to_out[0],
        num_heads=attn.heads,
        head_dim=attn.to_q.out_features // attn.heads,
        q_norm=_optional(attn, "norm_q"),
        k_norm=_optional(attn, "norm_k"),
        proj_drop=attn.to_out[1] if len(attn.to_out) > 1 else nn.Identity(),
        add_q_proj=attn.add_q_proj,
        add_k_proj=attn.add_k_proj,
        add_v_proj=attn.add_v_proj,
        added_q_norm=_optional(attn, "norm_added_q"),
        added_k_norm=_optional(attn, "norm_added_k"),
        to_add_out=getattr(attn, "to_add_out", None),
    )


def reference_joint_attention(
    carried: CarriedJointAttention,
    image: torch.Tensor,
    text: torch.Tensor,
    *,
    image_first: bool = True,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the joint sequence, written out from `carried`: (image [B, N, C_out], text [B, L, C]).

    rotary: (cos, sin) [L + N, d] in the joint sequence's order, interleaved pairs (Flux), applied after the norms.
    """
    B, N, _ = image.shape
    M, d = carried.num_heads, carried.head_dim
    q, k, v = carried.qkv(image).view(B, N, 3, M, d).permute(2, 0, 3, 1, 4).unbind(0)  # [B, M, N, d]
    q, k = carried.q_norm(q), carried.k_norm(k)
    tq, tk, tv = carried.text_qkv(text)  # [B, M, L, d]
    parts = [(q, tq), (k, tk), (v, tv)] if image_first else [(tq, q), (tk, k), (tv, v)]
    q, k, v = (torch.cat(pair, dim=2) for pair in parts)
    if rotary is not None:
        q, k = (_rotate_pairs(t, *rotary) for t in (q, k))
    weights = torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5, dim=-1)
    out = (weights @ v).transpose(1, 2).reshape(B, -1, M * d)
    image_out, text_out = (out[:, :N], out[:, N:]) if image_first else (out[:, -N:], out[:, :-N])
    image_out = carried.proj_drop(carried.proj(image_out))
    return image_out, text_out if carried.to_add_out is None else carried.to_add_out(text_out)


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(x₀, x₁) -> (x₀cos − x₁sin, x₁cos + x₀sin) per interleaved pair, in x's dtype."""
    pairs = x.unflatten(-1, (-1, 2))
    c, s = cos.to(x.dtype)[..., ::2], sin.to(x.dtype)[..., ::2]
    out = torch.stack([pairs[..., 0] * c - pairs[..., 1] * s, pairs[..., 1] * c + pairs[..., 0] * s], dim=-1)
    return out.flatten(-2)


def random_rotary(num_tokens: int, head_dim: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [S, d] of random angles, pairs interleaved as Flux's `FluxPosEmbed` gives them."""
    angles = torch.rand(num_tokens, head_dim // 2, generator=generator, dtype=torch.float64) * 6.3
    return angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)


@torch.no_grad()
def joint_verification_error(
    attn: nn.Module, carried: CarriedJointAttention, *, image_first: bool = True, rotary: bool = False,
    family: str = "joint",
) -> float | None:  # fmt: skip
    """Largest relative error of the two output streams, module vs reference, on a random probe (float32 at
    least; None on the meta device). `image_first=False, rotary=True`: the model's order is [text; image] and its
    attention takes a rotary embedding of that sequence (`image_rotary_emb`, random here), as Flux's double-stream
    attention; `family` names the attention in the error when it does not return both streams."""
    if on_meta(attn):
        return None
    probe = Probe.of(attn, carried)  # checked in float32
    image = probe.randn(2, 17, carried.dim)
    text = probe.randn(2, 5, carried.add_q_proj.in_features)
    emb: tuple[torch.Tensor, torch.Tensor] | None = None
    if rotary:
        cos, sin = random_rotary(22, carried.head_dim, probe.generator)
        emb = (cos.to(probe.weight), sin.to(probe.weight))
    extra: dict[str, Any] = {} if emb is None else {"image_rotary_emb": emb}
    with eval_mode(probe.module):
        expected = probe.module(hidden_states=image, encoder_hidden_states=text, **extra)
    if not (isinstance(expected, tuple) and len(expected) == 2):
        raise TypeError(f"the {family} attention did not return (image output, text output)")
    got = reference_joint_attention(probe.carried, image, text, image_first=image_first, rotary=emb)
    return max(relative_error(g, e) for g, e in zip(got, expected, strict=True))
