"""Neighbourhood attention of the patch rows: each patch query reads the prefix keys and the k×k patch keys
around it on the grid, with one softmax over those (neighbours past the grid's edge are left out).

VCA's optional local term (`VisualContrastAttention(local_window=k)`): the pooled contrast tokens carry the
global part of a pretrained model's attention, and this carries the sharp, content-dependent local part that a
fixed depthwise conv cannot. Cost O(H·W·(P + k²)·d) per head: linear in the tokens, like the rest of the layer.
Float32 CPU inference runs the fused kernel's op (`fused_cpu.neighbourhood_cpu`: one parallel loop, the
neighbourhood's keys and values read from cache); everything else runs k² shifted views of the zero-padded key and
value grids (no k²-fold copy of them: 6-25x faster on CPU than unfolding the neighbourhoods).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import fused_cpu
from .layout import TokenLayout


def is_local_window(value: object) -> bool:
    """Whether `value` is a valid `local_window`: 0 (no local term) or an odd kernel size (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (value == 0 or value % 2 == 1)


def _offsets(kernel: int) -> list[tuple[int, int]]:
    return [(i, j) for i in range(kernel) for j in range(kernel)]


def kernel_usable(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors with a unit channel stride, no gradient needed, and the fused kernel built."""
    plain = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return plain and not grad and not torch.compiler.is_compiling() and fused_cpu.kernel_available()


def neighbourhood_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, kernel: int, scale: float
) -> torch.Tensor:
    """q, k, v [B, M, N, d] (N = prefix + H·W) -> [B, M, H·W, d]: softmax(s·q·kᵀ) over the prefix keys and the
    kernel × kernel patch neighbourhood of each patch query, times the matching values. Softmax in float32 at
    least (bf16/fp16 safe)."""
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"the neighbourhood kernel must be a positive odd size, got {kernel}")
    B, M, _, d = q.shape
    P, (H, W), r = layout.num_prefix_tokens, layout.grid, kernel // 2
    if kernel_usable(q, k, v):
        out = fused_cpu.neighbourhood_cpu(q, k, v, P, H, W, kernel, scale)  # [B, H·W, M·d]
        return out.view(B, H * W, M, d).transpose(1, 2)

    def grid(x: torch.Tensor) -> torch.Tensor:  # [B, M, N, d] -> patch rows as [B, M, H, W, d]
        return x[:, :, P:].reshape(B, M, H, W, d)

    queries = grid(q) * scale
    keys = F.pad(grid(k), (0, 0, r, r, r, r))  # [B, M, H + 2r, W + 2r, d], zeros past the edge
    values = F.pad(grid(v), (0, 0, r, r, r, r))
    near = torch.stack(
        [torch.linalg.vecdot(queries, keys[:, :, i : i + H, j : j + W]) for i, j in _offsets(kernel)], -1
    )
    on_grid = F.pad(torch.ones(H, W, dtype=torch.bool, device=q.device), (r, r, r, r))
    inside = torch.stack([on_grid[i : i + H, j : j + W] for i, j in _offsets(kernel)], -1)  # [H, W, k²]
    near = near.masked_fill(~inside, float("-inf")).reshape(B, M, H * W, kernel * kernel)
    logits = torch.cat([queries.reshape(B, M, H * W, d) @ k[:, :, :P].transpose(-1, -2), near], dim=-1)
    weights = logits.softmax(dim=-1, dtype=torch.promote_types(q.dtype, torch.float32)).to(v.dtype)
    out = weights[..., :P] @ v[:, :, :P] if P else torch.zeros_like(queries).reshape(B, M, H * W, d)
    out = out.reshape(B, M, H, W, d)
    local = weights[..., P:].reshape(B, M, H, W, kernel * kernel)
    grad = torch.is_grad_enabled() and (local.requires_grad or values.requires_grad)
    for t, (i, j) in enumerate(_offsets(kernel)):
        term = (local[..., t : t + 1], values[:, :, i : i + H, j : j + W])
        out = torch.addcmul(out, *term) if grad else out.addcmul_(*term)
    return out.reshape(B, M, H * W, d)
