"""MANO on Swin / SwinV2 (timm and transformers): level 0 is the block's own window attention (bias table, shift
mask), the coarse levels run on the block's grid; zero-initialised coarse path -> exact at init."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import transformers

import vca_patch
from tests.support.models import trained_a_little
from tests.support.reference.hierarchical import partition, reference_window_attention
from tests.support.reference.mano import reference_mano
from vca_patch import MANOConfig, patch_model, unpatch_model
from vca_patch.layers.window_call import WindowCall
from vca_patch.surgery import inspect_model, patched_layers
from vca_patch.targets.mano.windowed import WindowedMultipole

SWIN_ARGS = {"img_size": 64, "embed_dim": 16, "depths": [2, 2, 2], "num_heads": [1, 2, 4], "window_size": 4,
             "dynamic_img_size": True}  # fmt: skip
SWINV2_ARGS = {**SWIN_ARGS, "dynamic_img_size": False, "strict_img_size": False}
HF_ARGS = {"embed_dim": 16, "depths": [2, 2, 2], "num_heads": [1, 2, 4], "window_size": 4, "image_size": 64}


def _trained_like(model: torch.nn.Module) -> torch.nn.Module:
    """Off the constant inits (SwinV2's zero post-norms and q/v biases), so attention shows in the output."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias") or "logit_scale" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


BUILDERS = {
    "timm-swin": lambda: timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **SWIN_ARGS),
    "timm-swinv2": lambda: timm.create_model("swinv2_tiny_window8_256", pretrained=False, **SWINV2_ARGS),
    "hf-swin": lambda: transformers.SwinModel(transformers.SwinConfig(**HF_ARGS, patch_size=4)),
    "hf-swinv2": lambda: transformers.Swinv2Model(transformers.Swinv2Config(**HF_ARGS)),
}


@pytest.fixture(scope="module")
def models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    return {name: _trained_like(build()) for name, build in BUILDERS.items()}


def _features(model, x):
    return model.forward_features(x) if hasattr(model, "forward_features") else model(x).last_hidden_state


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


@pytest.mark.parametrize("name", list(BUILDERS))
def test_exact_at_init_at_two_resolutions_shifted_blocks_included(models, name):
    base = models[name]
    model = copy.deepcopy(base)
    report = patch_model(model, MANOConfig(), strict=True)  # nothing dropped, every site verified
    assert len(report.patched) == 4 and all(s.verified and s.exact_carry_over for s in report.patched)
    assert all(isinstance(m, WindowedMultipole) for m in model.modules() if type(m).__name__.startswith("Windowed"))
    blocks = [m for m in model.modules() if hasattr(m, "shift_size") and not isinstance(m, WindowedMultipole)]
    assert any(b.shift_size not in (0, (0, 0)) for b in blocks)
    for size in [(64, 64), (72, 88)]:  # 72 x 88: 18 x 22 and 9 x 11 grids, padded to whole 4 x 4 windows
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            assert _relative(_features(model, x), _features(base, x)) < 2e-6  # measured ≤ 4e-7


def test_windowed_multipole_layer_matches_the_float64_reference(models):
    model = copy.deepcopy(models["timm-swin"])
    patch_model(model, MANOConfig(init="random"))
    layer = model.layers[0].blocks[1].attn.double()  # shifted block, 1 head
    call = WindowCall((6, 10), (4, 4), (2, 2))  # shifted and padded to 8 x 12: 6 windows; 3 levels 6x10/3x5/2x3
    layer.window_source = lambda: call
    grid = torch.randn(2, 6, 10, 16, dtype=torch.float64)
    mask = torch.where(torch.rand(call.num_windows, 16, 16) < 0.3, -100.0, 0.0).double()
    with torch.no_grad():
        got = layer(call.grid_to_windows(grid), mask)
        tokens = grid.reshape(2, 60, 16)
        level0_only = reference_mano(layer, tokens, 0, (6, 10), levels_override=1)
        coarse = reference_mano(layer, tokens, 0, (6, 10)) - level0_only  # the coarse levels' V-cycle term
    level0 = reference_window_attention(layer, partition(grid, (4, 4), (2, 2)), mask)  # bias table and mask
    expected = level0 + partition(coarse.reshape(2, 6, 10, -1), (4, 4), (2, 2))
    assert float(coarse.abs().max()) > 1e-2  # the coarse path is live
    assert _relative(got, expected) < 1e-13  # measured 2e-16


def test_coarse_path_is_trained_through_the_zero_initialised_upsampling(models):
    base = models["hf-swin"]
    model = copy.deepcopy(base)
    patch_model(model, MANOConfig())
    x = torch.randn(1, 3, 64, 64)
    model(x).last_hidden_state.square().sum().backward()
    layer = model.encoder.layers[0].blocks[0].attention
    assert layer.up.weight.grad.abs().sum() > 0
    with torch.no_grad():
        layer.up.weight.normal_(std=0.1)
        assert _relative(_features(model, x), _features(base, x)) > 1e-3


@pytest.mark.parametrize("name", ["timm-swin", "hf-swinv2"])
def test_unpatch_bit_identical_and_save_reload_identity(models, name, tmp_path):
    base = models[name]
    model = copy.deepcopy(base)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, MANOConfig())
    trained_a_little(model, "up.", "down.", "relative_position", "logit_scale")
    args = {"model_args": SWIN_ARGS} if name == "timm-swin" else {}
    vca_patch.save_pretrained(model, tmp_path / name, **args)
    again = vca_patch.from_pretrained(tmp_path / name)
    assert patched_layers(again) == patched_layers(model)
    x = torch.randn(1, 3, 72, 88)
    with torch.no_grad():
        assert torch.equal(_features(again.eval(), x), _features(model.eval(), x))
    twin = copy.deepcopy(base)
    patch_model(twin, MANOConfig())
    unpatch_model(twin)
    assert twin.state_dict().keys() == state.keys()
    assert all(torch.equal(state[k], v) for k, v in twin.state_dict().items())
    with torch.no_grad():
        assert torch.equal(_features(twin, x), _features(base, x))


def test_inspect_reports_stage_and_levels(models):
    report = inspect_model(models["timm-swin"], MANOConfig())
    assert [(s.settings["stage"], s.settings["grid"]) for s in report.patched] == [
        (0, "window 4x4 + multipole 16x16/8x8/4x4"), (0, "window 4x4 + multipole 16x16/8x8/4x4"),
        (1, "window 4x4 + multipole 8x8/4x4"), (1, "window 4x4 + multipole 8x8/4x4"),
    ]  # fmt: skip
    assert {s.settings["window"] for s in report.patched} == {4}  # the block's window, not MANOConfig.window
