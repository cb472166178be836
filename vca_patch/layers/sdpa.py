"""Scaled dot-product attention for the layers: PyTorch's SDPA, run in float32 under CPU autocast.

Under `torch.autocast("cpu", torch.bfloat16)` PyTorch runs SDPA in bf16, and the CPU flash kernel's bf16
forward + backward is 1.4-2x slower than its float32 one at the shapes of a VCA layer (8 crops of DINOv2
ViT-S at 224 px, one thread: Stage I 67 -> 34 ms, Stage II 70 -> 33 ms, the 11x11 local term 87 -> 62 ms), while
the linear layers around it gain from bf16. So on the CPU, under autocast, the attention itself runs in float32
(also more precise) and returns autocast's dtype, as plain SDPA would; everywhere else this is plain SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask, scale=scale)`: q [..., L, d], k/v [..., S, d(v)] ->
    [..., L, dv]; in float32 when q is on the CPU under CPU autocast (returned in autocast's dtype)."""
    if q.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    dtype = torch.get_autocast_dtype("cpu")
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.float()
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=attn_mask, scale=scale)
    return out.to(dtype)
