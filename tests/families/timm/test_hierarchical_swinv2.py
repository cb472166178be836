"""SwinV2 (timm `swinv2_*`, transformers `Swinv2Model`): cosine window attention with a continuous position bias
converted to WindowedVCA ("residual": exact at init; "global": approximate, the CPB dropped)."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import transformers

import vca_patch
from tests.support.hierarchical import assert_state_restored, gradients_without_and_with_checkpointing, randomise_vca
from tests.support.models import trained_a_little
from tests.support.reference.hierarchical import partition
from tests.support.reference.swinv2 import reference_cosine_vca, reference_cosine_window_attention
from vca_patch import PatchError, VCAConfig, patch_model, unpatch_model
from vca_patch.layers.window_call import WindowCall
from vca_patch.surgery import inspect_model, patched_layers
from vca_patch.targets.vca.windowed import WindowedVCA

# Stage grids 16/8/4 at 64 px; windows 4 (shifted by 2 in every second block of stages 1-2).
TIMM_ARGS = {"img_size": 64, "embed_dim": 16, "depths": [2, 2, 2], "num_heads": [1, 2, 4], "window_size": 4,
             "strict_img_size": False}  # fmt: skip
HF_ARGS = {"embed_dim": 16, "depths": [2, 2, 2], "num_heads": [1, 2, 4], "window_size": 4, "image_size": 64}


def _off_init(model: torch.nn.Module) -> torch.nn.Module:
    """Move SwinV2's zero/constant inits (post-norm weights 0, q/v biases 0, logit scale ln 10) to trained-like
    values, so the attention branch shows in the output and every term is exercised."""
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "logit_scale" in name:
                p.add_(torch.randn_like(p) * 0.5)
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def timm_v2() -> torch.nn.Module:
    torch.manual_seed(0)
    return _off_init(timm.create_model("swinv2_tiny_window8_256", pretrained=False, **TIMM_ARGS))


@pytest.fixture(scope="module")
def hf_v2() -> torch.nn.Module:
    torch.manual_seed(0)
    return _off_init(transformers.Swinv2Model(transformers.Swinv2Config(**HF_ARGS)))


def _features(model, x):
    return model.forward_features(x) if hasattr(model, "forward_features") else model(x).last_hidden_state


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


def test_the_float64_reference_reproduces_timm_and_hf_cosine_window_attention(timm_v2, hf_v2):
    block = timm_v2.layers[0].blocks[1]
    mask = block.get_attn_mask(torch.zeros(1, 16, 16, 1))  # the block's own shift mask, 16 windows
    assert mask is not None and mask.shape == (16, 16, 16)
    x = torch.randn(2 * 16, 16, 16)
    with torch.no_grad():
        expected = block.attn(x, mask=mask)
    assert _relative(reference_cosine_window_attention(block.attn, x, mask, (4, 4)), expected) < 4e-6
    attn = hf_v2.encoder.layers[0].blocks[1].attention.self
    with torch.no_grad():
        expected = attn(x, mask)[0]  # transformers adds the mask twice: -200 instead of -100, no difference here
    got = reference_cosine_window_attention(attn, x, mask, (4, 4), "continuous_position_bias_mlp")
    assert _relative(got, expected) < 4e-6  # measured ≤ 5e-7 (float32 modules)


@pytest.mark.parametrize("library", ["timm", "hf"])
def test_residual_mode_is_exact_at_init_at_two_resolutions_shifted_blocks_included(timm_v2, hf_v2, library):
    base = timm_v2 if library == "timm" else hf_v2
    model = copy.deepcopy(base)
    report = patch_model(model, strict=True)  # residual is the default: exact and verified
    assert len(report.patched) == 4 and all(s.exact_carry_over and s.verified for s in report.patched)
    assert {s.settings["attention"] for s in report.patched} == {"cosine"}
    blocks = [m for m in model.modules() if type(m).__name__ in ("SwinTransformerV2Block", "Swinv2Layer")]
    assert any(b.shift_size not in (0, (0, 0)) for b in blocks)
    for size in [(64, 64), (72, 88)]:  # 72 x 88: 18 x 22 and 9 x 11 grids, padded to whole 4 x 4 windows
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            assert _relative(_features(model, x), _features(base, x)) < 2e-6  # measured 3e-7


def test_cosine_windowed_layer_matches_the_float64_reference():
    torch.manual_seed(0)
    model = _off_init(timm.create_model("swinv2_tiny_window8_256", pretrained=False, **TIMM_ARGS))
    patch_model(model, VCAConfig(swin_mode="residual"))
    layer = model.layers[1].blocks[1].attn  # 2 heads, n = 16
    torch.manual_seed(3)
    randomise_vca(layer, norms=False)
    layer.double()
    call = WindowCall((6, 10), (4, 4), (2, 2))  # shifted and padded to 8 x 12: 6 windows
    layer.window_source = lambda: call
    grid = torch.randn(2, 6, 10, layer.attn_dim, dtype=torch.float64)
    mask = torch.where(torch.rand(call.num_windows, 16, 16) < 0.3, -100.0, 0.0).double()
    with torch.no_grad():
        got = layer(call.grid_to_windows(grid), mask)
    vca = partition(reference_cosine_vca(layer, grid.reshape(2, 60, -1), (6, 10)).reshape(2, 6, 10, -1), (4, 4), (2, 2))
    windows = reference_cosine_window_attention(layer, partition(grid, (4, 4), (2, 2)), mask, (4, 4))
    gated = vca * layer.residual_gate.detach().double()
    with torch.no_grad():
        window_branch = layer.window_attention(call.grid_to_windows(grid), mask)
    assert _relative(got - window_branch, gated) < 4e-14  # the cosine VCA branch: measured 8e-15
    # timm builds the CPB coordinate table in float32 (a buffer the layer carries): measured 2e-11
    assert _relative(got, windows + gated) < 2e-10


@pytest.mark.parametrize("library", ["timm", "hf"])
def test_global_mode_is_approximate_drops_the_cpb_and_runs_at_two_resolutions(timm_v2, hf_v2, library):
    base = timm_v2 if library == "timm" else hf_v2
    model = copy.deepcopy(base)
    with pytest.raises(PatchError, match=r"strict mode refuses.*continuous position bias"):
        patch_model(model, VCAConfig(swin_mode="global"), strict=True)
    report = patch_model(model, VCAConfig(swin_mode="global", stage2_temperature=False))
    assert [s.settings["grid"] for s in report.patched] == ["global 16x16"] * 2 + ["global 8x8"] * 2
    mlp = "cpb_mlp" if library == "timm" else "continuous_position_bias_mlp"
    kept = [k for k in model.state_dict() if mlp in k]
    assert kept and all(".2." in k.split(".blocks")[0] or "layers.2" in k for k in kept)  # only the last stage's
    assert any(k.endswith("logit_scale") and "layers.0" in k for k in model.state_dict())  # cosine scale kept
    cpb = 2 * 512 + 512  # Linear(2, 512) + Linear(512, M) per head
    added = sum(2 * (2 * n * c + 10 * c // m + 10 * c - cpb - 512 * m) for c, m, n in [(16, 1, 9), (32, 2, 16)])
    assert report.params_added == added
    for size in [(64, 64), (72, 88)]:
        with torch.no_grad():
            out = _features(model, torch.randn(1, 3, *size))
        assert torch.isfinite(out).all()


@pytest.mark.parametrize("library", ["timm", "hf"])
@pytest.mark.parametrize("mode", ["residual", "global"])
def test_unpatch_is_bit_identical(timm_v2, hf_v2, library, mode):
    base = timm_v2 if library == "timm" else hf_v2
    model = copy.deepcopy(base)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, VCAConfig(swin_mode=mode))
    unpatch_model(model)
    assert_state_restored(model, state)
    assert not any(isinstance(m, WindowedVCA) for m in model.modules())
    assert not any("maybe_pad" in m.__dict__ for m in model.modules())
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(_features(model, x), _features(base, x))


@pytest.mark.parametrize("library", ["timm", "hf"])
def test_save_reload_identity(timm_v2, hf_v2, library, tmp_path):
    model = copy.deepcopy(timm_v2 if library == "timm" else hf_v2)
    patch_model(model)
    trained_a_little(model, "contrast_embed", "dwc", "residual_gate", "logit_scale", "mlp")
    vca_patch.save_pretrained(model, tmp_path / "v2", **({"model_args": TIMM_ARGS} if library == "timm" else {}))
    again = vca_patch.from_pretrained(tmp_path / "v2")
    assert patched_layers(again) == patched_layers(model)
    x = torch.randn(1, 3, 72, 88)
    with torch.no_grad():
        assert torch.equal(_features(again.eval(), x), _features(model.eval(), x))


def test_inspect_reports_stage_and_grid_per_site(timm_v2):
    report = inspect_model(timm_v2)
    assert [(s.settings["stage"], s.settings["grid"]) for s in report.patched] == [
        (0, "window 4x4 + global 16x16"), (0, "window 4x4 + global 16x16"),
        (1, "window 4x4 + global 8x8"), (1, "window 4x4 + global 8x8"),
    ]  # fmt: skip


def test_cli_inspect_shows_stage_and_grid_per_site():
    from typer.testing import CliRunner

    from vca_patch.cli import app

    result = CliRunner().invoke(app, ["inspect", "swinv2_tiny_window8_256"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "grid=window 8x8 + global 64x64" in result.output and "grid=window 8x8 + global 16x16" in result.output
    assert "stage=0" in result.output and "stage=2" in result.output and "attention=cosine" in result.output
    assert "last stage stays window attention" in result.output
    bad = CliRunner().invoke(app, ["inspect", "swinv2_tiny_window8_256", "--swin-mode", "windowed"])
    assert bad.exit_code == 2 and "swin_mode must be 'residual' or 'global'" in bad.output


def test_swin_tiny_global_placement_adds_the_papers_parameters_per_stage():
    """2nC + 10d + 10C per VCA layer (d = 32), minus the (2·7−1)² × heads bias table it drops, per stage of Swin-T
    (depths 2/2/6, C 96/192/384, n 9/16/49): +0.274 M of VCA, −0.015 M of tables (the paper: 28.3 M -> 28.5 M)."""
    with torch.device("meta"):  # parameter counts only: no weights, no verification
        model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False)
    report = inspect_model(model, VCAConfig(swin_mode="global", stage2_temperature=False))
    per_stage: dict[int, int] = {}
    for site in report.patched:
        per_stage[site.settings["stage"]] = per_stage.get(site.settings["stage"], 0) + site.params_added
    expected = {
        stage: depth * (2 * n * c + 10 * 32 + 10 * c - 169 * (c // 32))
        for stage, (depth, c, n) in enumerate([(2, 96, 9), (2, 192, 16), (6, 384, 49)])
    }
    assert per_stage == expected == {0: 5_002, 1: 14_740, 2: 238_584}
    vca = sum(depth * (2 * n * c + 10 * 32 + 10 * c) for depth, c, n in [(2, 96, 9), (2, 192, 16), (6, 384, 49)])
    assert vca == 273_536 and report.params_added == vca - 15_210  # ≈ +0.27 M VCA, −15 K bias tables
    assert round(report.params_before / 1e6, 2) == 28.29 and round(report.params_after / 1e6, 2) == 28.55


@pytest.mark.parametrize("library", ["timm", "hf"])
def test_bfloat16_models_patch_with_float32_verification(timm_v2, hf_v2, library):
    model = copy.deepcopy(timm_v2 if library == "timm" else hf_v2).to(torch.bfloat16)
    report = patch_model(model)  # verified on a float32 copy (its CPB coordinate table re-created as float32)
    assert all(s.verified for s in report.patched)
    layer = next(m for m in model.modules() if isinstance(m, WindowedVCA))
    assert layer.lambda1.q1.dtype == torch.float32 and layer.residual_gate.dtype == torch.bfloat16
    with torch.no_grad():
        out = _features(model, torch.randn(1, 3, 64, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_hf_gradient_checkpointing_gives_the_same_gradients():
    """Recomputation skips the layer hooks: `maybe_pad` (run first in every Swinv2Layer forward) records the grid."""
    torch.manual_seed(0)
    model = transformers.Swinv2ForImageClassification(
        transformers.Swinv2Config(**HF_ARGS, num_labels=3, drop_path_rate=0.0)
    )
    patch_model(model)
    grads = gradients_without_and_with_checkpointing(model, torch.randn(2, 3, 64, 64))
    assert grads[0].keys() == grads[1].keys() and any("residual_gate" in n for n in grads[0])
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6) for n in grads[0])
