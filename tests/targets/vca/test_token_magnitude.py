"""Per-token output magnitude (VCAConfig.token_magnitude) and free-running calibration (calibrate(inputs=...)).

The layer math is checked against the float64 reference of tests/reference_vca.py with the gain applied by hand;
the calibration steps on a random-weight timm ViT; the fidelity gain on the real DINOv2 weights (skipped when
they are not cached and the registry cannot be reached, as in tests/test_real_weights.py).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

import vca_patch
from tests.support.real_weights import load_dinov2_or_skip, quick_cosines
from tests.support.reference.vca import reference_vca
from tests.support.vca import randomised
from vca_patch.core.errors import ConfigError
from vca_patch.layers.layout import TokenLayout
from vca_patch.recovery import calibrate
from vca_patch.recovery.calibrate import _converted_inputs
from vca_patch.recovery.capture import capture_original_layers, patched_modules
from vca_patch.targets.handler import handler_for
from vca_patch.targets.vca import fused_cpu
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.layer import VisualContrastAttention

timm = pytest.importorskip("timm")


def _with_gain(readout: str, dtype: torch.dtype = torch.float64) -> VisualContrastAttention:
    module = randomised(
        VisualContrastAttention(
            24, 3, contrast_grid=(2, 2), layer_index=3, prefix_readout=readout, token_magnitude=True
        )
    ).to(dtype)
    with torch.no_grad():
        module.token_gain.weight.normal_(0.0, 0.2)
        module.token_gain.bias.normal_(0.0, 0.3)
    return module


def _expected(module: VisualContrastAttention, x: torch.Tensor, prefix: int, grid: tuple[int, int]) -> torch.Tensor:
    """float64: the reference's pre-projection output, Stage-II rows times exp(W·x + b) per head, then proj."""
    bare = copy.deepcopy(module).double()
    with torch.no_grad():
        bare.proj.weight.copy_(torch.eye(24, dtype=torch.float64))
        bare.proj.bias.zero_()
    o = reference_vca(bare, x, prefix, grid)  # [B, N, C] before the projection
    start = prefix if module.prefix_readout == "exact" else 0
    w, b = module.token_gain.weight.detach().double(), module.token_gain.bias.detach().double()
    gain = torch.exp(x.double()[:, start:] @ w.T + b)  # [B, N', M]
    B, N, _ = o.shape
    o[:, start:] = (o[:, start:].view(B, N - start, 3, 8) * gain.unsqueeze(-1)).view(B, N - start, 24)
    return o @ module.proj.weight.detach().double().T + module.proj.bias.detach().double()


@pytest.mark.parametrize("readout", ["exact", "contrast"])
def test_gain_matches_float64_reference(readout):
    module = _with_gain(readout)
    x = torch.randn(2, 2 + 20, 24, dtype=torch.float64)
    layout = TokenLayout(2, (4, 5))
    expected = _expected(module, x, 2, (4, 5))
    torch.testing.assert_close(module(x, layout=layout), expected, rtol=1e-10, atol=1e-10)
    # With autograd (out-of-place path) the same, and the gain's parameters get a gradient.
    out = module(x.clone().requires_grad_(), layout=layout)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    out.square().sum().backward()
    assert module.token_gain.weight.grad.abs().sum() > 0


@pytest.mark.skipif(not fused_cpu.kernel_available(), reason=f"kernel: {fused_cpu.kernel_status()}")
@pytest.mark.parametrize("readout", ["exact", "contrast"])
def test_fused_kernel_applies_the_gain(readout):
    module = _with_gain(readout, torch.float32)
    x = torch.randn(2, 1 + 36, 24)
    with torch.no_grad():
        assert module._fused_kernel_usable(x)
        got = module(x, layout=TokenLayout(1, (6, 6)))
    expected = _expected(module, x, 1, (6, 6))
    err = float((got.double() - expected).abs().max())
    assert err < 1e-4, err  # measured ~1e-6 (float32)


def test_zero_gain_is_the_plain_layer():
    """A freshly built (or reset) gain is exp(0) = 1: the same output as the layer without the option."""
    plain = randomised(VisualContrastAttention(24, 3, contrast_grid=(2, 2), layer_index=1)).double()
    gained = VisualContrastAttention(24, 3, contrast_grid=(2, 2), layer_index=1, token_magnitude=True).double()
    gained.load_state_dict(plain.state_dict(), strict=False)
    assert set(gained.state_dict()) - set(plain.state_dict()) == {"token_gain.weight", "token_gain.bias"}
    x = torch.randn(2, 1 + 16, 24, dtype=torch.float64)
    layout = TokenLayout(1, (4, 4))
    torch.testing.assert_close(gained(x, layout=layout), plain(x, layout=layout), rtol=0, atol=0)
    assert "token_magnitude=True" in repr(gained)


def test_config_option_validates_and_round_trips():
    with pytest.raises(ConfigError, match="token_magnitude"):
        VCAConfig(token_magnitude="yes")
    config = VCAConfig(token_magnitude=True)
    assert VCAConfig.from_json(config.to_json()) == config


def _tiny_vit() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(
        "vit_tiny_patch16_224", pretrained=False, img_size=64, depth=3, num_classes=0, global_pool="token"
    ).eval()


def test_calibrate_fits_the_gain_and_it_lowers_the_error():
    model = _tiny_vit()
    vca_patch.patch_model(model, VCAConfig(contrast_tokens=4, token_magnitude=True))
    images = [torch.randn(8, 3, 64, 64, generator=torch.Generator().manual_seed(1))]
    report = calibrate(model, images)
    assert report.steps[-2:] == ["magnitude", "refit"]  # magnitude_rounds=2: norm, conv and gain fitted again
    for layer in report.layers:
        assert layer.errors["magnitude"] < layer.errors["dwc"]
        assert layer.errors["refit"] < layer.errors["dwc"]
    gains = [m.token_gain for m in patched_modules(model).values()]
    assert all(g.weight.abs().sum() > 0 for g in gains)
    # Without the option, or with magnitude=False, the step does not run.
    plain = _tiny_vit()
    vca_patch.patch_model(plain, VCAConfig(contrast_tokens=4, token_magnitude=False))
    assert "magnitude" not in calibrate(plain, images).steps
    with pytest.raises(ValueError, match="magnitude_rounds"):
        calibrate(plain, images, magnitude_rounds=0)
    with pytest.raises(ValueError, match="inputs"):
        calibrate(plain, images, inputs="student")


def test_converted_inputs_equal_teacher_inputs_for_the_first_layer_and_differ_after():
    images = [torch.randn(4, 3, 64, 64, generator=torch.Generator().manual_seed(2))]
    teacher, free = _tiny_vit(), _tiny_vit()
    for model in (teacher, free):
        vca_patch.patch_model(model, VCAConfig(contrast_tokens=4, token_magnitude=True))
    torch.manual_seed(3)  # e₋'s noise
    a = calibrate(teacher, images)
    torch.manual_seed(3)
    b = calibrate(free, images, inputs="converted")
    first_a, first_b = (next(iter(patched_modules(m).values())) for m in (teacher, free))
    for key, value in first_a.state_dict().items():  # block 0 sees the same input either way
        torch.testing.assert_close(first_b.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    assert a.layers[0].errors == pytest.approx(b.layers[0].errors, rel=1e-4)
    # Later blocks: the converted model's input to the last block is not the original's.
    last = list(patched_modules(free))[-1]
    original = capture_original_layers(free, images)[last].inputs
    converted = _converted_inputs(free, last, images)
    assert converted.shape == original.shape
    assert float((converted - original).norm() / original.norm()) > 1e-3


# --- real weights -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dinov2():
    return load_dinov2_or_skip()


def test_token_magnitude_lifts_real_weight_fidelity(dinov2):
    """The quick real-weights setting (112 px): calibrated on 4 crops of the calibration photos, measured on the
    held-out evaluation photos; restoring per-token magnitudes raises both CLS and per-patch-token cosine."""
    before, after = quick_cosines(dinov2, token_magnitude=False), quick_cosines(dinov2, token_magnitude=True)
    # Measured (CLS, patch): (0.803, 0.683) -> (0.841, 0.748).
    assert after[0] > before[0] + 0.02, (before, after)
    assert after[1] > before[1] + 0.03, (before, after)


@pytest.mark.parametrize(
    ("config", "saved"),
    [(VCAConfig(), True), (VCAConfig(init="paper"), False), (VCAConfig(token_magnitude=False), False)],
    ids=["auto-preserve", "auto-paper", "explicit-off"],
)
def test_checkpoint_saves_the_built_choice_not_auto(tmp_path, config, saved):
    """A checkpoint records whether the layers got the gain, so a later default cannot rebuild them otherwise."""
    model, requested = _tiny_vit(), config.token_magnitude
    vca_patch.patch_model(model, config)
    vca_patch.save_pretrained(
        model, tmp_path / "ckpt", model_args={"img_size": 64, "depth": 3, "num_classes": 0, "global_pool": "token"}
    )
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())["config"]
    assert written["token_magnitude"] is saved
    assert config.token_magnitude is requested  # the caller's config is left as it was
    reloaded = vca_patch.from_pretrained(tmp_path / "ckpt")
    gains = [m.token_gain is not None for m in reloaded.modules() if isinstance(m, VisualContrastAttention)]
    assert gains == [saved] * 3


def test_hierarchical_stages_save_the_gain_as_off():
    model = timm.create_model(
        "swin_tiny_patch4_window7_224",
        pretrained=False,
        img_size=64,
        window_size=4,
        depths=(1, 1),
        embed_dim=24,
        num_heads=(1, 2),
        num_classes=0,
    ).eval()
    vca_patch.patch_model(model, VCAConfig(stage_contrast_tokens=[4, 1]))
    assert handler_for(VCAConfig).as_built(VCAConfig(), model).token_magnitude is False


def test_a_merge_plan_saves_its_vca_blocks_gain_as_built(tmp_path):
    from vca_patch.targets.merge import MergeConfig

    model = _tiny_vit()
    config = MergeConfig(schedule=[0, 2, 2], vca_layers={0: 4})  # vca options left automatic
    vca_patch.patch_model(model, config)
    vca_patch.save_pretrained(
        model, tmp_path / "ckpt", model_args={"img_size": 64, "depth": 3, "num_classes": 0, "global_pool": "token"}
    )
    written = json.loads((tmp_path / "ckpt" / "config.json").read_text())["config"]
    assert written["vca"] == {"token_magnitude": True} and config.vca == {}
    reloaded = vca_patch.from_pretrained(tmp_path / "ckpt")
    assert [m.token_gain is not None for m in reloaded.modules() if isinstance(m, VisualContrastAttention)] == [True]
