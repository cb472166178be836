import pytest
import torch
import torch.nn.functional as F

from tests.support.reference.vca import reference_vca
from tests.support.vca import randomised
from vca_patch.layers.grid_pool import adaptive_avg_pool_tokens
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.vca import fused_cpu
from vca_patch.targets.vca.layer import VisualContrastAttention

GRIDS = [(6, 6), (5, 8), (7, 3)]


@pytest.mark.parametrize("softmax", ["joint", "separate"])
@pytest.mark.parametrize("num_prefix", [0, 1, 2, 5])
@pytest.mark.parametrize("grid", GRIDS)
def test_matches_float64_reference(softmax, num_prefix, grid):
    module = randomised(VisualContrastAttention(24, 3, contrast_grid=(2, 3), layer_index=4, softmax=softmax)).double()
    x = torch.randn(2, num_prefix + grid[0] * grid[1], 24, dtype=torch.float64)
    lam1, lam2 = module.lambdas()
    assert abs(lam1) > 1e-3 and abs(lam2) > 1e-3
    expected = reference_vca(module, x, num_prefix, grid)
    got = module(x, layout=TokenLayout(num_prefix, grid))
    rel = (got - expected).norm() / expected.norm()
    assert rel < 1e-10, rel


@pytest.mark.parametrize("softmax", ["joint", "separate"])
@pytest.mark.parametrize("num_prefix", [0, 1, 3])
@pytest.mark.parametrize("grid", [(6, 6), (5, 8), (17, 11)])  # (17, 11): large enough to pool the layer input
def test_default_readout_and_temperature_match_float64_reference(softmax, num_prefix, grid):
    """The converted layer's defaults: exact prefix read-out and a per-head Stage-II temperature."""
    options = {"prefix_readout": "exact", "stage2_temperature": True, "softmax": softmax}
    module = randomised(VisualContrastAttention(24, 3, contrast_grid=(2, 3), layer_index=4, **options)).double()
    x = torch.randn(2, num_prefix + grid[0] * grid[1], 24, dtype=torch.float64)
    expected = reference_vca(module, x, num_prefix, grid)
    for grad in (False, True):  # the in-place inference path and the autograd path
        with torch.set_grad_enabled(grad):
            got = module(x, layout=TokenLayout(num_prefix, grid))
        rel = (got - expected).norm() / expected.norm()
        assert rel < 1e-10, (grad, rel)


@pytest.mark.parametrize("softmax", ["joint", "separate"])
def test_float32_within_1e5_of_reference(softmax):
    module = randomised(VisualContrastAttention(32, 4, contrast_grid=(3, 3), layer_index=2, softmax=softmax))
    x = torch.randn(2, 1 + 9 * 7, 32)
    expected = reference_vca(module, x, 1, (9, 7))
    got = module(x, layout=TokenLayout(1, (9, 7))).double()
    assert (got - expected).norm() / expected.norm() < 1e-5


def test_joint_and_separate_differ_when_lambda_is_not_zero():
    joint = randomised(VisualContrastAttention(16, 2, contrast_grid=(2, 2), softmax="joint"))
    separate = VisualContrastAttention(16, 2, contrast_grid=(2, 2), softmax="separate")
    separate.load_state_dict(joint.state_dict())
    x = torch.randn(1, 1 + 16, 16)
    layout = TokenLayout(1, (4, 4))
    assert not torch.allclose(joint(x, layout=layout), separate(x, layout=layout), atol=1e-3)


def test_preserve_init_gives_zero_lambda_with_live_gradient():
    module = VisualContrastAttention(32, 4, layer_index=7)
    lam1, lam2 = module.lambdas()
    assert abs(lam1) < 1e-6 and abs(lam2) < 1e-6
    assert module.lambda_init == pytest.approx(0.8 - 0.6 * torch.exp(torch.tensor(-2.1)).item())
    for p in (module.lambda1.q1, module.lambda1.k2, module.lambda2.q2):
        assert p.abs().sum() > 0
    # The negative stream has no effect at λ = 0, and e± = 0, DWC = 0.
    assert module.contrast_embed_pos.abs().sum() == 0 and module.dwc.weight.abs().sum() == 0


def test_preserve_init_joint_equals_separate():
    joint = VisualContrastAttention(32, 4, contrast_grid=(3, 3), softmax="joint")
    separate = VisualContrastAttention(32, 4, contrast_grid=(3, 3), softmax="separate")
    separate.load_state_dict(joint.state_dict())
    x = torch.randn(2, 2 + 36, 32)
    layout = TokenLayout(2, (6, 6))
    torch.testing.assert_close(joint(x, layout=layout), separate(x, layout=layout), atol=5e-3, rtol=0)


def test_parameter_count_matches_paper_formula():
    # VCA adds 2nC + 10d + 10C per layer (docs/vca.md §2.1).
    module = VisualContrastAttention(192, 3, contrast_grid=(7, 7))
    carried = sum(p.numel() for name, p in module.named_parameters() if name.startswith(("qkv", "proj")))
    added = sum(p.numel() for p in module.parameters()) - carried
    assert added == 2 * 49 * 192 + 10 * 64 + 10 * 192 == 21376


def test_layout_mismatch_is_a_clear_error():
    module = VisualContrastAttention(16, 2, contrast_grid=(2, 2))
    with pytest.raises(ValueError, match="1 prefix \\+ 4x4 patches = 17"):
        module(torch.randn(1, 20, 16), layout=TokenLayout(1, (4, 4)))
    with pytest.raises(ValueError, match="needs the token layout"):
        module(torch.randn(1, 17, 16))
    with pytest.raises(ValueError, match="masks"):
        module(torch.randn(1, 17, 16), attn_mask=torch.ones(17, 17, dtype=torch.bool), layout=TokenLayout(1, (4, 4)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_autocast_is_finite_and_close(dtype):
    module = VisualContrastAttention(32, 4, contrast_grid=(2, 2), prefix_readout="exact", stage2_temperature=True)
    module.reset_vca_parameters("paper")
    x = torch.randn(2, 1 + 25, 32, requires_grad=True)
    layout = TokenLayout(1, (5, 5))
    ref = module.double()(x.double(), layout=layout).detach()  # float64 reference
    module.float()
    with torch.autocast("cpu", dtype=dtype):
        out = module(x, layout=layout)
    assert out.dtype == dtype and torch.isfinite(out).all()
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11  # the dtype's unit round-off
    assert (out.double() - ref).norm() / ref.norm() < 3 * unit  # measured: 1.1 (bf16), 1.2 (fp16) units
    out.float().square().sum().backward()  # λ, both RMSNorms and their backward stay in float32
    assert torch.isfinite(x.grad).all() and torch.isfinite(module.lambda2.q1.grad).all()


def test_backward_reaches_every_new_parameter_in_paper_init():
    module = VisualContrastAttention(16, 2, contrast_grid=(2, 2))
    module.reset_vca_parameters("paper")
    x = torch.randn(2, 1 + 16, 16)
    module(x, layout=TokenLayout(1, (4, 4))).square().sum().backward()
    for name, p in module.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("grid, pooled", [((14, 14), (7, 7)), ((13, 9), (4, 3)), ((5, 7), (5, 7)), ((3, 2), (7, 7))])
def test_grid_pooling_as_matmuls_equals_adaptive_avg_pool(grid, pooled):
    P, C = 2, 5
    sequence = torch.randn(3, P + grid[0] * grid[1], C, dtype=torch.float64)  # prefix rows in front, as in a ViT
    image = sequence[:, P:].reshape(3, *grid, C).permute(0, 3, 1, 2)
    expected = F.adaptive_avg_pool2d(image, pooled).flatten(2).transpose(1, 2)
    torch.testing.assert_close(adaptive_avg_pool_tokens(sequence[:, P:], grid, pooled), expected, rtol=0, atol=1e-12)


def test_cached_lambda_follows_parameter_updates():
    module = VisualContrastAttention(16, 2, contrast_grid=(2, 2), layer_index=3)
    module.reset_vca_parameters("paper")
    with torch.inference_mode():
        first = float(module.lambda1())
        assert float(module.lambda1()) == first  # cached
    with torch.no_grad():
        module.lambda1.q1.mul_(2.0)  # an optimizer-style in-place update
    with torch.inference_mode():
        updated = float(module.lambda1())
    lam = module.lambda1
    q1, k1, q2, k2 = (p.detach().double() for p in (lam.q1, lam.k1, lam.q2, lam.k2))
    expected = float(torch.exp(q1 @ k1) - torch.exp(q2 @ k2) + module.lambda_init)
    assert updated != first and updated == pytest.approx(expected, rel=1e-6)
    module.lambda1.load_state_dict({k: v * 3 for k, v in module.lambda1.state_dict().items()})  # copied in place too
    with torch.inference_mode():
        assert float(module.lambda1()) != updated


def test_inference_then_training_with_cached_constants():
    """Values cached under inference_mode (pooling windows, λ) must not leak into a later backward."""
    module = VisualContrastAttention(16, 2, contrast_grid=(2, 2), prefix_readout="exact", stage2_temperature=True)
    module.reset_vca_parameters("paper")
    layout = TokenLayout(1, (12, 12))  # large enough to pool the layer input
    x = torch.randn(2, 1 + 144, 16)
    with torch.inference_mode():
        expected = module(x, layout=layout)
    out = module(x, layout=layout)
    out.square().sum().backward()
    torch.testing.assert_close(out.detach(), expected)
    assert module.lambda1.q1.grad is not None and module.qkv.weight.grad is not None


def _saved_bytes(module: torch.nn.Module, x: torch.Tensor, **kwargs) -> int:
    """Bytes of the distinct storages autograd keeps for backward after one forward (x itself excluded)."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() != x.untyped_storage().data_ptr():
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x, **kwargs)
    out.sum().backward()
    return sum(storages.values())


@pytest.mark.parametrize("grid", [(14, 14), (32, 32)])
def test_training_saves_no_more_than_softmax_attention(grid):
    from timm.models.vision_transformer import Attention

    dim, heads = 96, 4
    x = torch.randn(2, 1 + grid[0] * grid[1], dim, requires_grad=True)
    original = _saved_bytes(Attention(dim, heads, qkv_bias=True), x)
    vca = VisualContrastAttention(dim, heads, prefix_readout="exact", stage2_temperature=True)
    vca.reset_vca_parameters("paper")
    saved = _saved_bytes(vca, x, layout=TokenLayout(1, grid))
    token_rows = x.shape[0] * x.shape[1] * dim * 4  # one [B, N, C] float32 activation
    assert saved <= original, (saved / token_rows, original / token_rows)
    vca.recompute_in_backward = False  # the trade-off: without recomputation it keeps more than the original
    assert _saved_bytes(vca, x, layout=TokenLayout(1, grid)) > original


def test_rms_norm_backward_matches_autograd_of_the_formula():
    from vca_patch.targets.vca.layer import _RMSNormFunction

    x = torch.randn(2, 5, 3, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: _RMSNormFunction.apply(a, w, 1e-5), (x, weight))
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    torch.testing.assert_close(_RMSNormFunction.apply(x, weight, 1e-5), expected)


@pytest.mark.parametrize("kernel", [True, False], ids=["fused-kernel", "composite"])
@pytest.mark.parametrize("batch, num_prefix", [(1, 1), (2, 0), (2, 1)])  # the last: strided rows, plain conv
def test_float32_inference_paths_match_float64_reference(batch, num_prefix, kernel):
    options = {"prefix_readout": "exact", "stage2_temperature": True}
    module = randomised(VisualContrastAttention(32, 4, contrast_grid=(3, 3), layer_index=2, **options))
    grid = (9, 7)
    x = torch.randn(batch, num_prefix + 63, 32)
    expected = reference_vca(module, x, num_prefix, grid)
    with torch.inference_mode(), fused_cpu.use_kernel(kernel):
        got = module(x, layout=TokenLayout(num_prefix, grid)).double()
    assert (got - expected).norm() / expected.norm() < 1e-5


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN")
def test_fused_conv_add_kernel_is_taken_and_exact():
    from vca_patch.targets.vca.local_conv import _fused_kernel_usable, add_conv_

    conv = torch.nn.Conv2d(16, 16, 3, padding=1, groups=16)
    tokens = torch.randn(1, 1 + 35, 16)  # one prefix row, then a 5x7 grid
    out = torch.randn(1, 1 + 35, 16)
    grid_in = tokens[:, 1:].view(1, 5, 7, 16).permute(0, 3, 1, 2)
    grid_out = out[:, 1:].view(1, 5, 7, 16).permute(0, 3, 1, 2)
    with torch.inference_mode():
        expected = out.clone()
        expected[:, 1:] += conv(grid_in).permute(0, 2, 3, 1).reshape(1, 35, 16)
        assert _fused_kernel_usable(grid_out, grid_in, conv)
        add_conv_(grid_out, grid_in, conv)
    torch.testing.assert_close(out, expected)  # prefix row untouched, patch rows += conv


def test_recomputation_with_a_frozen_projection_still_trains_the_new_parameters():
    module = VisualContrastAttention(16, 2, contrast_grid=(2, 2), prefix_readout="exact", stage2_temperature=True)
    module.reset_vca_parameters("paper")
    module.qkv.requires_grad_(False)  # frozen carried weights and an input without grad: only VCA's own params train
    x = torch.randn(2, 1 + 16, 16)
    layout = TokenLayout(1, (4, 4))
    kept = _saved_bytes(module, x, layout=layout)
    assert kept <= 3 * 2 * 17 * 16 * 4  # q, k, v only: the rest is recomputed in backward
    module.recompute_in_backward = False
    assert _saved_bytes(module, x, layout=layout) > kept
    for name in ("contrast_embed_pos", "lambda1.q1", "dwc.weight", "stage2_temperature"):
        assert module.get_parameter(name).grad is not None, name
