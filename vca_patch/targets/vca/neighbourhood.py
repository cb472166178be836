"""Neighbourhood attention of the patch rows: each patch query reads the prefix keys and the k×k patch keys
around it on the grid, with one softmax over those (neighbours past the grid's edge are left out).

VCA's optional local term (`VisualContrastAttention(local_window=k)`): the pooled contrast tokens carry the
global part of a pretrained model's attention, and this carries the sharp, content-dependent local part that a
fixed depthwise conv cannot. Cost O(H·W·(P + k²)·d) per head: linear in the tokens, like the rest of the layer.
Float32 CPU inference runs the fused kernel's op (`fused_cpu.neighbourhood_cpu`: one parallel loop, the
neighbourhood's keys and values read from cache); everything else (training, GPUs, bf16/fp16) runs it as masked
attention in one SDPA: of 8×8 query blocks over their prefix and halo keys (linear in the tokens), or, on small
grids where that is cheaper, of every patch query over all keys. A fwd + bwd of 8 images at 16×16 patches, k = 7,
on 2 CPU cores takes 5-9x less time than k² shifted views of the key and value grids did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.sdpa import scaled_dot_product_attention
from vca_patch.targets.vca import fused_cpu

BLOCK = 8  # query blocks of BLOCK × BLOCK patches (8: fastest of 8 and 16 at 16×16 and 37×37 grids, k = 7)


def is_local_window(value: object) -> bool:
    """Whether `value` is a valid `local_window`: 0 (no local term) or an odd kernel size (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (value == 0 or value % 2 == 1)


def kernel_usable(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors with a unit channel stride, no gradient needed, and the fused kernel built."""
    plain = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return plain and not grad and not torch.compiler.is_compiling() and fused_cpu.kernel_available()


def neighbourhood_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, kernel: int, scale: float
) -> torch.Tensor:
    """q, k, v [B, M, N, d] (N = prefix + H·W) -> [B, M, H·W, d]: softmax(s·q·kᵀ) over the prefix keys and the
    kernel × kernel patch neighbourhood of each patch query, times the matching values. bf16/fp16 run through
    SDPA (max error 0.04 in bf16 on N(0, 1.5²) inputs, against 0.06 for an explicit float32 softmax of bf16 logits)."""
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"the neighbourhood kernel must be a positive odd size, got {kernel}")
    if kernel_usable(q, k, v):
        B, M, _, d = q.shape
        P, (H, W) = layout.num_prefix_tokens, layout.grid
        out = fused_cpu.neighbourhood_cpu(q, k, v, P, H, W, kernel, scale)  # [B, H·W, M·d]
        return out.view(B, H * W, M, d).transpose(1, 2)
    if _dense_is_cheaper(layout, kernel):
        return _dense_attention(q, k, v, layout, kernel, scale)
    return _blocked_attention(q, k, v, layout, kernel, scale)


def _dense_is_cheaper(layout: TokenLayout, kernel: int) -> bool:
    """Whether one masked SDPA over all N keys computes at most twice the logits of the query blocks' (it copies no
    halos): at 224 px (16×16 patches) for k = 7 and 11, 2x faster fwd + bwd on CPU; from 24×24 (k = 7) and 37×37
    (k = 11) the blocks are 1.5-3x faster."""
    P, (H, W), b = layout.num_prefix_tokens, layout.grid, BLOCK
    dense_logits = H * W * (P + H * W)
    blocked_logits = -(-H // b) * -(-W // b) * b * b * (P + (b + kernel - 1) ** 2)
    return dense_logits <= 2 * blocked_logits


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, kernel: int, scale: float
) -> torch.Tensor:
    """`neighbourhood_attention` as one SDPA of the patch queries over all N keys, masked to the prefix and each
    query's neighbourhood: quadratic in the tokens, for small grids."""
    P, W, r = layout.num_prefix_tokens, layout.grid[1], kernel // 2
    # each key's grid row and column from one arange (the prefix keys get negative indices and are allowed below):
    # plain arithmetic on the symbolic sizes, which exporters keep symbolic
    key = torch.arange(k.shape[2], device=q.device) - P  # [N]: patch index of each key, < 0 for the prefix
    rows = key.div(W, rounding_mode="floor")
    cols = key - rows * W
    near = ((rows[P:, None] - rows[None]).abs() <= r) & ((cols[P:, None] - cols[None]).abs() <= r)  # [H·W, N]
    mask = near | (key < 0)[None]  # the prefix keys, always
    return scaled_dot_product_attention(q[:, :, P:], k, v, attn_mask=mask, scale=scale)


def _query_block_mask(layout: TokenLayout, kernel: int, device: torch.device) -> torch.Tensor:
    """[nb, b², P + S²] bool, True where a query of a BLOCK × BLOCK query block may read a key of its block's keys: the
    prefix, then its S × S halo (S = BLOCK + kernel − 1) in row-major order. A query reads the prefix and the halo
    keys within kernel // 2 rows and columns that lie on the grid; the padding queries past the grid's edge (dropped
    afterwards) read everything, so no softmax row is empty."""
    P, (H, W), r, b = layout.num_prefix_tokens, layout.grid, kernel // 2, BLOCK
    S = b + 2 * r

    def axis(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Along one grid axis of n patches: [blocks, b, S] whether each (query, halo key) pair is within reach with
        the key on the grid, and [blocks, b] whether the query lies past the grid (padding)."""
        start = torch.arange(0, -(-n // b) * b, b, device=device).view(-1, 1, 1)  # [blocks, 1, 1] first query
        query = torch.arange(b, device=device).view(1, b, 1)  # offset in the block
        key = torch.arange(S, device=device).view(1, 1, S)  # offset in the halo, which starts r before the block
        reach = (key - r - query).abs() <= r
        on_grid = (start - r + key >= 0) & (start - r + key < n)
        return reach & on_grid, (start + query >= n)[..., 0]

    rows, padded_rows = axis(H)
    cols, padded_cols = axis(W)
    # [Hb, 1, b, 1, S, 1] & [1, Wb, 1, b, 1, S] -> [Hb, Wb, b, b, S, S]
    allowed = rows[:, None, :, None, :, None] & cols[None, :, None, :, None, :]
    padding = padded_rows[:, None, :, None] | padded_cols[None, :, None, :]  # [Hb, Wb, b, b]
    allowed = (allowed | padding[..., None, None]).flatten(4).flatten(2, 3).flatten(0, 1)  # [nb, b², S²]
    return torch.cat([allowed.new_ones(*allowed.shape[:2], P), allowed], dim=-1)


def _blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, kernel: int, scale: float
) -> torch.Tensor:
    """`neighbourhood_attention` as masked attention of BLOCK × BLOCK query blocks over their prefix + halo keys:
    one batched SDPA, differentiable, linear in the tokens (each block reads (BLOCK + kernel − 1)² + P keys)."""
    B, M, _, d = q.shape
    P, (H, W), r, b = layout.num_prefix_tokens, layout.grid, kernel // 2, BLOCK
    Hb, Wb, S = -(-H // b), -(-W // b), b + 2 * r
    pad_h, pad_w = Hb * b - H, Wb * b - W  # the grid padded to whole blocks

    def grid(x: torch.Tensor) -> torch.Tensor:  # [B, M, N, d] -> patch rows as [B, M, H, W, d]
        return x[:, :, P:].reshape(B, M, H, W, d)

    def halo(x: torch.Tensor) -> torch.Tensor:  # [B, M, N, d] -> each block's keys [B, nb, M, P + S², d]
        padded = F.pad(grid(x), (0, 0, r, r + pad_w, r, r + pad_h))  # [B, M, Hb·b + 2r, Wb·b + 2r, d]
        windows = padded.unfold(2, S, b).unfold(3, S, b)  # [B, M, Hb, Wb, d, S, S]
        windows = windows.permute(0, 2, 3, 1, 5, 6, 4).reshape(B, Hb * Wb, M, S * S, d)
        return torch.cat([x[:, None, :, :P].expand(B, Hb * Wb, M, P, d), windows], dim=3)

    queries = F.pad(grid(q), (0, 0, 0, pad_w, 0, pad_h)).view(B, M, Hb, b, Wb, b, d)
    queries = queries.permute(0, 2, 4, 1, 3, 5, 6).reshape(B, Hb * Wb, M, b * b, d)
    mask = _query_block_mask(layout, kernel, q.device)[:, None]  # [nb, 1, b², P + S²]
    out = scaled_dot_product_attention(queries, halo(k), halo(v), attn_mask=mask, scale=scale)  # [B, nb, M, b², d]
    out = out.view(B, Hb, Wb, M, b, b, d).permute(0, 3, 1, 4, 2, 5, 6).reshape(B, M, Hb * b, Wb * b, d)
    return out[:, :, :H, :W].reshape(B, M, H * W, d)
