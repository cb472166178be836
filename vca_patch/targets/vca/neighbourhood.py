"""Neighbourhood attention of the patch rows: each patch query reads the prefix keys and the k×k patch keys around it
on the grid, with one softmax over those (neighbours past the grid's edge are left out).

VCA's optional local term (`VisualContrastAttention(local_window=k)`): the pooled contrast tokens carry the
global part of a pretrained model's attention, and this carries the sharp, content-dependent local part that a
fixed depthwise conv cannot. Cost O(H·W·(P + k²)·d) per head: linear in the tokens, like the rest of the layer.

Four ways to compute it, one function:

- float32 CPU inference, eager or under `torch.compile`, runs the fused kernel's op (`fused_cpu.neighbourhood_cpu`:
  queries vectorised across lanes, no mask, no gather; an opaque call in a compiled graph); a VCA layer's own fused
  op runs the same code per block of its rows (`local_window` among its arguments), with no tensor in between;
- CUDA (eager or compiled, any dtype, training included) runs FlexAttention with a block mask built from the
  grid's shape (`flex_block_mask`), which skips the key blocks out of reach of a query block;
- everything else (CPU training, bf16/fp16 on the CPU, `torch.export` and ONNX, a CUDA build without Flex) runs
  masked attention in one SDPA: of 8×8 query blocks over their prefix and halo keys (linear in the tokens) or, on
  small grids where that is cheaper, of every patch query over all keys.

Every mask is built from aranges of the (possibly symbolic) grid sizes: no data-dependent op, no Python-side cache,
so a traced graph serves every grid (measured figures: docs/results/deploy.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.sdpa import scaled_dot_product_attention
from vca_patch.targets.vca import fused_cpu

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

BLOCK = 8  # SDPA query blocks of BLOCK × BLOCK patches (8: fastest of 4, 8 and 16 at 16×16 and 37×37 grids, k = 7)
FLEX_BLOCK = 128  # FlexAttention's sparse block (its default): query and key blocks of 128 tokens


def is_local_window(value: object) -> bool:
    """Whether `value` is a valid `local_window`: 0 (no local term) or an odd kernel size (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0 and (value == 0 or value % 2 == 1)


def kernel_usable(*tensors: torch.Tensor) -> bool:
    """float32 CPU tensors with a unit channel stride, no gradient needed, not being exported (an exported graph
    must hold standard operators only), and the fused kernel built. Under torch.compile the op is an opaque call
    whose grid sizes stay symbolic."""
    plain = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.stride(-1) == 1 for t in tensors)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return plain and not grad and not torch.compiler.is_exporting() and fused_cpu.kernel_available()


@torch.compiler.assume_constant_result  # traced as a constant: no guard, no graph break
def flex_available() -> bool:
    """Whether this PyTorch has FlexAttention and a Triton to compile it with (what its CUDA kernels need)."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return has_triton()


def flex_usable(q: torch.Tensor) -> bool:
    """The Flex path: CUDA tensors, not being exported (ONNX has no FlexAttention), and Flex available."""
    return q.device.type == "cuda" and not torch.compiler.is_exporting() and flex_available()


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
    if flex_usable(q):
        return flex_neighbourhood_attention(q, k, v, layout, kernel, scale)
    if torch.compiler.is_exporting() or not _dense_is_cheaper(layout, kernel):
        return _blocked_attention(q, k, v, layout, kernel, scale)  # exported: linear at every grid, no size guard
    return _dense_attention(q, k, v, layout, kernel, scale)


def _dense_is_cheaper(layout: TokenLayout, kernel: int) -> bool:
    """Whether one masked SDPA over all N keys computes at most twice the logits of the query blocks' (it copies no
    halos): at 224 px (16×16 patches) for k = 7 and 11, 2x faster fwd + bwd on CPU; from 24×24 (k = 7) and 37×37
    (k = 11) the blocks are 1.5-3x faster."""
    P, (H, W), b = layout.num_prefix_tokens, layout.grid, BLOCK
    dense_logits = H * W * (P + H * W)
    blocked_logits = _blocks(H, b) * _blocks(W, b) * b * b * (P + (b + kernel - 1) ** 2)
    return dense_logits <= 2 * blocked_logits


def _blocks(n: int, b: int) -> int:
    """⌈n / b⌉ with non-negative operands only: ONNX writes a size's `//` as integer Div, which truncates."""
    return (n + b - 1) // b


def _neighbours(query: torch.Tensor, key: torch.Tensor, width: int, reach: int) -> torch.Tensor:
    """Whether patch `key` lies within `reach` rows and columns of patch `query` on a grid `width` patches wide
    (flat row-major indices, broadcast against each other); a negative key (a prefix token) is always allowed."""
    q_row = query.div(width, rounding_mode="floor")
    k_row = key.div(width, rounding_mode="floor")
    near = ((q_row - k_row).abs() <= reach) & ((query - q_row * width - (key - k_row * width)).abs() <= reach)
    return near | (key < 0)


def _dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, kernel: int, scale: float
) -> torch.Tensor:
    """`neighbourhood_attention` as one SDPA of the patch queries over all N keys, masked to the prefix and each
    query's neighbourhood: quadratic in the tokens, for small grids."""
    P, W = layout.num_prefix_tokens, layout.grid[1]
    key = torch.arange(k.shape[2], device=q.device) - P  # [N]: patch index of each key, < 0 for the prefix
    mask = _neighbours(key[P:, None], key[None], W, kernel // 2)  # [H·W, N]
    return scaled_dot_product_attention(q[:, :, P:], k, v, attn_mask=mask, scale=scale)


def _blocked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, kernel: int, scale: float
) -> torch.Tensor:
    """`neighbourhood_attention` as masked attention of BLOCK × BLOCK query blocks over their prefix + halo keys:
    one 4-D SDPA (the rank ONNX's attention takes), differentiable, linear in the tokens (each block reads
    (BLOCK + kernel − 1)² + P keys). Queries and keys are gathered by index (`_block_indices`), the output scattered
    back the same way: no view of a padded grid, whose strides would make a trace specialise on the block counts."""
    B, M, _, d = q.shape
    b = BLOCK
    queries, keys, mask, slots = _block_indices(layout, kernel, q.device)
    nb = mask.shape[0]
    zero = q.new_zeros(B, M, 1, d)  # token N: what padding queries and off-grid keys read

    def take(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:  # [B, M, N, d] -> [B, M·nb, index.shape[1], d]
        return torch.cat([x, zero], 2).index_select(2, index.flatten()).reshape(B, M * nb, index.shape[1], d)

    mask = mask.expand(M, -1, -1, -1).reshape(1, M * nb, b * b, mask.shape[-1])
    out = scaled_dot_product_attention(take(q, queries), take(k, keys), take(v, keys), attn_mask=mask, scale=scale)
    return out.reshape(B, M, nb * b * b, d).index_select(2, slots)  # [B, M, H·W, d]


def _block_indices(
    layout: TokenLayout, kernel: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For `_blocked_attention`, from aranges of the grid's sizes: the token index of each block's queries [nb, b²]
    and keys [nb, P + S²] (S = BLOCK + kernel − 1: the prefix, then the S × S halo starting kernel // 2 before the
    block; N for a padding query or an off-grid key), the mask [nb, b², P + S²] (a query reads the prefix and the
    halo keys within kernel // 2 rows and columns that lie on the grid; a padding query reads everything, so no
    softmax row is empty) and each patch's slot in the blocks' output [H·W]. Exported, one more block (all padding)
    keeps nb ≥ 2 at every grid: a trace at a one-block grid would otherwise specialise to one block."""
    P, (H, W), r, b = layout.num_prefix_tokens, layout.grid, kernel // 2, BLOCK
    S, N, Wb = b + 2 * r, P + H * W, _blocks(W, b)
    nb = _blocks(H, b) * Wb + int(torch.compiler.is_exporting())
    block = torch.arange(nb, device=device)
    block_row = block.div(Wb, rounding_mode="floor")
    block_col = block - block_row * Wb  # no `%` of a symbolic size: ONNX has no remainder by a traced scalar
    qy, qx = _offsets(b, device)  # [b²] each: a query's row and column in its block
    ky, kx = _offsets(S, device)  # [S²]: a key's in its halo
    y, x = block_row[:, None] * b + qy, block_col[:, None] * b + qx  # [nb, b²]
    inside = (y < H) & (x < W)
    queries = torch.where(inside, P + y * W + x, N)
    y, x = block_row[:, None] * b - r + ky, block_col[:, None] * b - r + kx  # [nb, S²]
    on_grid = (y >= 0) & (y < H) & (x >= 0) & (x < W)
    keys = torch.cat([torch.arange(P, device=device).expand(nb, P), torch.where(on_grid, P + y * W + x, N)], 1)
    reach = ((ky - r - qy[:, None]).abs() <= r) & ((kx - r - qx[:, None]).abs() <= r)  # [b², S²]
    mask = (reach & on_grid[:, None]) | ~inside[..., None]  # [nb, b², S²]
    mask = torch.cat([mask.new_ones(nb, b * b, P), mask], -1)
    patch = torch.arange(H * W, device=device)
    y = patch.div(W, rounding_mode="floor")
    x = patch - y * W
    slots = (y.div(b, rounding_mode="floor") * Wb + x.div(b, rounding_mode="floor")) * b * b + (y % b) * b + x % b
    return queries, keys, mask, slots


def _offsets(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each cell of an n × n square, row-major: two [n²] tensors."""
    cell = torch.arange(n * n, device=device)
    return cell.div(n, rounding_mode="floor"), cell % n


def flex_mask_mod(num_prefix: int, width: int, kernel: int) -> Callable[..., torch.Tensor]:
    """FlexAttention's mask_mod over (query, key) token indices: every query reads the prefix keys, and a patch query
    the patch keys within kernel // 2 rows and columns of its own."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        query, key = q_idx - num_prefix, kv_idx - num_prefix
        return (_neighbours(query, key, width, kernel // 2) & (query >= 0)) | (key < 0)

    return mask_mod


def flex_block_mask(layout: TokenLayout, kernel: int, device: torch.device) -> BlockMask:
    """The BlockMask of `flex_mask_mod` for all N = P + H·W tokens, from the grid's shape (no mask_mod evaluated over
    all query-key pairs, as `create_block_mask` would): a query block reads the key blocks that overlap the prefix or
    the grid rows within kernel // 2 of its patches' rows."""
    from torch.nn.attention.flex_attention import BlockMask

    P, (H, W), r, n = layout.num_prefix_tokens, layout.grid, kernel // 2, FLEX_BLOCK
    blocks = _blocks(P + H * W, n)
    start = torch.arange(blocks, device=device) * n  # first token of each block
    first = (start - P).clamp(min=0)  # [nb]: the patch queries [first, last] of each query block
    last = (start + n - P).clamp(max=H * W) - 1
    first_row = (first.div(W, rounding_mode="floor") - r).clamp(min=0)  # the key rows within their reach
    last_row = (last.div(W, rounding_mode="floor") + r).clamp(max=H - 1)
    lo = P + first_row * W  # their keys [lo, hi); none for a block of prefix queries only
    hi = torch.where(last >= first, P + (last_row + 1) * W, lo)
    allowed = ((start[None] < hi[:, None]) & (start[None] + n > lo[:, None])) | (start < P)[None]  # [nb, nb]
    num_blocks = allowed.sum(-1, dtype=torch.int32)
    order = torch.argsort((~allowed).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # allowed blocks first
    return BlockMask.from_kv_blocks(
        num_blocks[None, None], order[None, None], BLOCK_SIZE=n, mask_mod=flex_mask_mod(P, W, kernel),
        seq_lengths=(P + H * W, P + H * W),
    )  # fmt: skip


def flex_neighbourhood_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: TokenLayout, kernel: int, scale: float
) -> torch.Tensor:
    """`neighbourhood_attention` through FlexAttention with `flex_block_mask`: all N queries (the P prefix rows read
    the prefix keys only and are dropped: a sliced query would be a strided view, and a copy) over all N keys.
    Under torch.compile one fused kernel; in eager mode PyTorch runs its dense reference implementation (what the
    CPU tests compare with the float64 loop), so eager CUDA calls go through a compiled Flex (`_flex`)."""
    block_mask = flex_block_mask(layout, kernel, q.device)
    return _flex(q.device)(q, k, v, block_mask=block_mask, scale=scale)[:, :, layout.num_prefix_tokens :]


def _flex(device: torch.device) -> Callable[..., torch.Tensor]:
    """flex_attention as it is when traced (the caller's compile fuses it) or on the CPU (the eager reference);
    else torch.compile(flex_attention), compiled once per process, on its first eager CUDA call."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling() or device.type != "cuda":
        return flex_attention
    if "compiled" not in _FLEX:
        _FLEX["compiled"] = torch.compile(flex_attention, dynamic=True)
    return _FLEX["compiled"]


_FLEX: dict[str, Callable[..., torch.Tensor]] = {}  # eager CUDA only: never read in traced code
