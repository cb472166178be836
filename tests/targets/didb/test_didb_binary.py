"""DIDB building blocks: BinaryLinear (forward, STE gradients), the undecimated Haar split, the improved RPReLU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from vca_patch.targets.didb import BinaryLinear, ImprovedRPReLU, haar_split, haar_subbands


def _linear(seed: int = 0, in_features: int = 13, out_features: int = 7) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(in_features, out_features)
    with torch.no_grad():
        linear.weight.mul_(8.0)  # some |W| > 1: the clipped STE must zero their gradient
    return linear


def _reference_forward(x, weight, bias, clip, weights=True, activations=True):
    """float64: (c·sign x) (α ⊙ sign W)ᵀ + b, α = mean |W| per row."""
    x, weight, bias = x.double(), weight.double(), bias.double()
    xb = float(clip) * torch.sign(x) if activations else x
    wb = weight.abs().mean(1, keepdim=True) * torch.sign(weight) if weights else weight
    return xb @ wb.T + bias


@pytest.mark.parametrize(("weights", "activations"), [(True, True), (False, True), (True, False)])
def test_binary_linear_forward_matches_float64_reference(weights, activations):
    linear = _linear()
    layer = BinaryLinear.from_linear(
        linear, binarize_weights=weights, binarize_activations=activations, act_clip_init=0.7
    )
    assert layer.weight is linear.weight and layer.bias is linear.bias  # shared, not copied
    x = torch.randn(5, 3, 13)
    expected = _reference_forward(x, linear.weight, linear.bias, 0.7, weights, activations)
    out = layer(x)
    assert out.shape == (5, 3, 7)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out, linear(x), atol=1e-2)  # binarisation really changes the output


def test_binary_linear_ste_gradients_match_the_analytic_formulas():
    linear = _linear(1).double()
    layer = BinaryLinear.from_linear(linear, act_clip_init=1.0)
    x = (torch.randn(6, 13, dtype=torch.float64) * 1.5).requires_grad_()  # some |x| > c
    g = torch.randn(6, 7, dtype=torch.float64)
    (layer(x) * g).sum().backward()

    W, c = linear.weight.detach(), 1.0
    alpha = W.abs().mean(1, keepdim=True)
    wb, xb = alpha * torch.sign(W), c * torch.sign(x.detach())
    grad_xb = g @ wb
    grad_wb = g.T @ xb
    expected_x = grad_xb * (x.detach().abs() <= c)
    expected_c = (grad_xb * torch.sign(x.detach())).sum()
    expected_w = grad_wb * alpha * (W.abs() <= 1) + torch.sign(W) * (grad_wb * torch.sign(W)).mean(1, keepdim=True)
    torch.testing.assert_close(x.grad, expected_x, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(layer.act_clip.grad, expected_c, atol=1e-10, rtol=1e-12)
    torch.testing.assert_close(linear.weight.grad, expected_w, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(linear.bias.grad, g.sum(0), atol=1e-12, rtol=1e-12)
    assert (x.grad == 0).any() and (x.grad != 0).any()  # the clip window is exercised on both sides
    assert ((W.abs() > 1) & (linear.weight.grad != 0)).any()  # α's exact gradient reaches clipped entries


def test_binary_linear_refuses_non_linear():
    with pytest.raises(TypeError, match=r"plain nn\.Linear"):
        BinaryLinear.from_linear(nn.Conv2d(3, 3, 1))


@pytest.mark.parametrize("grid", [(4, 4), (3, 5)])
def test_haar_split_reconstructs_and_keeps_energy(grid):
    H, W = grid
    x = torch.randn(2, 2 + H * W, 6, dtype=torch.float64)
    low, high = haar_split(x, 2, grid)
    torch.testing.assert_close(low + high, x, atol=1e-12, rtol=0)
    assert torch.equal(low[:, :2], x[:, :2]) and torch.equal(high[:, :2], torch.zeros_like(x[:, :2]))
    bands = haar_subbands(x[:, 2:].reshape(2, H, W, 6))
    energy = sum(float(b.pow(2).sum()) for b in bands)
    assert energy == pytest.approx(float(x[:, 2:].pow(2).sum()), rel=1e-12)
    # LL is the mean of each circular 2×2 window
    g = x[:, 2:].reshape(2, H, W, 6)
    r, c = H - 1, W - 1
    mean = (g[:, r, c] + g[:, 0, c] + g[:, r, 0] + g[:, 0, 0]) / 4
    torch.testing.assert_close(low[:, 2 + r * W + c], mean, atol=1e-12, rtol=0)
    assert float(high[:, 2:].abs().max()) > 0.1


def test_haar_high_band_vanishes_on_a_constant_grid():
    x = torch.ones(1, 1 + 9, 4) * 3.0
    low, high = haar_split(x, 1, (3, 3))
    assert torch.equal(low, x) and torch.equal(high, torch.zeros_like(x))


def test_improved_rprelu_matches_its_formula():
    torch.manual_seed(0)
    act = ImprovedRPReLU(8, dtype=torch.float64)
    with torch.no_grad():
        for p in (act.shift, act.bias, act.token_mix):
            p.copy_(torch.randn(8, dtype=torch.float64) * 0.3)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    z = x - act.shift - act.token_mix * x.mean(-1, keepdim=True)
    expected = torch.where(z >= 0, z, 0.25 * z) + act.bias
    torch.testing.assert_close(act(x), expected, atol=1e-14, rtol=0)
    fresh = ImprovedRPReLU(8)
    torch.testing.assert_close(fresh(x.float()), nn.functional.prelu(x.float(), torch.full((1,), 0.25)))
