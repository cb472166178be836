"""LLaVA-SP training stages on a tiny random LLaVA (CPU), the GPU recipes, and composition with VCA."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.paths import RECIPES
from vca_patch import VCAConfig, patch_model, unpatch_model
from vca_patch.core.errors import ConfigError
from vca_patch.formats.llava_sp import load_spatial_tokens, save_spatial_tokens
from vca_patch.targets.llava_sp import (
    SpatialTokensConfig,
    add_spatial_tokens,
    apply_stage2_lora,
    caption_batch,
    get_spatial_projector,
    remove_spatial_tokens,
    stage1_parameters,
    stage2_param_groups,
)
from vca_patch.targets.llava_sp.recipe import load_recipe, recipe_from_dict
from vca_patch.targets.llava_sp.tiny import IMAGE_TOKEN_ID, tiny_llava

pytest.importorskip("transformers")

RECIPES = RECIPES
SIZE = 24  # training runs: a 6×6 patch grid keeps CPU steps cheap (36 + 6 image tokens)


def _data(batch: int = 4, length: int = 6):
    g = torch.Generator().manual_seed(7)
    pixels = torch.randn(batch, 3, SIZE, SIZE, generator=g)
    captions = torch.randint(3, IMAGE_TOKEN_ID, (batch, length), generator=g)
    return pixels, captions


def _train(model, params, steps: int, lr: float) -> list[float]:
    pixels, captions = _data()
    inputs = caption_batch(model, captions, bos_token_id=1)
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    losses = []
    model.train()
    for _ in range(steps):
        loss = model(**inputs, pixel_values=pixels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_caption_batch_masks_the_prompt():
    model = tiny_llava(image_size=SIZE)
    add_spatial_tokens(model)
    _, captions = _data(2, 5)
    batch = caption_batch(model, captions, bos_token_id=1)
    assert batch["input_ids"].shape == (2, 1 + 42 + 5)
    assert int((batch["input_ids"] == IMAGE_TOKEN_ID).sum()) == 2 * 42
    assert (batch["labels"][:, :43] == -100).all() and torch.equal(batch["labels"][:, 43:], captions)


def test_stage1_only_the_projector_and_spatial_tokens_get_gradients():
    model = tiny_llava(image_size=SIZE)
    add_spatial_tokens(model, SpatialTokensConfig(variant="cropping"))
    params = stage1_parameters(model)
    pixels, captions = _data(2)
    model(**caption_batch(model, captions), pixel_values=pixels).loss.backward()
    projector = get_spatial_projector(model)
    trained = {id(p) for p in params}
    assert trained == {id(p) for p in projector.parameters()}
    spatial = {id(p) for p in projector.spatial_tokens.parameters()}
    assert spatial < trained and len(trained - spatial) == 4  # + linear_1/linear_2 weight and bias
    for name, p in model.named_parameters():
        if id(p) in trained:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None and not p.requires_grad, name


@pytest.mark.parametrize("variant", ["pooling", "cropping"])
def test_stage1_cpu_run_lowers_the_caption_loss(variant):
    model = tiny_llava(image_size=SIZE)
    add_spatial_tokens(model, SpatialTokensConfig(variant=variant))
    frozen = {k: v.clone() for k, v in model.state_dict().items() if "multi_modal_projector" not in k}
    losses = _train(model, stage1_parameters(model), steps=20, lr=1e-2)
    # random 100-token vocabulary: ln 100 = 4.6 at the start; a frozen random LM plateaus near 4.1
    assert losses[-1] < losses[0] - 0.25 and sum(losses[-5:]) < sum(losses[:5]), losses
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in frozen.items())  # nothing else moved


def test_stage2_lora_trains_the_language_model_only_then_merges_and_saves(tmp_path):
    pytest.importorskip("peft")
    model = tiny_llava(image_size=SIZE)
    add_spatial_tokens(model)
    peft_model = apply_stage2_lora(model, r=4, alpha=8, dropout=0.0)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable)
    assert all("language_model" in n for n in trainable if "lora_" in n)  # not the vision tower's q/k/v
    assert all("lora_" in n or "multi_modal_projector" in n for n in trainable)
    groups = stage2_param_groups(peft_model, lr=1e-2, projector_lr=1e-3)
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == len(trainable)
    losses = _train(peft_model, groups, steps=12, lr=1e-2)
    # the LoRA'd language model goes below the frozen-LM plateau of stage 1 (~4.1)
    assert losses[-1] < losses[0] - 0.5, losses

    merged = peft_model.merge_and_unload().eval()
    assert get_spatial_projector(merged) is not None
    inputs = caption_batch(merged, _data(1)[1], bos_token_id=1)
    with torch.no_grad():
        reference = merged(**inputs, pixel_values=_data(1)[0]).logits
    save_spatial_tokens(merged, tmp_path / "stage2")
    with torch.no_grad():
        again = load_spatial_tokens(tmp_path / "stage2")(**inputs, pixel_values=_data(1)[0]).logits
    assert torch.equal(again, reference)


@pytest.mark.parametrize("name", ["llava_sp_stage1.yaml", "llava_sp_stage2.yaml"])
def test_shipped_recipes_validate_and_state_a_gpu_budget(name):
    recipe = load_recipe(RECIPES / name)
    assert "GPU" in recipe.budget and recipe.base_model == "llava-hf/llava-1.5-7b-hf"
    assert recipe.spatial_tokens.num_tokens == 6
    if recipe.stage == "projector":
        assert recipe.optim.lr == 1e-3 and recipe.global_batch == 256 and recipe.lora is None
    else:
        assert (recipe.lora.r, recipe.lora.alpha) == (128, 256) and recipe.optim.projector_lr == 2e-5
        assert recipe.global_batch == 128


def test_recipe_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"recipe\.optim: unknown key 'lrr'; valid keys: \['epochs'"):
        recipe_from_dict({"name": "x", "stage": "projector", "budget": "b", "base_model": "m", "optim": {"lrr": 1}})
    with pytest.raises(ConfigError, match=r"recipe\.lora is required for stage 'lora'"):
        recipe_from_dict({"name": "x", "stage": "lora", "budget": "b", "base_model": "m"})


# ---- composition with VCA on the vision tower ----------------------------------------------------------------


def _logits(model, count: int) -> torch.Tensor:
    ids = torch.cat([torch.ones(1, 1, dtype=torch.long), torch.full((1, count), IMAGE_TOKEN_ID)], dim=1)
    with torch.no_grad():
        return model(
            input_ids=ids, pixel_values=torch.randn(1, 3, 48, 48, generator=torch.Generator().manual_seed(2))
        ).logits


def test_vca_on_the_vision_tower_composes_with_spatial_tokens_in_either_order():
    base = tiny_llava()
    original = _logits(base, 144)

    vca_first = copy.deepcopy(base)
    report = patch_model(vca_first.model.vision_tower, VCAConfig())
    assert len(report.patched) == 2  # both CLIP layers, CLS as the prefix token
    vca_only = _logits(vca_first, 144)
    add_spatial_tokens(vca_first, SpatialTokensConfig(variant="cropping"))

    sp_first = copy.deepcopy(base)
    add_spatial_tokens(sp_first, SpatialTokensConfig(variant="cropping"))
    patch_model(sp_first.model.vision_tower, VCAConfig())

    a, b = _logits(vca_first, 150), _logits(sp_first, 150)
    assert a.shape == (1, 151, 100)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the projector's patch outputs are those of the VCA tower, untouched by the spatial tokens
    pixels = torch.randn(1, 3, 48, 48)
    with torch.no_grad():
        features = vca_first.model.get_image_features(pixels).pooler_output[0]
        remove_spatial_tokens(vca_first)
        assert torch.equal(features[6:], vca_first.model.get_image_features(pixels).pooler_output[0])
    assert torch.equal(_logits(vca_first, 144), vca_only)
    # undo both, either order: the original model back, bit for bit
    remove_spatial_tokens(sp_first)
    unpatch_model(sp_first.model.vision_tower)
    unpatch_model(vca_first.model.vision_tower)
    assert torch.equal(_logits(sp_first, 144), original) and torch.equal(_logits(vca_first, 144), original)


@pytest.mark.parametrize("root", ["vision_tower", "whole model"])
def test_save_reload_keeps_a_vca_vision_tower_with_its_trained_tensors(tmp_path, root):
    import json

    model = tiny_llava()
    report = patch_model(model.model.vision_tower if root == "vision_tower" else model, VCAConfig(contrast_tokens=4))
    assert len(report.patched) == 2
    add_spatial_tokens(model)
    with torch.no_grad():  # "trained" VCA tensors: a fresh patch on reload would not reproduce them
        for name, p in model.named_parameters():
            if "lambda" in name or "contrast_embed" in name or "spatial_tokens" in name:
                p.add_(0.05 * torch.randn_like(p))
    reference = _logits(model, 150)
    folder = save_spatial_tokens(model, tmp_path / "sp")
    meta = json.loads((folder / "spatial_tokens.json").read_text())
    assert [r["path"] for r in meta["vision_patch"]] == ["model.vision_tower" if root == "vision_tower" else ""]
    loaded = load_spatial_tokens(folder)
    assert type(loaded.model.vision_tower.encoder.layers[1].self_attn).__name__ == "VisualContrastAttention"
    assert torch.equal(_logits(loaded, 150), reference)
    # a record that no longer matches what re-patching gives is refused, naming both
    meta["vision_patch"][0]["layers"].popitem()
    (folder / "spatial_tokens.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"re-applying the saved vca patch .* gave layers .* but the checkpoint has"):
        load_spatial_tokens(folder)
