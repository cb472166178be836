"""Independent float64 reference of VCA, written from the equations with einsum and explicit softmax.

Shares no code with `vca_patch`: pooling, RMSNorm, the λ formula, both Stage-II readings and the
depthwise conv are spelled out here.
"""

from __future__ import annotations

import math

import torch


def _softmax(x: torch.Tensor) -> torch.Tensor:
    x = x - x.max(dim=-1, keepdim=True).values
    e = x.exp()
    return e / e.sum(dim=-1, keepdim=True)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def _adaptive_pool_1d_bounds(size: int, out: int) -> list[tuple[int, int]]:
    return [(math.floor(i * size / out), math.ceil((i + 1) * size / out)) for i in range(out)]


def _pool(grid: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """grid [B, H, W, C] -> [B, h*w, C], PyTorch's adaptive-average-pool windows."""
    rows = []
    for r0, r1 in _adaptive_pool_1d_bounds(grid.shape[1], h):
        for c0, c1 in _adaptive_pool_1d_bounds(grid.shape[2], w):
            rows.append(grid[:, r0:r1, c0:c1].mean(dim=(1, 2)))
    return torch.stack(rows, dim=1)


def _depthwise3x3(grid: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """grid [B, H, W, C], weight [C, 1, 3, 3] -> [B, H, W, C], zero padding 1."""
    B, H, W, C = grid.shape
    padded = torch.zeros(B, H + 2, W + 2, C, dtype=grid.dtype)
    padded[:, 1:-1, 1:-1] = grid
    out = torch.zeros_like(grid) + bias
    for i in range(3):
        for j in range(3):
            out = out + padded[:, i : i + H, j : j + W] * weight[:, 0, i, j]
    return out


def _lam(lam_module, lambda_init: float) -> torch.Tensor:
    q1, k1, q2, k2 = (p.detach().double() for p in (lam_module.q1, lam_module.k1, lam_module.q2, lam_module.k2))
    offset = lam_module.offset.double()  # δ: the zero-λ init's float32 rounding residue, fixed
    return torch.exp((q1 * k1).sum()) - torch.exp((q2 * k2).sum()) + lambda_init + offset


def reference_vca(module, x: torch.Tensor, num_prefix: int, grid: tuple[int, int]) -> torch.Tensor:
    """VCA forward of `module`'s parameters on x [B, N, C], all in float64 (no q/k norm, no gate).

    Follows the module's softmax ("joint"/"separate"), prefix_readout ("contrast"/"exact") and Stage-II
    temperature τ (logits s·τ·q·tᵀ, one τ per head).
    """
    g = {k: v.detach().double() for k, v in module.state_dict().items()}
    x = x.double()
    B, N, _ = x.shape
    M, d = module.num_heads, module.head_dim
    C = M * d
    H, W = grid
    h, w = module.contrast_grid
    n = h * w
    li = 1 - 0.6 * math.exp(-0.3 * module.layer_index) - 0.2  # = 0.8 − 0.6·e^(−0.3 l)
    s = d**-0.5

    qkv = torch.einsum("bnc,oc->bno", x, g["qkv.weight"]) + g.get("qkv.bias", 0)
    q, k, v = qkv[..., :C], qkv[..., C : 2 * C], qkv[..., 2 * C :]

    t = _pool(q[:, num_prefix:].reshape(B, H, W, C), h, w)  # [B, n, C]
    tp = (t + g["contrast_embed_pos"]).reshape(B, n, M, d)
    tn = (t + g["contrast_embed_neg"]).reshape(B, n, M, d)
    qh, kh, vh = (z.reshape(B, N, M, d) for z in (q, k, v))

    lam1 = _lam(module.lambda1, li)
    lam2 = _lam(module.lambda2, li)

    ap = _softmax(s * torch.einsum("bimd,bjmd->bmij", tp, kh))  # [B, M, n, N]
    an = _softmax(s * torch.einsum("bimd,bjmd->bmij", tn, kh))
    up = torch.einsum("bmij,bjmd->bmid", ap, vh)
    un = torch.einsum("bmij,bjmd->bmid", an, vh)
    vhat = (1 - li) * _rms(up - lam1 * un, g["stage1_norm.weight"], module.stage1_norm.eps)  # [B, M, n, d]

    tau = g["stage2_temperature"].view(1, M, 1, 1) if "stage2_temperature" in g else 1.0  # per head
    lp = s * tau * torch.einsum("bimd,bjmd->bmij", qh, tp)  # [B, M, N, n]
    ln_ = s * tau * torch.einsum("bimd,bjmd->bmij", qh, tn)
    if module.softmax == "joint":
        joint = _softmax(torch.cat([lp, ln_], dim=-1))
        a_pos, a_neg = joint[..., :n], joint[..., n:]
    else:
        a_pos, a_neg = _softmax(lp), _softmax(ln_)
    o = torch.einsum("bmij,bmjd->bmid", a_pos - lam2 * a_neg, vhat)
    o = (1 - li) * _rms(o, g["stage2_norm.weight"], module.stage2_norm.eps)  # [B, M, N, d]
    o = o.permute(0, 2, 1, 3).reshape(B, N, C)
    if module.prefix_readout == "exact":  # prefix rows: plain softmax attention over all N tokens, nothing else
        attn = _softmax(s * torch.einsum("bimd,bjmd->bmij", qh[:, :num_prefix], kh))  # [B, M, P, N]
        o[:, :num_prefix] = torch.einsum("bmij,bjmd->bimd", attn, vh).reshape(B, num_prefix, C)

    local = _depthwise3x3(v[:, num_prefix:].reshape(B, H, W, C), g["dwc.weight"], g["dwc.bias"])
    o[:, num_prefix:] += local.reshape(B, H * W, C)
    return torch.einsum("bnc,oc->bno", o, g["proj.weight"]) + g.get("proj.bias", 0)
