from fractions import Fraction

import pytest
import torch
from timm.layers import Attention
from torch import nn

from tests.support.reference.mano import reference_mano
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.mano.layer import MultipoleAttention
from vca_patch.targets.mano.levels import auto_num_levels, plan_levels, vcycle_coefficients, vcycle_weights


def _randomised(module: MultipoleAttention) -> MultipoleAttention:
    """Every parameter random and non-zero (up/down too), so every level matters."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
        if module.up_gain is not None:
            module.up_gain.uniform_(0.5, 1.5)
    return module


# (grid, window, rate): divisible grids, grids needing window padding and ceil coarsening, H ≠ W.
CASES = [((8, 8), 2, 2), ((6, 9), 3, 3), ((5, 7), 2, 2), ((7, 3), 3, 2)]
VARIANTS = [("conv", "conv"), ("avg", "nearest"), ("conv", "nearest"), ("avg", "conv")]


@pytest.mark.parametrize("down,up", VARIANTS)
@pytest.mark.parametrize("num_prefix", [0, 1, 2])
@pytest.mark.parametrize("grid,window,rate", CASES)
def test_matches_float64_reference(grid, window, rate, num_prefix, down, up):
    module = _randomised(MultipoleAttention(24, 3, window=window, rate=rate, down=down, up=up)).double()
    assert len(module.plan(grid)) >= 2
    x = torch.randn(2, num_prefix + grid[0] * grid[1], 24, dtype=torch.float64)
    expected = reference_mano(module, x, num_prefix, grid)
    got = module(x, layout=TokenLayout(num_prefix, grid))
    assert (got - expected).norm() / expected.norm() < 1e-10


@pytest.mark.parametrize("levels", [1, 2, 3])
def test_explicit_levels_and_separate_prefix_match_reference(levels):
    module = _randomised(MultipoleAttention(16, 2, window=2, rate=2, levels=levels, prefix="separate")).double()
    x = torch.randn(1, 1 + 6 * 5, 16, dtype=torch.float64)
    expected = reference_mano(module, x, 1, (6, 5))
    assert (module(x, layout=TokenLayout(1, (6, 5))) - expected).norm() / expected.norm() < 1e-10


def test_float32_within_1e5_of_reference():
    module = _randomised(MultipoleAttention(32, 4, window=3, rate=2))
    x = torch.randn(2, 1 + 10 * 7, 32)
    expected = reference_mano(module, x, 1, (10, 7))
    got = module(x, layout=TokenLayout(1, (10, 7))).double()
    assert (got - expected).norm() / expected.norm() < 1e-5


@pytest.mark.parametrize("down,up", VARIANTS)
@pytest.mark.parametrize("grid", [(8, 8), (5, 7)])
def test_preserve_init_is_exactly_level0_windowed_attention(grid, down, up):
    """Zero up-path: the output equals plain windowed attention (+ prefix keys) on the finest grid."""
    module = MultipoleAttention(24, 3, window=2, rate=2, down=down, up=up).double()
    with torch.no_grad():
        module.qkv.weight.normal_(0, 0.3)
    x = torch.randn(2, 1 + grid[0] * grid[1], 24, dtype=torch.float64)
    windowed = reference_mano(module, x, 1, grid, levels_override=1)
    got = module(x, layout=TokenLayout(1, grid))
    assert len(module.plan(grid)) >= 3
    assert (got - windowed).norm() / windowed.norm() < 1e-12


def _timm_attention() -> Attention:
    attn = Attention(32, 4, qkv_bias=True, qk_norm=True, scale_norm=True, gated=True, norm_layer=nn.LayerNorm)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0.0, 0.3)
    return attn.eval()


def _carried(a: Attention) -> CarriedAttention:
    return CarriedAttention(a.qkv, a.proj, a.num_heads, a.head_dim, a.q_norm, a.k_norm, a.norm, a.gate, a.proj_drop)


@pytest.mark.parametrize("num_prefix", [0, 1, 2])
@pytest.mark.parametrize("grid,window", [((5, 7), 7), ((4, 4), 9)])
def test_window_covering_grid_equals_original_attention(grid, window, num_prefix):
    """One level, one window: exactly softmax attention (qk-norm, scale-norm and gate carried along)."""
    attn = _timm_attention()
    for init in ("preserve", "multipole", "random"):
        module = MultipoleAttention.from_carried(_carried(attn), window=window, up="nearest")
        module.reset_mano_parameters(init)
        x = torch.randn(2, num_prefix + grid[0] * grid[1], 32)
        assert len(module.plan(grid)) == 1
        torch.testing.assert_close(module(x, layout=TokenLayout(num_prefix, grid)), attn(x), atol=1e-5, rtol=1e-5)


def test_prefix_outputs_are_exact_and_grid_sees_prefix_only_when_global():
    attn = _timm_attention()
    x = torch.randn(2, 2 + 36, 32)
    layout = TokenLayout(2, (6, 6))
    glob = MultipoleAttention.from_carried(_carried(attn), window=2, prefix="global")
    sep = MultipoleAttention.from_carried(_carried(attn), window=2, prefix="separate")
    torch.testing.assert_close(glob(x, layout=layout)[:, :2], attn(x)[:, :2], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(glob(x, layout=layout)[:, 2:], sep(x, layout=layout)[:, 2:], atol=1e-3)


def test_levels_plan():
    # docs/mano.md §5.6 table, integer arithmetic (§3.2: log(243)/log(3) is not a problem).
    assert [auto_num_levels((s, s), 7, 2) for s in (56, 28, 14, 7)] == [4, 3, 2, 1]
    assert auto_num_levels((24, 24), 6, 2) == 3 and auto_num_levels((243, 243), 3, 3) == 5
    plan = plan_levels((14, 10), 4, 2)
    assert [lvl.grid for lvl in plan] == [(14, 10), (7, 5), (4, 3)]
    assert [lvl.window for lvl in plan] == [(4, 4), (4, 4), (4, 3)]
    assert [lvl.padded for lvl in plan] == [(16, 12), (8, 8), (4, 3)]
    assert vcycle_weights(4) == [1 / 3, 1 / 2, 1.0]
    expected = {3: (1, Fraction(1, 2), Fraction(1, 2)), 4: (1, Fraction(1, 3), Fraction(1, 6), Fraction(1, 6))}
    for levels, coeffs in expected.items():
        assert vcycle_coefficients(levels) == pytest.approx([float(c) for c in coeffs])
    assert vcycle_coefficients(6)[-2:] == pytest.approx([1 / 120, 1 / 120])


def test_configurations_that_cannot_work_are_clear_errors():
    with pytest.raises(ValueError, match="rate must be an integer ≥ 2"):
        MultipoleAttention(16, 2, rate=1)
    with pytest.raises(ValueError, match="window must be a positive"):
        MultipoleAttention(16, 2, window=0)
    with pytest.raises(ValueError, match="past 1x1"):
        plan_levels((4, 4), 2, 2, levels=4)
    with pytest.raises(ValueError, match="not divisible by window 4"):
        plan_levels((14, 14), 4, 2, pad=False)
    with pytest.raises(ValueError, match="not divisible by rate 2"):
        plan_levels((14, 14), 7, 2, levels=3, pad=False)
    assert [lvl.grid for lvl in plan_levels((16, 8), 4, 2, pad=False)] == [(16, 8), (8, 4), (4, 2)]
    module = MultipoleAttention(16, 2, window=2)
    with pytest.raises(ValueError, match="needs the token layout"):
        module(torch.randn(1, 17, 16))
    with pytest.raises(ValueError, match="masks"):
        module(torch.randn(1, 17, 16), is_causal=True, layout=TokenLayout(1, (4, 4)))
    with pytest.raises(ValueError, match="init mode"):
        module.reset_mano_parameters("paper")


def test_new_parameter_count():
    # docs/mano.md §8.5: 2·C²·r² with conv/conv; the nearest gain adds C; avg/nearest adds nothing else.
    def added(**kwargs):
        module = MultipoleAttention(48, 3, **kwargs)
        return sum(p.numel() for n, p in module.named_parameters() if not n.startswith(("qkv", "proj")))

    assert added(rate=2) == 2 * 48 * 48 * 4
    assert added(rate=3, down="avg", up="conv") == 48 * 48 * 9
    assert added(down="avg", up="nearest") == 48


@pytest.mark.parametrize("up", ["conv", "nearest"])
def test_preserve_init_up_path_gets_gradient(up):
    module = MultipoleAttention(16, 2, window=2, up=up)
    module(torch.randn(2, 1 + 36, 16), layout=TokenLayout(1, (6, 6))).square().sum().backward()
    trainable = module.up.weight if up == "conv" else module.up_gain
    assert trainable.grad.abs().sum() > 0


def test_multipole_init_every_parameter_gets_gradient():
    module = MultipoleAttention(16, 2, window=2)
    module.reset_mano_parameters("multipole")
    module(torch.randn(2, 1 + 36, 16), layout=TokenLayout(1, (6, 6))).square().sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_bf16_autocast_is_finite_and_close():
    module = _randomised(MultipoleAttention(32, 4, window=3))
    x = torch.randn(2, 1 + 7 * 9, 32)
    layout = TokenLayout(1, (7, 9))
    ref = module.double()(x.double(), layout=layout).detach()  # float64 reference
    module.float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x, layout=layout)
    assert torch.isfinite(out).all()
    assert (out.double() - ref).norm() / ref.norm() < 6 * 2.0**-8  # measured: 2.4 bf16 unit round-offs


@pytest.mark.parametrize("up", ["conv", "nearest"])
def test_zero_up_path_skips_the_coarse_levels_exactly_and_runs_them_once_trained(up, monkeypatch):
    """Preserve init (U = 0 / γ = 0): inference skips the coarse levels; the output is still the float64 reference's.
    A gradient for U, or a U that is no longer zero, brings them back."""
    module = MultipoleAttention(24, 3, window=2, rate=2, up=up).double()
    with torch.no_grad():
        module.down.weight.normal_(0.0, 0.3) if module.down is not None else None
    layout, x = TokenLayout(1, (8, 8)), torch.randn(2, 1 + 64, 24, dtype=torch.float64)
    calls = []
    full = MultipoleAttention.coarse_correction
    monkeypatch.setattr(MultipoleAttention, "coarse_correction", lambda self, *a: calls.append(1) or full(self, *a))
    expected = reference_mano(module, x, 1, (8, 8))
    with torch.no_grad():
        got = module(x, layout=layout)
    assert calls == [] and (got - expected).norm() / expected.norm() < 1e-12

    module(x, layout=layout).sum().backward()  # U trainable under autograd: the coarse levels run for its gradient
    trainable = module.up.weight if up == "conv" else module.up_gain
    assert calls == [1] and trainable.grad.abs().sum() > 0

    with torch.no_grad():  # a trained (non-zero) U: the coarse levels run, and match the reference again
        trainable.add_(0.1)
        expected = reference_mano(module, x, 1, (8, 8))
        got = module(x, layout=layout)
    assert calls == [1, 1] and (got - expected).norm() / expected.norm() < 1e-10
    assert (got - module.requires_grad_(False)(x, layout=layout)).abs().max() == 0  # frozen U: same path, same output
