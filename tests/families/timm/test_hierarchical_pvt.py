"""timm PVTv2: spatial-reduction attention converted with its reduction kept (SpatialReductionVCA)."""

from __future__ import annotations

import copy
import re

import pytest
import timm
import torch

import vca_patch
from tests.support.hierarchical import assert_unpatch_restores, randomise_vca
from tests.support.models import trained_a_little
from tests.support.reference.hierarchical import bilinear_upsample, reference_reduction_vca
from tests.support.reference.vca import reference_vca
from vca_patch import MANOConfig, NothingToPatchError, VCAConfig, patch_model
from vca_patch.core.errors import ConfigError
from vca_patch.layers.q_kv_view import QAndKV
from vca_patch.surgery import inspect_model, patched_layers
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.vca.reduced import SpatialReductionVCA


@pytest.fixture(scope="module")
def pvt() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("pvt_v2_b0", pretrained=False).eval()


def test_bilinear_reference_matches_pytorch():  # the reference's own building block, checked once
    grid = torch.randn(2, 3, 5, 4, dtype=torch.float64)
    expected = torch.nn.functional.interpolate(grid.permute(0, 3, 1, 2), size=(7, 11), mode="bilinear")
    assert torch.allclose(bilinear_upsample(grid, (7, 11)), expected.permute(0, 2, 3, 1), atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_reduction_layer_matches_the_float64_reference(pvt, dtype):
    model = copy.deepcopy(pvt)
    patch_model(model)
    layer = model.stages[0].blocks[0].attn  # sr 8, n = 9
    assert isinstance(layer, SpatialReductionVCA) and layer.sr.stride == (8, 8)
    torch.manual_seed(1)
    randomise_vca(layer)
    layer.to(dtype)
    grid = (16, 40)  # not square; keys 2x5, upsampled back to 16x40
    x = torch.randn(2, grid[0] * grid[1], layer.attn_dim, dtype=dtype)
    expected = reference_reduction_vca(layer, x, grid)
    tolerance = 4e-15 if dtype == torch.float64 else 4e-6  # measured 7e-16 / 8e-7
    with torch.no_grad():
        inference = layer(x, grid)  # float32: the composite path too (the fused kernel takes no reduced keys)
    x.requires_grad_()
    training = layer(x, grid)  # recomputed in backward
    for got in (inference, training):
        assert float((got.detach().double() - expected).abs().max() / expected.abs().max()) < tolerance
    training.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in (layer.sr.weight, layer.dwc.weight, x))


def test_last_stage_without_reduction_is_plain_vca(pvt):
    model = copy.deepcopy(pvt)
    patch_model(model)
    layer = model.stages[3].blocks[1].attn
    assert layer.sr is None and isinstance(layer.qkv, QAndKV)
    torch.manual_seed(2)
    randomise_vca(layer)
    layer.double()
    x = torch.randn(2, 5 * 6, layer.attn_dim, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x, (5, 6))
    state = layer.state_dict()
    fused = {f"qkv.{p}": torch.cat([state[f"q.{p}"], state[f"kv.{p}"]]) for p in ("weight", "bias")}
    shim = copy.deepcopy(layer)
    shim.state_dict = lambda: {**state, **fused}  # the reference reads a fused qkv
    expected = reference_vca(shim, x, 0, (5, 6))
    assert float((got - expected).abs().max() / expected.abs().max()) < 1e-12


def test_carried_modules_and_state_dict_keys_are_kept(pvt):
    model = copy.deepcopy(pvt)
    attn = model.stages[1].blocks[0].attn
    q, kv, sr, norm, proj = attn.q, attn.kv, attn.sr, attn.norm, attn.proj
    keys_before = set(model.state_dict())
    patch_model(model)
    layer = model.stages[1].blocks[0].attn
    assert (layer.q, layer.kv, layer.sr, layer.norm, layer.proj) == (q, kv, sr, norm, proj)
    new_keys = set(model.state_dict()) - keys_before
    assert keys_before <= set(model.state_dict())
    assert all(k.rsplit(".attn.", 1)[1].split(".")[0] in {"contrast_embed_pos", "contrast_embed_neg", "lambda1",
               "lambda2", "stage1_norm", "stage2_norm", "dwc", "stage2_temperature"} for k in new_keys)  # fmt: skip


def test_stage_tokens_and_global_lambda_index_are_recorded(pvt):
    model = copy.deepcopy(pvt)
    report = patch_model(model)
    layers = patched_layers(model)
    assert [v["layer_index"] for v in layers.values()] == list(range(8))  # 0..7 over the 4 stages
    assert [v["contrast_tokens"] for v in layers.values()] == [9, 9, 16, 16, 49, 49, 49, 49]
    assert [v["stage"] for v in layers.values()] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert layers["stages.2.blocks.1.attn"]["lambda_init"] == pytest.approx(0.8 - 0.6 * 2.718281828 ** (-1.5))
    assert layers["stages.0.blocks.0.attn"]["grid"] == "56x56, keys 7x7 (sr 8)"
    assert {v["mode"] for v in layers.values()} == {"reduction-kept"}
    assert all(s.exact_carry_over and s.verified for s in report.patched)
    # n per layer: 2nC + 10d + 10C + M (Stage-II temperature); b0: C = 32/64/160/256, heads 1/2/5/8.
    dims = [(32, 1, 9), (64, 2, 16), (160, 5, 49), (256, 8, 49)]
    assert report.params_added == sum(2 * (2 * n * c + 10 * c // m + 10 * c + m) for c, m, n in dims)

    other = copy.deepcopy(pvt)
    patch_model(other, VCAConfig(stage_contrast_tokens=[4, 4, 16, 25], layer_contrast_tokens={7: 1}))
    assert [v["contrast_tokens"] for v in patched_layers(other).values()] == [4, 4, 4, 4, 16, 16, 25, 1]
    with pytest.raises(ConfigError, match="no entry for stage 4"):
        inspect_model(pvt, VCAConfig(stage_contrast_tokens=[4, 9, 16]))


def test_forward_at_two_resolutions_uses_each_stages_grid(pvt):
    model = copy.deepcopy(pvt)
    patch_model(model)
    grids = []
    for module in model.modules():
        if isinstance(module, SpatialReductionVCA):
            module.register_forward_pre_hook(lambda m, args: grids.append(tuple(args[1])))
    with torch.no_grad():
        a = model(torch.randn(1, 3, 224, 224))
        b = model(torch.randn(2, 3, 160, 256))
    assert a.shape == (1, 1000) and b.shape == (2, 1000) and torch.isfinite(a).all() and torch.isfinite(b).all()
    assert sorted(set(grids)) == sorted({(56, 56), (28, 28), (14, 14), (7, 7), (40, 64), (20, 32), (10, 16), (5, 8)})


def test_unpatch_restores_bit_identically(pvt):
    model = copy.deepcopy(pvt)
    assert_unpatch_restores(model, torch.randn(1, 3, 96, 128))
    assert type(model.stages[0].blocks[0].attn).__name__ == "Attention"


def test_save_and_reload_round_trip(pvt, tmp_path):
    model = copy.deepcopy(pvt)
    patch_model(model, VCAConfig(stage_contrast_tokens=[4, 9, 16, 16]))
    trained_a_little(model, "contrast_embed", "dwc", "lambda", "sr.", "kv.")
    vca_patch.save_pretrained(model, tmp_path / "pvt")
    again = vca_patch.from_pretrained(tmp_path / "pvt")
    assert patched_layers(again) == patched_layers(model)
    x = torch.randn(1, 3, 128, 96)
    with torch.no_grad():
        assert torch.equal(again(x), model.eval()(x))


def test_linear_attention_models_are_skipped_with_the_reason():
    model = timm.create_model("pvt_v2_b0", pretrained=False, linear=True)
    with pytest.raises(NothingToPatchError, match="linear attention already"):
        inspect_model(model)


def test_a_module_the_reference_cannot_reproduce_is_skipped(pvt):
    model = copy.deepcopy(pvt)
    attn = model.stages[0].blocks[1].attn
    original = attn.forward
    attn.forward = lambda x, feat_size: original(x, feat_size) * 1.01
    report = inspect_model(model)
    assert "stages.0.blocks.1.attn" not in {s.path for s in report.patched}
    (skip,) = [s for s in report.skipped if s.path == "stages.0.blocks.1.attn"]
    assert "reference spatial-reduction attention differs" in skip.reason


def test_other_targets_are_refused_rather_than_built_around_half_the_attention(pvt):
    refused = (
        "PVT spatial-reduction attention is not plain softmax attention over one token grid: only a target that "
        "builds a variant for it takes it, not MultipoleAttention (targets that do: vca)"
    )
    with pytest.raises(NothingToPatchError, match=re.escape(refused)):
        inspect_model(pvt, MANOConfig())


def test_new_config_fields_round_trip_and_validate():
    config = VCAConfig(stage_contrast_tokens=[4, 9, 16, 49], swin_mode="global")
    assert TargetConfig.from_json(config.to_json()) == config
    for kwargs, message in [
        ({"stage_contrast_tokens": [4, 8]}, "perfect squares"),
        ({"stage_contrast_tokens": []}, "perfect squares"),
        ({"swin_mode": "window"}, "'residual' or 'global'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            VCAConfig(**kwargs)
