"""VCA's contrast tokens on hierarchical models (PVT, Swin) are held to each stage's own token grid, by one rule that
`patch_model` and the CLI share: a count chosen past a stage's patches is refused whole, the stage default shrinks to
the largest square the grid holds."""

from __future__ import annotations

import pytest
import timm
import torch
from typer.testing import CliRunner

from vca_patch import VCAConfig, patch_model
from vca_patch.cli import app
from vca_patch.core.sizes import SizeError

runner = CliRunner()
PAST_STAGE_4 = [4, 9, 16, 64]  # pvt_v2_b0 at 224 px: stage grids 56, 28, 14 and 7 (49 patches)


def _small_swin() -> torch.nn.Module:
    """Four stages at 64 px: grids 16, 8, 4 (the last stage, 2x2, is left softmax by the family)."""
    torch.manual_seed(0)
    return timm.create_model(
        "swin_tiny_patch4_window7_224", pretrained=False, img_size=64, embed_dim=16, depths=[1, 1, 1, 1],
        num_heads=[1, 1, 2, 2], window_size=2,
    ).eval()  # fmt: skip


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor], classes: list[str]) -> bool:
    after = model.state_dict()
    same_weights = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    return same_weights and [type(m).__name__ for m in model.modules()] == classes


def test_stage_contrast_tokens_past_a_stage_grid_are_refused_and_nothing_changes():
    model = timm.create_model("pvt_v2_b0", pretrained=False).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m).__name__ for m in model.modules()]
    with pytest.raises(SizeError, match=r"stage_contrast_tokens \(stage 4, block 6\) 64 is more than the 7×7"):
        patch_model(model, VCAConfig(stage_contrast_tokens=PAST_STAGE_4))
    assert _unchanged(model, before, classes)


def test_layer_contrast_tokens_are_checked_at_their_stage_grid():
    model = _small_swin()
    with pytest.raises(SizeError, match=r"layer_contrast_tokens \(stage 3, block 2\) 25 is more than the 4×4"):
        patch_model(model, VCAConfig(layer_contrast_tokens={2: 25}))
    patch_model(model, VCAConfig(layer_contrast_tokens={2: 16}))  # the whole grid fits
    assert model.layers[2].blocks[0].attn.contrast_grid == (4, 4)


def test_the_stage_default_shrinks_to_the_stage_grid():
    report = patch_model(_small_swin(), VCAConfig())
    tokens = {site.path: site.settings["contrast_tokens"] for site in report.patched}
    # defaults 9, 16, 49: stage 3's 4x4 grid holds 16, not 49 (which would repeat its patches)
    assert tokens == {"layers.0.blocks.0.attn": 9, "layers.1.blocks.0.attn": 16, "layers.2.blocks.0.attn": 16}


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_the_cli_refuses_them_with_the_same_rule_in_one_line(tmp_path, command):
    args = [command, "pvt_v2_b0", "--stage-contrast-tokens", ",".join(map(str, PAST_STAGE_4))]
    if command == "convert":
        args += ["--no-pretrained", "-o", str(tmp_path / "out")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.output.startswith("error: stage_contrast_tokens (stage 4, block 6) 64 is more than the 7×7 patch")
    assert result.output.count("\n") == 1, result.output
    assert not (tmp_path / "out").exists()


def test_transformers_stages_are_checked_at_their_grids():
    import transformers

    config = transformers.PvtV2Config(
        hidden_sizes=[16, 32], depths=[1, 1], num_attention_heads=[1, 2], sr_ratios=[4, 2], num_encoder_blocks=2,
        patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2], image_size=64,
    )  # fmt: skip
    model = transformers.PvtV2Model(config).eval()  # stage grids 16x16 and 8x8
    with pytest.raises(SizeError, match=r"stage_contrast_tokens \(stage 2, block 1\) 81 is more than the 8×8"):
        patch_model(model, VCAConfig(stage_contrast_tokens=[4, 81]))
    report = patch_model(model, VCAConfig(stage_contrast_tokens=[4, 64]))
    assert [site.settings["contrast_tokens"] for site in report.patched] == [4, 64]
