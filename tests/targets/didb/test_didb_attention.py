"""DIDBAttention against an independent float64 reference written from the equations (loops, no shared code)."""

from __future__ import annotations

import pytest
import timm
import torch
from torch import nn

from vca_patch import TokenLayout
from vca_patch.targets.didb import DIDBAttention

DIM, HEADS, P, GRID = 16, 2, 1, (3, 4)


def _layer(**kwargs) -> DIDBAttention:
    torch.manual_seed(0)
    qkv, proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
    layer = DIDBAttention(DIM, HEADS, qkv=qkv, proj=proj, **kwargs).double()
    with torch.no_grad():  # move every DIDB parameter off its init
        layer.qkv_clip.copy_(torch.tensor([0.9, 1.3, 0.6]))
        layer.proj_clip.fill_(1.1)
        if layer.band_weight is not None:
            layer.band_weight.copy_(torch.tensor([[0.8, 1.2], [0.5, 1.5]]))
        if layer.attn_threshold is not None:
            layer.attn_threshold.copy_(torch.tensor([1.7, 2.4]))
        if layer.local_weight is not None:
            layer.local_weight.copy_(torch.tensor([0.3, -0.6]))
    return layer


def _sign_weight(w):
    return w.abs().mean(1, keepdim=True) * torch.sign(w)


def _reference(layer: DIDBAttention, x: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """The module docstring's equations, token by token, in float64."""
    B, N, C = x.shape
    H, W = GRID
    d = C // HEADS
    c_full, c_low, c_high = (float(c) for c in layer.qkv_clip.detach())
    Wqkv, bqkv = _sign_weight(layer.qkv.weight.detach()), layer.qkv.bias.detach()
    Wp, bp = _sign_weight(layer.proj.weight.detach()), layer.proj.bias.detach()

    low, high = x.clone(), torch.zeros_like(x)
    for r in range(H):
        for c in range(W):
            cells = [(r, c), ((r + 1) % H, c), (r, (c + 1) % W), ((r + 1) % H, (c + 1) % W)]
            ll = sum(x[:, P + rr * W + cc] for rr, cc in cells) / 4
            low[:, P + r * W + c], high[:, P + r * W + c] = ll, x[:, P + r * W + c] - ll

    def project(inp, clip, rows):
        return (clip * torch.sign(inp)) @ Wqkv[rows].T + bqkv[rows]

    q_rows, k_rows, v_rows = slice(0, C), slice(C, 2 * C), slice(2 * C, 3 * C)
    ql, kl = project(low, c_low, q_rows), project(low, c_low, k_rows)
    qh, kh = project(high, c_high, q_rows), project(high, c_high, k_rows)
    v = project(x, c_full, v_rows)

    out = torch.zeros(B, N, C, dtype=x.dtype)
    sizes = set()
    for b in range(B):
        for m in range(HEADS):
            cols = slice(m * d, (m + 1) * d)
            a_low, a_high = (float(t) for t in layer.band_weight.detach()[:, m])
            scores = (a_low * ql[b, :, cols] @ kl[b, :, cols].T + a_high * qh[b, :, cols] @ kh[b, :, cols].T) / d**0.5
            probs = torch.softmax(scores, dim=-1)
            tau = float(layer.attn_threshold.detach()[m])
            gamma = float(layer.local_weight.detach()[m])
            for i in range(N):
                chosen = [j for j in range(N) if N * probs[i, j] / tau >= 0.5]
                k = len(chosen)
                sizes.add(k)
                vi = v[b, i, cols]
                u = (1 - k) * vi + sum((v[b, j, cols] for j in chosen), torch.zeros(d, dtype=x.dtype))
                if i >= P:
                    r, c = divmod(i - P, W)
                    for dr in (-1, 0, 1):
                        for dc in (-1, 0, 1):
                            if (dr or dc) and 0 <= r + dr < H and 0 <= c + dc < W:
                                u = u + gamma * (v[b, P + (r + dr) * W + c + dc, cols] - vi)
                out[b, i, cols] = u / max(k, 1) if normalize else u
    assert len(sizes) > 2 and max(sizes) < N, sizes  # the binary selection is not trivial
    return (float(layer.proj_clip.detach()) * torch.sign(out)) @ Wp.T + bp


@pytest.mark.parametrize("normalize", [True, False])
def test_didb_attention_matches_float64_reference(normalize):
    layer = _layer(normalize=normalize)
    x = torch.randn(2, P + GRID[0] * GRID[1], DIM, dtype=torch.float64)
    out = layer(x, layout=TokenLayout(P, GRID))
    torch.testing.assert_close(out, _reference(layer, x, normalize), atol=1e-10, rtol=1e-10)


def test_normalize_changes_only_the_magnitude_seen_by_the_binary_proj():
    """sign(u / max(k, 1)) = sign(u): with a binarised proj input both forms give the same output."""
    x = torch.randn(2, P + GRID[0] * GRID[1], DIM, dtype=torch.float64)
    layout = TokenLayout(P, GRID)
    assert torch.equal(_layer(normalize=True)(x, layout=layout), _layer(normalize=False)(x, layout=layout))


def test_attention_update_gets_gradients_through_the_ste():
    layer = _layer()
    x = torch.randn(2, P + GRID[0] * GRID[1], DIM, dtype=torch.float64, requires_grad=True)
    layer(x, layout=TokenLayout(P, GRID)).pow(2).sum().backward()
    for name in ("qkv_clip", "proj_clip", "band_weight", "attn_threshold", "local_weight"):
        grad = getattr(layer, name).grad
        assert grad is not None and grad.isfinite().all() and grad.abs().sum() > 0, name
    assert x.grad.isfinite().all() and x.grad.abs().sum() > 0


def test_with_everything_real_it_is_the_original_softmax_attention():
    torch.manual_seed(0)
    original = timm.layers.Attention(DIM, HEADS, qkv_bias=True).eval()
    layer = DIDBAttention(
        DIM, HEADS, qkv=original.qkv, proj=original.proj, binary=(), binarize_attention=False, hfsc=False, local=False
    )
    x = torch.randn(2, P + 12, DIM)
    torch.testing.assert_close(layer(x, layout=TokenLayout(P, GRID)), original(x), atol=2e-6, rtol=1e-5)


def test_layout_is_required_and_checked():
    layer = _layer()
    with pytest.raises(ValueError, match="needs the token layout"):
        layer(torch.randn(1, 13, DIM, dtype=torch.float64))
    with pytest.raises(ValueError, match="sequence has 13 tokens"):
        layer(torch.randn(1, 13, DIM, dtype=torch.float64), layout=TokenLayout(1, (4, 4)))
