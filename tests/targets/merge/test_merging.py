"""Token merging (ToMe) as a surgery target: against a loop-by-loop float64 reference written from the paper."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.support.merging import hf_dinov2, hf_parts, reference_image, timm_parts, timm_reference, timm_vit
from vca_patch import patch_model, unpatch_model
from vca_patch.core.errors import ConfigError
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.merge import MergeConfig, MergingAttention
from vca_patch.targets.vca.layer import VisualContrastAttention


@pytest.mark.parametrize("batch", [1, 2])  # batch 1 takes its own row-index path (`matching._flat_rows`)
@pytest.mark.parametrize("unmerge", ["residual", "copy"])
def test_merging_matches_the_float64_reference_and_keeps_layerscale(unmerge, batch):
    model = timm_vit()
    images = torch.randn(batch, 3, 56, 56, dtype=torch.float64)
    schedule = [3, 2, 4, 1]
    reference = timm_reference(model, images, schedule, unmerge=unmerge)
    with torch.no_grad():
        original = model.forward_features(images)
        patch_model(model, MergeConfig(schedule=schedule, unmerge=unmerge))
        merged = model.forward_features(images)
    assert merged.shape == original.shape  # unmerged: every patch token is back
    error = (merged - reference).abs().max().item()
    assert error < 1e-10, error  # measured ~1e-15
    assert (merged - original).abs().max() > 1e-3  # merging really happened (16 patches, 10 merged)
    kept = model.blocks[0].forward.state.kept
    assert kept == [17 - 3, 14 - 2, 12 - 4, 8 - 1]


def test_r_zero_is_the_original_and_unpatch_is_bit_identical():
    model = timm_vit()
    images = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        original = model.forward_features(images)
        patch_model(model, MergeConfig(r=0))
        torch.testing.assert_close(model.forward_features(images), original, rtol=0, atol=1e-12)
        unpatch_model(model)
        patch_model(model, MergeConfig(r=4))
        assert list(model.state_dict()) == list(state)  # same keys while patched
        assert isinstance(model.blocks[1].attn, MergingAttention)
        unpatch_model(model)
        assert torch.equal(model.forward_features(images), original)
    assert all("forward" not in block.__dict__ for block in model.blocks)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_copies_of_a_merging_model_run_on_their_own_blocks():
    model = timm_vit(depth=2)
    images = torch.randn(1, 3, 56, 56, dtype=torch.float64)
    patch_model(model, MergeConfig(r=3))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.blocks[1].mlp.fc2.weight.zero_()
        assert not torch.equal(twin.forward_features(images), model.forward_features(images))
    assert twin.blocks[0].forward.block is twin.blocks[0]


def test_transformers_dinov2_matches_the_reference():
    model = hf_dinov2()
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.layer_scale1.lambda1.uniform_(0.2, 1.5)
    images = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    schedule = [4, 3, 2]
    with torch.no_grad():
        original = model(pixel_values=images)
        x = model.embeddings(images)
        parts = [hf_parts(layer) for layer in model.encoder.layer]
        reference = model.layernorm(torch.stack([reference_image(t, parts, schedule, 1, "residual") for t in x]))
        patch_model(model, MergeConfig(schedule=schedule, unmerge="residual"))
        merged = model(pixel_values=images)
    assert merged.last_hidden_state.shape == original.last_hidden_state.shape
    error = (merged.last_hidden_state - reference).abs().max().item()
    assert error < 1e-10, error
    torch.testing.assert_close(merged.pooler_output, reference[:, 0], rtol=0, atol=1e-10)
    unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(pixel_values=images).last_hidden_state, original.last_hidden_state)


def test_vca_before_the_first_merge_composes():
    model = timm_vit()
    images = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    schedule = [0, 0, 3, 2]
    config = MergeConfig(schedule=schedule, vca_layers={0: 4, 1: 4}, vca={"prefix_readout": "exact"})
    patch_model(model, config)
    assert isinstance(model.blocks[0].attn, VisualContrastAttention)
    assert isinstance(model.blocks[2].attn, MergingAttention)
    with torch.no_grad():
        merged = model.forward_features(images)
        reference = timm_reference(model, images, schedule, vca_blocks=2)
    assert (merged - reference).abs().max().item() < 1e-10
    unpatch_model(model)
    assert all(type(b.attn).__name__ == "Attention" for b in model.blocks)


def test_vca_after_a_merge_is_refused_with_the_rule():
    with pytest.raises(ConfigError, match=r"VCA needs the patch grid.*block 1.*\[2\]"):
        MergeConfig(schedule=[0, 2, 2, 2], vca_layers={0: 4, 2: 4})
    with pytest.raises(ConfigError, match="before the first block that merges"):
        MergeConfig(r=2, vca_layers={1: 4})


def test_a_plan_for_another_model_is_refused_and_nothing_changes():
    model = timm_vit(depth=2)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    plan = MergeConfig(r=2, expect={"depth": 12, "dim": 384, "num_heads": 6})
    with pytest.raises(ConfigError, match=r"made for a model with.*depth"):
        patch_model(model, plan)
    with pytest.raises(ConfigError, match="schedule gives r for 3 blocks; this model has 2"):
        patch_model(model, MergeConfig(schedule=[1, 1, 1]))
    assert all("forward" not in b.__dict__ for b in model.blocks) and type(model.blocks[0].attn).__name__ == "Attention"
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_unknown_blocks_and_masks_are_refused():
    from timm.models.vision_transformer import ResPostBlock, VisionTransformer

    post_norm = VisionTransformer(img_size=28, patch_size=14, embed_dim=32, depth=2, num_heads=2, block_fn=ResPostBlock)
    with pytest.raises(ConfigError, match="token merging knows the blocks of"):
        patch_model(post_norm, MergeConfig(r=1))
    assert "forward" not in post_norm.blocks[0].__dict__
    model = timm_vit(depth=2)
    patch_model(model, MergeConfig(r=1))
    x = torch.randn(1, 17, 64, dtype=torch.float64)
    with pytest.raises(ValueError, match="no attention mask"):
        model.blocks[0](x, attn_mask=torch.zeros(1, 1, 17, 17, dtype=torch.float64))


def test_config_json_round_trip_and_validation():
    config = MergeConfig(schedule=[0, 2, 4], vca_layers={0: 9}, vca={"token_magnitude": True})
    again = TargetConfig.from_json(config.to_json())
    assert again == config and isinstance(again, MergeConfig)
    for bad, match in [
        ({"r": -1}, "r must be"),
        ({"schedule": [1, "2"]}, "schedule must be"),
        ({"vca_layers": {0: 5}}, "perfect square"),
        ({"vca": {"contrast_tokens": 4}}, "vca takes VCAConfig options"),
        ({"expect": {"depth": 2}}, "expect must give"),
        ({"unmerge": "average"}, "unmerge must be one of"),
    ]:
        with pytest.raises(ConfigError, match=match):
            MergeConfig(**bad)


def test_unmerge_defaults_to_tomes_copy_and_round_trips():
    assert MergeConfig().unmerge == "copy"
    residual = MergeConfig(r=3, unmerge="residual")
    assert TargetConfig.from_json(residual.to_json()) == residual
    saved_before = {k: v for k, v in residual.to_dict().items() if k != "unmerge"}  # a file from before the option
    assert TargetConfig.from_dict(saved_before).unmerge == "copy"


def test_residual_unmerge_changes_patch_tokens_only():
    model = timm_vit()
    images = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    outputs = {}
    for unmerge in ("copy", "residual"):
        twin = copy.deepcopy(model)
        patch_model(twin, MergeConfig(r=3, unmerge=unmerge))
        with torch.no_grad():
            outputs[unmerge] = twin.forward_features(images)
        assert twin.blocks[0].forward.state.steps == []  # the per-forward state is dropped at the unmerge
    assert torch.equal(outputs["copy"][:, 0], outputs["residual"][:, 0])
    assert (outputs["copy"][:, 1:] - outputs["residual"][:, 1:]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_models_merge_and_unmerge_in_their_dtype(dtype):
    model = timm_vit().float()
    images = torch.randn(2, 3, 56, 56)
    with torch.no_grad():
        patch_model(model, MergeConfig(r=3, unmerge="residual"))
        full = model.forward_features(images)
        half = model.to(dtype).forward_features(images.to(dtype))
    assert half.dtype == dtype and half.shape == full.shape and torch.isfinite(half).all()
    cosine = torch.nn.functional.cosine_similarity(half.float(), full, dim=-1)
    assert cosine.min() > 0.995, cosine.min()  # measured 0.9999: rounding only


def test_residual_unmerge_gradients_match_the_reference():
    """Training through merging blocks: gradients of the residual unmerge (in-place writes at inference, repeated B
    tokens counted once) are the float64 reference's."""
    model = timm_vit(depth=3)
    images = torch.randn(2, 3, 56, 56, dtype=torch.float64)
    schedule = [4, 3, 3]
    weights = torch.randn(2, 17, 64, dtype=torch.float64)
    x = model.norm_pre(model._pos_embed(model.patch_embed(images)))
    parts = [timm_parts(b) for b in model.blocks]
    reference = model.norm(torch.stack([reference_image(t, parts, schedule, 1, "residual") for t in x]))
    (reference * weights).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    patch_model(model, MergeConfig(schedule=schedule, unmerge="residual"))
    (model.forward_features(images) * weights).sum().backward()
    for param, grad in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(param.grad, grad, rtol=1e-9, atol=1e-10)
