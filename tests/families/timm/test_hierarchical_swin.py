"""timm Swin: window attention converted to WindowedVCA ("residual": exact at init; "global": approximate)."""

from __future__ import annotations

import copy

import pytest
import timm
import torch

import vca_patch
from tests.support.hierarchical import assert_state_restored, randomise_vca, record_attend_grids
from tests.support.models import trained_a_little
from tests.support.reference.hierarchical import partition, reference_window_attention, reference_windowed_vca
from vca_patch import NothingToPatchError, PatchError, VCAConfig, VisualContrastAttention, patch_model, unpatch_model
from vca_patch.families.timm.swin import BlockWindowEnd, BlockWindowHook
from vca_patch.layers.window_call import WindowCall
from vca_patch.surgery import inspect_model, patched_layers
from vca_patch.targets.vca.windowed import WindowedVCA

# Stage grids 16/8/4 at 64 px; windows 4 (shifted by 2 in every second block of stages 1-2).
SWIN_ARGS = {"img_size": 64, "embed_dim": 16, "depths": [2, 2, 2], "num_heads": [1, 2, 4], "window_size": 4,
             "dynamic_img_size": True}  # fmt: skip


@pytest.fixture(scope="module")
def swin() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **SWIN_ARGS).eval()


def test_window_call_round_trips_shift_and_padding():
    call = WindowCall((6, 10), (4, 4), (2, 2))
    grid = torch.randn(3, 6, 10, 5)
    windows = call.grid_to_windows(grid)
    assert torch.equal(windows, partition(grid, (4, 4), (2, 2)))  # the reference's Swin partition
    assert torch.equal(call.windows_to_grid(windows), grid)


@pytest.mark.parametrize("mode", ["residual", "global"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_windowed_layer_matches_the_float64_reference(swin, mode, dtype):
    model = copy.deepcopy(swin)
    patch_model(model, VCAConfig(swin_mode=mode))
    layer = model.layers[1].blocks[1].attn  # 2 heads, n = 16
    torch.manual_seed(3)
    randomise_vca(layer, norms=False)  # the residual gate too, in "residual" mode
    layer.to(dtype)
    call = WindowCall((6, 10), (4, 4), (2, 2))  # shifted and padded to 8 x 12: 6 windows
    layer.window_source = lambda: call
    grid = torch.randn(2, 6, 10, layer.attn_dim, dtype=dtype)
    mask = torch.where(torch.rand(call.num_windows, 16, 16) < 0.3, -100.0, 0.0).to(dtype)
    with torch.no_grad():
        got = layer(call.grid_to_windows(grid), mask)
    expected = reference_windowed_vca(layer, grid, call.window, call.shift, mask)
    error = float((got.double() - expected).abs().max() / expected.abs().max())
    assert error < (4e-15 if dtype == torch.float64 else 4e-6), error  # measured ≤ 1e-15 / 1e-6


def test_window_attention_reference_reproduces_timm(swin):
    attn = swin.layers[0].blocks[1].attn
    x = torch.randn(2 * 16, 16, 16)
    mask = swin.layers[0].blocks[1].get_attn_mask(torch.zeros(1, 16, 16, 1))  # the block's shift mask, 16 windows
    assert mask is not None and mask.shape == (16, 16, 16)
    with torch.no_grad():
        expected = attn(x, mask=mask)
    got = reference_window_attention(attn, x, mask)
    assert float((got - expected).abs().max() / expected.abs().max()) < 4e-6


def test_residual_mode_is_exact_at_init_shifted_and_padded_blocks_included(swin):
    model = copy.deepcopy(swin)
    report = patch_model(model)  # residual is the default
    assert [s.path for s in report.patched] == [f"layers.{i}.blocks.{j}.attn" for i in (0, 1) for j in (0, 1)]
    assert all(s.exact_carry_over and s.verified for s in report.patched)
    assert {s.reason for s in report.skipped} == {"last stage stays window attention (the paper's placement: VCA in "
                                                  "stages 1-3)"}  # fmt: skip
    assert any(b.shift_size != (0, 0) for b in model.layers[0].blocks)
    seen = record_attend_grids(model, WindowedVCA)
    for size in [(64, 64), (72, 88)]:  # 72 x 88: 18 x 22 and 9 x 11 grids, padded to whole 4 x 4 windows
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            got, expected = model(x), swin(x)
        assert float((got - expected).abs().max() / expected.abs().max()) < 1e-5  # measured 4e-7
    assert seen == [(16, 16), (16, 16), (8, 8), (8, 8), (18, 22), (18, 22), (9, 11), (9, 11)]


def test_residual_gate_opens_a_global_path(swin):
    model = copy.deepcopy(swin)
    patch_model(model)
    x = torch.randn(1, 3, 64, 64)
    out = model(x).square().sum()
    out.backward()
    layer = model.layers[0].blocks[0].attn
    assert layer.residual_gate.grad.abs().sum() > 0  # the global branch is trained through the gate
    with torch.no_grad():
        layer.residual_gate.fill_(0.1)
        assert not torch.equal(model(x), swin(x))


def test_global_mode_is_reported_approximate_and_drops_the_bias_table(swin):
    model = copy.deepcopy(swin)
    report = patch_model(model, VCAConfig(swin_mode="global", stage2_temperature=False, prefix_readout="contrast"))
    layers = patched_layers(model)
    assert [v["grid"] for v in layers.values()] == ["global 16x16"] * 2 + ["global 8x8"] * 2
    assert {v["mode"] for v in layers.values()} == {"global"}
    assert all(any("relative-position bias" in note for note in s.notes) for s in report.patched)
    assert not any(
        "relative_position_bias_table" in k for k in model.state_dict() if k.startswith(("layers.0", "layers.1"))
    )
    # 2nC + 10d + 10C per layer, minus the (2·4−1)² × heads bias table.
    expected = sum(2 * (2 * n * c + 10 * c // m + 10 * c - 49 * m) for c, m, n in [(16, 1, 9), (32, 2, 16)])
    assert report.params_added == expected
    seen = record_attend_grids(model, WindowedVCA)
    with torch.no_grad():
        a, b = model(torch.randn(1, 3, 64, 64)), model(torch.randn(2, 3, 72, 88))
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert seen == [(16, 16), (16, 16), (8, 8), (8, 8), (18, 22), (18, 22), (9, 11), (9, 11)]


def test_swin_tiny_parameter_count_matches_the_papers_arithmetic():
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)
    report = inspect_model(model, VCAConfig(swin_mode="global", stage2_temperature=False, prefix_readout="contrast"))
    assert len(report.patched) == 10 and len(report.skipped) == 2  # AAAB: stage 4 stays windowed
    vca = (
        2 * (2 * 9 * 96 + 10 * 32 + 10 * 96)
        + 2 * (2 * 16 * 192 + 10 * 32 + 10 * 192)
        + 6 * (2 * 49 * 384 + 10 * 32 + 10 * 384)
    )
    table = 169 * (2 * 3 + 2 * 6 + 6 * 12)
    assert report.params_added == vca - table
    assert 0.25e6 < report.params_added < 0.27e6  # the doc: +≈0.27 M VCA, −≈15 K bias tables (paper: 28.5 M)


def test_lambda_init_uses_the_global_block_index_and_selection_works(swin):
    report = inspect_model(swin, VCAConfig(layers=[1, 3]))
    assert [(s.path, s.layer_index) for s in report.patched] == [("layers.0.blocks.1.attn", 1),
                                                                ("layers.1.blocks.1.attn", 3)]  # fmt: skip
    assert report.patched[1].settings["lambda_init"] == pytest.approx(0.8 - 0.6 * 2.718281828 ** (-0.9))
    assert [s.settings["contrast_tokens"] for s in report.patched] == [9, 16]


@pytest.mark.parametrize("mode", ["residual", "global"])
def test_unpatch_restores_bit_identically_and_removes_the_block_hooks(swin, mode):
    model = copy.deepcopy(swin)
    x = torch.randn(1, 3, 64, 64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, VCAConfig(swin_mode=mode))
    assert any(isinstance(h, BlockWindowHook) for h in model.layers[0].blocks[0]._forward_pre_hooks.values())
    unpatch_model(model)
    assert_state_restored(model, state)
    for module in model.modules():
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        assert not any(isinstance(h, (BlockWindowHook, BlockWindowEnd)) for h in hooks)
    with torch.no_grad():
        assert torch.equal(model(x), swin(x))


@pytest.mark.parametrize("mode", ["residual", "global"])
def test_save_reload_and_deepcopy(swin, mode, tmp_path):
    model = copy.deepcopy(swin)
    patch_model(model, VCAConfig(swin_mode=mode))
    trained_a_little(model, "contrast_embed", "dwc", "residual_gate", "qkv.", "relative_position")
    vca_patch.save_pretrained(model, tmp_path / "swin", model_args=SWIN_ARGS)
    again = vca_patch.from_pretrained(tmp_path / "swin")
    assert patched_layers(again) == patched_layers(model)
    twin = copy.deepcopy(model)
    x = torch.randn(1, 3, 72, 88)
    with torch.no_grad():
        expected = model.eval()(x)
        assert torch.equal(again(x), expected)
        assert torch.equal(twin(x), expected)


def test_a_layer_called_outside_its_block_says_why(swin):
    model = copy.deepcopy(swin)
    patch_model(model)
    with pytest.raises(RuntimeError, match="needs its block's grid"):
        model.layers[0].blocks[0].attn(torch.randn(16, 16, 16))


def test_mano_target_builds_windowed_multipole(swin):  # MANO on Swin since issue 17: tests/test_mano_swin.py
    from vca_patch import MANOConfig

    assert {s.settings["mode"] for s in inspect_model(swin, MANOConfig()).patched} == {"multipole"}


def test_a_target_without_a_window_variant_is_refused_naming_the_targets_with_one(swin):
    """DIDB builds no window variant: every stage 1-2 site says so and names MANO and VCA, which do."""
    from vca_patch import DIDBConfig

    with pytest.raises(NothingToPatchError) as info:
        inspect_model(swin, DIDBConfig())
    refused = [s.reason for s in info.value.skipped if s.reason.startswith("could not build")]
    assert len(refused) == 4  # stages 1-2; the last stage stays window attention
    assert set(refused) == {
        "could not build the replacement: Swin window attention is not plain softmax attention over one token "
        "grid: only a target that builds a variant for it takes it, not DIDBAttention (targets that do: mano, vca)"
    }


def test_vca_core_is_the_plain_layer(swin):
    model = copy.deepcopy(swin)
    patch_model(model)
    assert isinstance(model.layers[0].blocks[0].attn, VisualContrastAttention)


def test_strict_mode_refuses_the_approximate_global_mode_and_accepts_the_exact_residual_one(swin):
    model = copy.deepcopy(swin)
    with pytest.raises(PatchError, match=r"strict mode refuses.*relative-position bias"):
        patch_model(model, VCAConfig(swin_mode="global"), strict=True)
    assert not any(isinstance(m, WindowedVCA) for m in model.modules())  # refused whole: nothing changed
    report = patch_model(model, VCAConfig(swin_mode="residual"), strict=True)
    assert report.patched and all(not s.notes for s in report.patched)
