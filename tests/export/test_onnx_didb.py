"""DIDB exports like its original: the binary attention update is exact in any summation order (so onnxruntime,
which sums in another order than eager, gives the same signs), and a packed model's XNOR kernel stays out of the
exported graph."""

from __future__ import annotations

import os

import pytest
import timm
import torch
from torch import nn

from vca_patch import DIDBConfig, TokenLayout, patch_model
from vca_patch.targets.didb import DIDBAttention, kernel, pack_binary
from vca_patch.targets.didb import attention as didb_attention

DIM, HEADS, P, GRID = 16, 2, 1, (4, 5)


def _layer(dtype: torch.dtype) -> DIDBAttention:
    """Binary weights and inputs, qkv without bias and γ = 1: the update's integer parts cancel to exact zeros
    often (16-wide ±1 dot products are small even integers)."""
    torch.manual_seed(0)
    qkv, proj = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM)
    layer = DIDBAttention(DIM, HEADS, qkv=qkv, proj=proj).to(dtype).eval()
    with torch.no_grad():
        layer.attn_threshold.copy_(torch.tensor([1.7, 2.4]))
        layer.band_weight.copy_(torch.tensor([[0.8, 1.2], [0.5, 1.5]]))
    return layer


def _proj_inputs(monkeypatch, layer: DIDBAttention, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, the input of the binary proj: the update whose sign it takes)."""
    seen = []
    real = didb_attention.binary_forward

    def spy(inputs, weight, bias, clip, **kwargs):
        seen.append(inputs)
        return real(inputs, weight, bias, clip, **kwargs)

    monkeypatch.setattr(didb_attention, "binary_forward", spy)
    with torch.no_grad():
        out = layer(x, layout=TokenLayout(P, GRID))
    return out, seen[-1]


def test_the_update_is_exact_so_float32_gives_the_float64_signs(monkeypatch):
    """Summed as floats, updates that are 0 left ±5e-10 residues whose sign depended on the order of the sums:
    eager, inductor and onnxruntime then fed different ±c to the binary proj (onnxruntime was 0.18 off on a tiny
    DeiT). Summed as integers, an update is exactly 0 in every dtype and order, and sign(0) = 0."""
    x = torch.randn(3, P + GRID[0] * GRID[1], DIM, dtype=torch.float64)
    out64, update64 = _proj_inputs(monkeypatch, _layer(torch.float64), x)
    out32, update32 = _proj_inputs(monkeypatch, _layer(torch.float32), x.float())
    zeros = update64 == 0
    assert int(zeros.sum()) >= 10  # the case this test is about: exact zeros (15 of 960 here)
    assert bool((update32[zeros] == 0).all())  # exactly zero in float32 too, not a rounding residue
    assert torch.equal(torch.sign(update32), torch.sign(update64).float())
    torch.testing.assert_close(out32.double(), out64, atol=1e-5, rtol=1e-5)


def _kernel_or_skip() -> None:
    if not kernel.kernel_available():
        if os.environ.get("VCA_PATCH_REQUIRE_CPU_KERNEL") == "1":
            pytest.fail(f"VCA_PATCH_REQUIRE_CPU_KERNEL=1, but the XNOR kernel is unavailable: {kernel.kernel_status()}")
        pytest.skip(f"the XNOR CPU kernel is not available here: {kernel.kernel_status()}")


@pytest.mark.e2e  # ~19 s on one core: in make test-e2e
def test_a_packed_model_runs_the_xnor_kernel_eagerly_and_exports_without_it(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    onnx = pytest.importorskip("onnx")
    from vca_patch.export import export_model
    from vca_patch.export.onnx_file import nonstandard_ops

    _kernel_or_skip()
    torch.manual_seed(0)
    model = timm.create_model(
        "deit_tiny_patch16_224", pretrained=False, dynamic_img_size=True, depth=2, img_size=64, embed_dim=48,
        num_heads=3, num_classes=10,
    )  # fmt: skip
    patch_model(model, DIDBConfig())
    pack_binary(model).eval()
    calls = []
    real = kernel.xnor_linear
    monkeypatch.setattr(kernel, "xnor_linear", lambda *args: calls.append(1) or real(*args))
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 80))
    assert len(calls) == 12  # eager: every binary Linear of both blocks (qkv's v and q/k bands, proj, fc1, fc2)
    result = export_model(model, tmp_path / "m.onnx", format="onnx", dynamic=True, img_size=(64, 64))
    assert result.max_error < 1e-6  # measured 1.2e-7: the kernel's integers and the emulation's agree exactly
    assert nonstandard_ops(onnx.load(str(tmp_path / "m.onnx"))) == []
