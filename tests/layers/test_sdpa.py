"""The layers' SDPA: plain SDPA outside CPU autocast; under it, float32 attention returned in autocast's dtype, checked
against a float64 reference (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vca_patch.layers.sdpa import scaled_dot_product_attention


def _inputs(seed: int = 0, L: int = 37, S: int = 53) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, L, 16, generator=g) * 1.5
    k = torch.randn(2, 3, S, 16, generator=g) * 1.5
    v = torch.randn(2, 3, S, 16, generator=g)
    return tuple(t.requires_grad_() for t in (q, k, v))


def _reference(q, k, v, mask=None, scale=None):  # float64 softmax(s·q·kᵀ + mask)·v
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    logits = (q @ k.transpose(-1, -2)) * (scale if scale is not None else q.shape[-1] ** -0.5)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else logits + mask.double()
    out = logits.softmax(-1) @ v
    return out, (q, k, v)


def test_outside_cpu_autocast_it_is_plain_sdpa():
    q, k, v = _inputs()
    plain = F.scaled_dot_product_attention(q, k, v, scale=0.3)
    assert torch.equal(scaled_dot_product_attention(q, k, v, scale=0.3), plain)


@pytest.mark.parametrize("mask_kind", [None, "bool", "float"])
def test_under_cpu_autocast_it_runs_in_float32_and_returns_bf16(mask_kind):
    q, k, v = _inputs()
    g = torch.Generator().manual_seed(1)
    mask = None
    if mask_kind == "bool":
        mask = torch.rand(37, 53, generator=g) < 0.7
        mask[:, 0] = True  # every query reads one key at least
    elif mask_kind == "float":
        mask = torch.randn(37, 53, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
        plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.dtype == plain.dtype == torch.bfloat16
    reference, leaves = _reference(q, k, v, mask)
    error = (out.double() - reference).abs().max().item()
    # float32 attention rounded once to bf16: within one bf16 unit round-off (2^-8) of the output's size; measured
    # 0.52-0.58 of it. A 10% error in the output exceeds this bound by far.
    bound = 2**-8 * reference.abs().max().item()
    assert error <= bound
    assert ((out.double() * 1.1 - reference).abs().max().item()) > bound
    # ...and no less precise than PyTorch's own bf16 SDPA under autocast
    assert error <= (plain.double() - reference).abs().max().item() + 1e-12

    grad = torch.randn(reference.shape, generator=g, dtype=torch.float64)
    out.backward(grad.to(out.dtype))
    reference.backward(grad)
    for mine, ref in zip((q, k, v), leaves, strict=True):
        assert mine.grad.dtype == torch.float32
        relative = ((mine.grad.double() - ref.grad).norm() / ref.grad.norm()).item()
        assert relative < 6e-3, relative  # the output's gradient arrives rounded to bf16: measured 1.7e-3
