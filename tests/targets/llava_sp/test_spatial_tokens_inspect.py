"""`vca-patch inspect` on LLaVA models: the projector surgery (--to llava-sp) beside the vision-tower sites, and
the dry-run plan behind it, on the tiny model and on LLaVA-1.5-7B's shapes (meta device, nothing downloaded)."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from vca_patch import VCAConfig, patch_model
from vca_patch.cli import app
from vca_patch.formats.llava_sp import save_spatial_tokens
from vca_patch.targets.llava_sp import SpatialTokensConfig, add_spatial_tokens
from vca_patch.targets.llava_sp.plan import plan_spatial_tokens, projector_rows
from vca_patch.targets.llava_sp.tiny import tiny_llava

pytest.importorskip("transformers")

# tiny_llava: CLIP width C = 32 -> hidden h = 16, LM width D = 64, 12×12 grid, views k = 2, 4, ..., 12
C, H, D, SIDES = 32, 16, 64, [2, 4, 6, 8, 10, 12]
POOLING = C * H * sum(k * k for k in SIDES) + H * D
DETAIL = C * H * 8 * 8  # detail conv: kernel 12 - 4·1 = 8, stride 1
CROPPING = C * H * sum(k * k for k in SIDES) + DETAIL + 3 * (2 * H + H * H + H) + 2 * H * D + D


def _inspect(target: str) -> str:
    result = CliRunner().invoke(app, ["inspect", target], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


def _row(output: str, variant: str) -> list[str]:
    line = next(line for line in output.splitlines() if re.search(rf"multi_modal_projector\s+{variant}\s", line))
    return line.split()


def test_inspect_of_a_llava_lists_the_vision_sites_and_what_each_variant_would_add(tmp_path):
    tiny_llava().save_pretrained(tmp_path / "llava")
    output = _inspect(str(tmp_path / "llava"))
    assert "model.vision_tower.encoder.layers.0" in output and "model.vision_tower.encoder.layers.1" in output
    assert "Projector surgery (LLaVA-SP spatial tokens)" in output
    pooling, cropping = _row(output, "pooling"), _row(output, "cropping")
    assert pooling[:6] == ["model.multi_modal_projector", "pooling", "6", f"{POOLING:,}", "144", "→"]
    assert cropping[:6] == ["model.multi_modal_projector", "cropping", "6", f"{CROPPING:,}", "144", "→"]
    assert pooling[6] == cropping[6] == "150"
    assert "`--to llava-sp --spatial-variant cropping` would add (grid 12×12)" in output


def test_inspect_of_a_converted_folder_shows_the_added_tokens_and_the_saved_vca_tower(tmp_path):
    model = tiny_llava()
    patch_model(model.model.vision_tower, VCAConfig(contrast_tokens=4))
    add_spatial_tokens(model, SpatialTokensConfig(variant="cropping"))
    save_spatial_tokens(model, tmp_path / "sp")
    output = _inspect(str(tmp_path / "sp"))
    assert "model.vision_tower.encoder.layers.0" in output  # the sites table is still there
    row = _row(output, "cropping")
    assert row[:7] == ["model.multi_modal_projector", "cropping", "6", f"{CROPPING:,}", "144", "→", "150"]
    assert "added (spatial_tokens.json); vision tower: VCA on 2 layers (saved)" in " ".join(output.split())
    assert not re.search(r"multi_modal_projector\s+pooling", output)  # no would-add rows for a converted folder


def test_inspect_of_a_non_llava_model_has_no_projector_section():
    assert "Projector surgery" not in _inspect("deit_tiny_patch16_224")


def test_plan_matches_add_spatial_tokens_and_changes_nothing():
    model = tiny_llava()
    keys = list(model.state_dict())
    for variant in ("pooling", "cropping"):
        config = SpatialTokensConfig(variant=variant, num_tokens=3)
        plan = plan_spatial_tokens(model, config)
        assert list(model.state_dict()) == keys and model.config.image_seq_length == 144
        applied = add_spatial_tokens(tiny_llava(), config)
        assert plan == applied
    assert plan_spatial_tokens(model).added_parameters == POOLING  # the default: pooling, 6 tokens
    add_spatial_tokens(model)
    assert projector_rows(model)[0]["action"] == "added" and projector_rows(model)[0]["image_tokens"] == "144 → 150"


def test_plan_on_llava_1_5_7b_shapes_gives_the_papers_parameter_counts():
    """CLIP ViT-L/14-336 (1024 wide, 24×24 patches) + a 4096-wide LLM, built on the meta device from configs."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(
        hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
        image_size=336, patch_size=14, projection_dim=768,
    )  # fmt: skip
    text = LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1, num_attention_heads=32)
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_seq_length=576))
    convs = 1024 * 512 * sum(k * k for k in (4, 8, 12, 16, 20, 24))
    pooling = plan_spatial_tokens(model, SpatialTokensConfig(variant="pooling"))
    assert pooling.grid == 24 and (pooling.image_tokens_before, pooling.image_tokens_after) == (576, 582)
    assert pooling.added_parameters == convs + 512 * 4096 == 765_460_480
    cropping = plan_spatial_tokens(model, SpatialTokensConfig(variant="cropping"))
    qkv = 3 * (2 * 512 + 512 * 512 + 512)
    assert cropping.added_parameters == convs + 1024 * 512 * 16 * 16 + qkv + 1024 * 4096 + 4096 == 902_570_496


def test_a_llava_next_gets_a_refusal_row_with_the_reason():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    config = LlavaNextConfig(
        vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                       num_attention_heads=2, image_size=32, patch_size=8),
        text_config=LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                vocab_size=100),
        image_token_index=99, image_grid_pinpoints=[[32, 32]],
    )  # fmt: skip
    with torch.device("meta"):
        rows = projector_rows(LlavaNextForConditionalGeneration(config))
    assert len(rows) == 1 and rows[0]["action"].startswith("refuse: ") and "any resolution" in rows[0]["action"]
