"""bf16/fp16 models patch and run; λ survives casts; CPU autocast works with and without the fused kernel."""

import copy

import pytest
import timm
import torch

from tests.support.models import tiny
from tests.support.reference.vca import reference_vca
from tests.support.vca import perturbed
from vca_patch import VisualContrastAttention, patch_model, unpatch_model
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.vca import fused_cpu

HALF = [torch.bfloat16, torch.float16]
# Unit round-off of each dtype: tolerances below are a few of them, measured errors are ~0.3-1 of them.
EPS = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).norm() / expected.double().norm())


@pytest.mark.parametrize("dtype", HALF)
def test_a_half_precision_deit_patches_every_block(dtype):
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).to(dtype).eval()
    report = patch_model(model)
    assert len(report.patched) == 12 and not report.skipped
    assert all(s.verified for s in report.patched)
    with torch.no_grad():
        out = model(torch.randn(1, 3, 224, 224, dtype=dtype))
    assert out.dtype == dtype and torch.isfinite(out).all()


def test_a_bf16_transformers_dinov2_patches_every_layer():
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(
        hidden_size=64, num_hidden_layers=3, num_attention_heads=4, intermediate_size=128, image_size=56, patch_size=14
    )
    model = transformers.Dinov2Model(config).to(torch.bfloat16).eval()
    report = patch_model(model)
    assert len(report.patched) == 3 and not report.skipped
    with torch.no_grad():
        out = model(pixel_values=torch.randn(2, 3, 56, 56, dtype=torch.bfloat16)).last_hidden_state
    assert out.shape == (2, 17, 64) and torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", HALF)
def test_lambda_stays_exactly_zero_and_float32_after_a_cast(dtype):
    model, _ = tiny()
    patch_model(model)
    model.to(dtype)
    for block in model.blocks:
        attn = block.attn
        assert attn.qkv.weight.dtype == dtype and attn.contrast_embed_pos.dtype == dtype
        for lam in (attn.lambda1, attn.lambda2):
            assert all(v.dtype == torch.float32 for v in lam.vectors())
            assert float(lam().detach()) == 0.0


def test_a_bfloat16_model_keeps_its_lambda_values_across_casts():
    layer = perturbed(VisualContrastAttention(32, 4, contrast_grid=(2, 2), layer_index=3))
    before = layer.lambdas()
    layer.to(torch.bfloat16).to(torch.float16).float()
    assert layer.lambdas() == before


@pytest.mark.parametrize("dtype", HALF)
def test_half_precision_layer_matches_the_float64_reference_and_a_10_percent_lambda_error_fails(dtype):
    """The composite path in bf16/fp16 against the independent float64 reference, within a few unit round-offs."""
    layout = TokenLayout(1, (6, 6))
    x = torch.randn(2, layout.num_tokens, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    layer = perturbed(VisualContrastAttention(32, 4, contrast_grid=(3, 3), layer_index=5)).double()
    expected = reference_vca(layer, x, layout.num_prefix_tokens, layout.grid)
    half = layer.to(dtype)
    with torch.no_grad():
        got = half(x.to(dtype), layout=layout)
    assert got.dtype == dtype
    tolerance = 3 * EPS[dtype]
    assert _relative(got, expected) < tolerance  # measured: 1.05-1.35 unit round-offs (bf16 and fp16)
    with torch.no_grad():  # a deliberate 10% error in λ₂ is far outside that tolerance
        half.lambda2.offset.add_(0.1 * float(half.lambda2()))
        wrong = half(x.to(dtype), layout=layout)
    assert _relative(wrong, expected) > tolerance  # measured: 9.5 (bf16) and 70 (fp16) unit round-offs


class _KernelCalls:
    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("attend_cpu", "attend_cpu_into_q"):
            real = getattr(fused_cpu, name)

            def spy(*args, _real=real):
                self.count += 1
                return _real(*args)

            monkeypatch.setattr(fused_cpu, name, spy)


@pytest.mark.parametrize("kernel", [True, False])
def test_cpu_autocast_inference_with_and_without_the_kernel(kernel, monkeypatch):
    if kernel and not fused_cpu.kernel_available():
        pytest.skip(f"fused CPU kernel not built here: {fused_cpu.kernel_status()}")
    model, _ = tiny()
    patch_model(model)
    for block in model.blocks:
        perturbed(block.attn)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), fused_cpu.use_kernel(False):
        expected = model.double()(x.double())
    model.float()
    calls = _KernelCalls(monkeypatch)
    with torch.no_grad(), fused_cpu.use_kernel(kernel), torch.autocast("cpu", torch.bfloat16):
        got = model(x)
    assert calls.count == (len(model.blocks) if kernel else 0)
    # The whole model under bf16 autocast (its Linears in bf16): a few bf16 unit round-offs.
    assert _relative(got, expected) < 5 * EPS[torch.bfloat16]  # measured: 1.5 (kernel) and 1.9 (composite)


def test_the_originals_kept_for_unpatch_move_and_cast_with_the_model():
    model = timm.create_model(
        "beit_base_patch16_224", pretrained=False, depth=2, img_size=64, embed_dim=64, num_heads=2
    ).eval()
    reference = copy.deepcopy(model).double()
    patch_model(model)
    assert not any("relative_position_bias_table" in k for k in model.state_dict())  # dropped, not registered
    model.to(torch.float64)
    unpatch_model(model)
    tables = [b.attn.relative_position_bias_table for b in model.blocks]
    assert all(t.dtype == torch.float64 for t in tables)
    x = torch.randn(1, 3, 64, 64, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
