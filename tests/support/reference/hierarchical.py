"""Independent float64 references for the hierarchical VCA layers (PVT reduction, Swin windows).

Shares no code with `vca_patch`: the VCA stages reuse the equation helpers of `tests.support.reference.vca`, the
bilinear upsampling, LayerNorm, window attention and (un)partitioning are written out here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.support.reference.vca import _depthwise3x3, _lam, _pool, _rms, _softmax, reference_vca


def _bilinear_1d(size: int, out: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """align_corners=False source indices (i0, i1) and weight of i1 for each output position."""
    src = torch.clamp((torch.arange(out, dtype=torch.float64) + 0.5) * size / out - 0.5, min=0)
    i0 = src.floor().long().clamp(max=size - 1)
    i1 = (i0 + 1).clamp(max=size - 1)
    return i0, i1, src - i0


def bilinear_upsample(grid: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """[B, h, w, C] -> [B, H, W, C], bilinear with half-pixel centres (PyTorch's align_corners=False)."""
    r0, r1, rw = _bilinear_1d(grid.shape[1], size[0])
    c0, c1, cw = _bilinear_1d(grid.shape[2], size[1])
    rows = grid[:, r0] * (1 - rw)[None, :, None, None] + grid[:, r1] * rw[None, :, None, None]
    return rows[:, :, c0] * (1 - cw)[None, None, :, None] + rows[:, :, c1] * cw[None, None, :, None]


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w + b


def contrast_stages(
    module, g: dict[str, torch.Tensor], qh: torch.Tensor, kh: torch.Tensor, vh: torch.Tensor,
    tp: torch.Tensor, tn: torch.Tensor, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Both VCA stages in float64 from queries qh [B, N, M, d], keys/values kh, vh [B, S, M, d] and contrast tokens
    tp, tn [B, n, M, d]: Stage I v̂ = (1−λ)·RMS(softmax(scale·t₊kᵀ)v − λ₁·softmax(scale·t₋kᵀ)v), Stage II the joint
    softmax(scale·τ·q·t±ᵀ) read of v̂, (1−λ)·RMS -> [B, N, M·d] (before the DWC and the projection)."""
    B, N, M, d = qh.shape
    n = tp.shape[1]
    li = 0.8 - 0.6 * math.exp(-0.3 * module.layer_index)
    lam1, lam2 = _lam(module.lambda1, li), _lam(module.lambda2, li)

    up = torch.einsum("bmij,bjmd->bmid", _softmax(scale * torch.einsum("bimd,bjmd->bmij", tp, kh)), vh)
    un = torch.einsum("bmij,bjmd->bmid", _softmax(scale * torch.einsum("bimd,bjmd->bmij", tn, kh)), vh)
    vhat = (1 - li) * _rms(up - lam1 * un, g["stage1_norm.weight"], module.stage1_norm.eps)

    tau = g["stage2_temperature"].view(1, M, 1, 1) if "stage2_temperature" in g else 1.0
    lp = scale * tau * torch.einsum("bimd,bjmd->bmij", qh, tp)
    ln_ = scale * tau * torch.einsum("bimd,bjmd->bmij", qh, tn)
    joint = _softmax(torch.cat([lp, ln_], dim=-1))
    o = torch.einsum("bmij,bmjd->bmid", joint[..., :n] - lam2 * joint[..., n:], vhat)
    return (1 - li) * _rms(o, g["stage2_norm.weight"], module.stage2_norm.eps).permute(0, 2, 1, 3).reshape(B, N, M * d)


def reference_reduction_vca(module, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """`SpatialReductionVCA` in float64: x [B, H·W, C] on `grid`, module holding q, kv, sr, norm, proj + VCA."""
    g = {k: v.detach().double() for k, v in module.state_dict().items()}
    x = x.double()
    B, N, C = x.shape
    M, d = module.num_heads, module.head_dim
    H, W = grid
    h, w = module.contrast_grid
    n = h * w

    q = x @ g["q.weight"].T + g["q.bias"]
    R = module.sr.stride[0]
    reduced = F.conv2d(x.transpose(1, 2).reshape(B, C, H, W), g["sr.weight"], g["sr.bias"], stride=R)
    rh, rw = reduced.shape[-2:]
    reduced = _layer_norm(reduced.flatten(2).transpose(1, 2), g["norm.weight"], g["norm.bias"], module.norm.eps)
    kv = reduced @ g["kv.weight"].T + g["kv.bias"]
    k, v = kv[..., :C], kv[..., C:]

    t = _pool(q.reshape(B, H, W, C), h, w)
    tp, tn = ((t + g[name]).reshape(B, n, M, d) for name in ("contrast_embed_pos", "contrast_embed_neg"))
    qh, kh, vh = q.reshape(B, N, M, d), k.reshape(B, -1, M, d), v.reshape(B, -1, M, d)
    o = contrast_stages(module, g, qh, kh, vh, tp, tn, d**-0.5)

    v_up = bilinear_upsample(v.reshape(B, rh, rw, C), (H, W))
    o = o + _depthwise3x3(v_up, g["dwc.weight"], g["dwc.bias"]).reshape(B, N, C)
    return o @ g["proj.weight"].T + g["proj.bias"]


def reference_window_attention(module, windows: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Swin W-MSA in float64 from the module's qkv, proj, bias table and index: [B·nW, N, C] -> [B·nW, N, C]."""
    g = {k: v.detach().double() for k, v in module.state_dict().items()}
    x = windows.double()
    B_, N, _ = x.shape
    M = module.num_heads
    d = g["qkv.weight"].shape[0] // 3 // M
    qkv = (x @ g["qkv.weight"].T + g["qkv.bias"]).reshape(B_, N, 3, M, d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    index = module.relative_position_index.reshape(-1)
    bias = g["relative_position_bias_table"][index].reshape(N, N, M).permute(2, 0, 1)  # [M, N, N]
    logits = torch.einsum("bimd,bjmd->bmij", q, k) * d**-0.5 + bias
    if mask is not None:
        nW = mask.shape[0]
        logits = (logits.reshape(B_ // nW, nW, M, N, N) + mask.double()[None, :, None]).reshape(B_, M, N, N)
    o = torch.einsum("bmij,bjmd->bimd", _softmax(logits), v).reshape(B_, N, M * d)
    return o @ g["proj.weight"].T + g["proj.bias"]


def partition(grid: torch.Tensor, window: tuple[int, int], shift: tuple[int, int]) -> torch.Tensor:
    """As a Swin block: roll by −shift, zero-pad to whole windows, split: [B, H, W, C] -> [B·nW, kh·kw, C]."""
    kh, kw = window
    x = torch.roll(grid, shifts=(-shift[0], -shift[1]), dims=(1, 2))
    B, H, W, C = x.shape
    Hp, Wp = -(-H // kh) * kh, -(-W // kw) * kw
    padded = x.new_zeros(B, Hp, Wp, C)
    padded[:, :H, :W] = x
    return padded.reshape(B, Hp // kh, kh, Wp // kw, kw, C).permute(0, 1, 3, 2, 4, 5).reshape(-1, kh * kw, C)


def reference_windowed_vca(module, grid: torch.Tensor, window, shift, mask) -> torch.Tensor:
    """`WindowedVCA` on the block grid [B, H, W, C], as windows [B·nW, kh·kw, C] (float64)."""
    B, H, W, C = grid.shape
    vca = reference_vca(module, grid.reshape(B, H * W, C), 0, (H, W)).reshape(B, H, W, -1)
    y = partition(vca, window, shift)
    if module.mode == "global":
        return y
    windows = partition(grid.double(), window, shift)
    return reference_window_attention(module, windows, mask) + y * module.residual_gate.detach().double()
