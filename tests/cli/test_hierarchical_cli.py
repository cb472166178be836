"""The CLI on hierarchical models: `fidelity` on converted Swin/PVTv2 checkpoints, and the Swin/PVT options of
`convert` and `inspect` (refused with one clear line for targets they do not apply to)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import timm
import torch
import transformers
from PIL import Image
from typer.testing import CliRunner

from vca_patch import VCAConfig, patch_model, save_pretrained
from vca_patch.cli import app

runner = CliRunner()
SWIN_ARGS = {"img_size": 64, "embed_dim": 16, "depths": [2, 2, 2], "num_heads": [1, 2, 4], "window_size": 4,
             "num_classes": 5}  # fmt: skip
HF_PVT = {"hidden_sizes": [16, 32], "depths": [1, 2], "num_attention_heads": [1, 2], "sr_ratios": [4, 2],
          "num_encoder_blocks": 2, "patch_sizes": [7, 3], "strides": [4, 2], "mlp_ratios": [2, 2],
          "image_size": 64, "num_labels": 3}  # fmt: skip
EXACT_ROUNDING = 1e-6  # residual Swin at init (measured 1.2e-7 in float32)
REFUSED = "is not plain softmax attention over one token grid: only a target that builds a variant for it takes it"


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """An ImageFolder 'test' split of 8 random 64x64 RGB images in two classes."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(8):
        folder = root / "test" / f"class_{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return root


def _fidelity(checkpoint, images, out) -> dict:
    args = ["fidelity", str(checkpoint), "--data", str(images), "--data-kind", "imagefolder", "--limit", "8",
            "--batch-size", "4", "--device", "cpu", "--json", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "teacher-forced" in result.output
    return json.loads(out.read_text())


def test_fidelity_of_a_residual_swin_checkpoint_is_exact_at_init(tmp_path, images):
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **SWIN_ARGS).eval()
    patch_model(model, VCAConfig(stage_contrast_tokens=[4, 4, 4]))
    save_pretrained(model, tmp_path / "swin", model_args=SWIN_ARGS)
    report = _fidelity(tmp_path / "swin", images, tmp_path / "swin.json")
    assert report["num_images"] == 8 and len(report["layer_error"]) == 4  # stages 1-2; the last stays windowed
    assert all(0 <= e < EXACT_ROUNDING for e in report["layer_error"] + report["layer_error_free"])
    assert report["top1_agreement"] == 1.0


def test_fidelity_of_a_pvt_v2_checkpoint_gives_finite_per_layer_errors(tmp_path, images):
    torch.manual_seed(0)
    model = transformers.PvtV2ForImageClassification(transformers.PvtV2Config(**HF_PVT)).eval()
    patch_model(model, VCAConfig(stage_contrast_tokens=[4, 9]))
    save_pretrained(model, tmp_path / "pvt")
    report = _fidelity(tmp_path / "pvt", images, tmp_path / "pvt.json")
    assert len(report["layer_error"]) == 3  # stage 2's blocks have their own 8x8 grid (keys 4x4)
    assert all(math.isfinite(e) and e > 0 for e in report["layer_error"])
    assert report["layer_error"][0] == pytest.approx(report["layer_error_free"][0], rel=1e-6)  # the same input


def test_convert_takes_the_pvt_mode_and_per_stage_contrast_tokens(tmp_path):
    out = tmp_path / "pvt"
    args = ["convert", "pvt_v2_b0", "--no-pretrained", "--pvt-mode", "paper", "--stage-contrast-tokens", "4,9,16,16",
            "--device", "cpu", "-o", str(out)]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "config.json").read_text())
    assert saved["config"]["pvt_mode"] == "paper" and saved["config"]["stage_contrast_tokens"] == [4, 9, 16, 16]
    layers = saved["layers"]
    assert [layers[f"stages.{i}.blocks.0.attn"]["contrast_tokens"] for i in range(4)] == [4, 9, 16, 16]
    assert layers["stages.0.blocks.0.attn"]["mode"] == "reduction-dropped"


def test_inspect_takes_the_swin_mode(tmp_path):
    result = runner.invoke(app, ["inspect", "swin_tiny_patch4_window7_224", "--swin-mode", "global",
                                 "--stage-contrast-tokens", "4,9,16,16"], env={"COLUMNS": "200"})  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "swin_mode='global'" in result.output and "contrast_tokens=16" in result.output


@pytest.mark.parametrize("command", ["convert", "inspect"])
@pytest.mark.parametrize(
    ("option", "value"), [("--swin-mode", "global"), ("--pvt-mode", "paper"), ("--stage-contrast-tokens", "4,4,4,4")]
)
def test_vca_only_options_are_refused_for_mano(tmp_path, command, option, value):
    args = [command, "pvt_v2_b0", "--to", "mano", option, value]
    if command == "convert":
        args += ["--no-pretrained", "-o", str(tmp_path / "out")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert f"{option} is for --to vca, not --to mano; drop it" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("9,x", "error: --stage-contrast-tokens '9,x' is not a comma-separated list of integers; use e.g. 9,16,49,49"),
        ("4,8", "error: stage_contrast_tokens must be a list of positive perfect squares, got [4, 8]"),
    ],
)
@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_bad_stage_contrast_tokens_are_one_clear_line(tmp_path, command, value, message):
    args = [command, "pvt_v2_b0", "--stage-contrast-tokens", value]
    if command == "convert":
        args += ["--no-pretrained", "-o", str(tmp_path / "out")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.output.startswith(message) and result.output.count("\n") == 1, result.output
    assert not (tmp_path / "out").exists()


def test_mano_on_pvt_is_refused_per_site_with_its_reason():
    result = runner.invoke(app, ["inspect", "pvt_v2_b0", "--to", "mano"])
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert "no replacement could be built" in text
    refused = f"PVT spatial-reduction attention {REFUSED}, not MultipoleAttention (targets that do: vca)"
    assert text.count(refused) == 8
