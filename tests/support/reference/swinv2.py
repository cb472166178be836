"""Independent float64 references for SwinV2: cosine window attention with the continuous position bias (CPB) and
the cosine form of VCA the Swin conversion uses (pooled normalised queries, renormalised, scaled by L per head).

Shares no code with `vca_patch`: the CPB MLP, the pair index and cosine scores are written out here, both VCA
stages come from `tests.support.reference.hierarchical` (with a scale of 1: cosine logits).
"""

from __future__ import annotations

import math

import torch

from tests.support.reference.hierarchical import contrast_stages
from tests.support.reference.vca import _depthwise3x3, _pool, _softmax


def qkv_weights(g: dict[str, torch.Tensor], C: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused (W [3C, C], b [3C]) from a state dict: timm's `qkv` + `q_bias`/`v_bias` or HF's `query`/`key`/`value`."""
    if "qkv.weight" in g:
        zero = torch.zeros(C, dtype=torch.float64)
        return g["qkv.weight"], torch.cat([g.get("q_bias", zero), zero, g.get("v_bias", zero)])
    bias = [g.get(f"{name}.bias", torch.zeros(C, dtype=torch.float64)) for name in ("query", "key", "value")]
    return torch.cat([g[f"{name}.weight"] for name in ("query", "key", "value")]), torch.cat(bias)


def _mlp(g: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    """Linear(2, 512) -> ReLU -> Linear(512, M, no bias)."""
    hidden = torch.clamp(x @ g[f"{prefix}.0.weight"].T + g[f"{prefix}.0.bias"], min=0)
    return hidden @ g[f"{prefix}.2.weight"].T


def cpb_bias(g: dict[str, torch.Tensor], prefix: str, window: tuple[int, int]) -> torch.Tensor:
    """16·σ(CPB) [M, N, N] for a (kh, kw) window (pretrained window = window), coordinates built here."""
    kh, kw = window
    dh = torch.arange(-(kh - 1), kh, dtype=torch.float64) / max(kh - 1, 1) * 8
    dw = torch.arange(-(kw - 1), kw, dtype=torch.float64) / max(kw - 1, 1) * 8
    coords = torch.stack(torch.meshgrid(dh, dw, indexing="ij"), dim=-1)  # [2kh-1, 2kw-1, 2]
    coords = torch.sign(coords) * torch.log2(coords.abs() + 1) / math.log2(8)
    table = _mlp(g, prefix, coords.reshape(-1, 2))  # [(2kh-1)(2kw-1), M]
    rows = [(i, j) for i in range(kh) for j in range(kw)]
    index = torch.tensor([[(a - c + kh - 1) * (2 * kw - 1) + (b - d + kw - 1) for c, d in rows] for a, b in rows])
    return 16 * torch.sigmoid(table[index]).permute(2, 0, 1)  # [M, N, N]


def reference_cosine_window_attention(
    module, windows: torch.Tensor, mask: torch.Tensor | None, window: tuple[int, int], mlp: str = "cpb_mlp"
) -> torch.Tensor:
    """SwinV2 W-MSA in float64: softmax(L·q̂·k̂ᵀ + 16σ(CPB) + mask)·v, then `proj` when the module has one."""
    g = {k: v.detach().double() for k, v in module.state_dict().items()}
    x = windows.double()
    B_, N, C = x.shape
    M = g["logit_scale"].shape[0]
    d = C // M
    w, b = qkv_weights(g, C)
    qkv = (x @ w.T + b).reshape(B_, N, 3, M, d)
    q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    q, k = (t / t.norm(dim=-1, keepdim=True).clamp_min(1e-12) for t in (q, k))  # padded rows are zero
    scale = torch.clamp(g["logit_scale"].reshape(M), max=math.log(100)).exp()
    logits = torch.einsum("bimd,bjmd->bmij", q, k) * scale[None, :, None, None] + cpb_bias(g, mlp, window)
    if mask is not None:
        nW = mask.shape[0]
        logits = (logits.reshape(B_ // nW, nW, M, N, N) + mask.double()[None, :, None]).reshape(B_, M, N, N)
    o = torch.einsum("bmij,bjmd->bimd", _softmax(logits), v).reshape(B_, N, C)
    return o @ g["proj.weight"].T + g["proj.bias"] if "proj.weight" in g else o


def reference_cosine_vca(module, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """The cosine VCA branch of a SwinV2 `WindowedVCA` on x [B, H·W, C] (float64, no prefix tokens).

    q̂, k̂ unit per head; t̃ = L·normalize(avgpool(q̂)); Stage I softmax(t±·k̂ᵀ), Stage II softmax(τ·q̂·t±ᵀ).
    """
    g = {k: v.detach().double() for k, v in module.state_dict().items()}
    x = x.double()
    B, N, C = x.shape
    M, d = module.num_heads, module.head_dim
    H, W = grid
    h, w = module.contrast_grid
    n = h * w
    weight, bias = qkv_weights(g, C)
    qkv = x @ weight.T + bias
    q, k, v = qkv[..., :C], qkv[..., C : 2 * C], qkv[..., 2 * C :]
    qh = q.reshape(B, N, M, d)
    qh = qh / qh.norm(dim=-1, keepdim=True)
    kh = k.reshape(B, N, M, d)
    kh = kh / kh.norm(dim=-1, keepdim=True)
    vh = v.reshape(B, N, M, d)
    L = torch.clamp(g["logit_scale"].reshape(M), max=math.log(100)).exp()
    t = _pool(qh.reshape(B, H, W, C), h, w).reshape(B, n, M, d)
    t = t / t.norm(dim=-1, keepdim=True) * L[None, None, :, None]
    tp = t + g["contrast_embed_pos"].reshape(1, n, M, d)
    tn = t + g["contrast_embed_neg"].reshape(1, n, M, d)
    o = contrast_stages(module, g, qh, kh, vh, tp, tn, 1.0)  # cosine logits: no d^-1/2 (L and τ scale them)
    o = o + _depthwise3x3(v.reshape(B, H, W, C), g["dwc.weight"], g["dwc.bias"]).reshape(B, N, C)
    return o @ g["proj.weight"].T + g["proj.bias"] if "proj.weight" in g else o
