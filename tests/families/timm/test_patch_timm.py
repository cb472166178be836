import copy

import pytest
import timm
import torch

import vca_patch
from tests.support.models import tiny
from vca_patch import NothingToPatchError, PatchError, VCAConfig, VisualContrastAttention, patch_model, unpatch_model
from vca_patch.core.errors import ConfigError
from vca_patch.families.timm.vit import TimmViTAdapter
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.vca import VCAHandler


def _layouts_seen(model):
    seen = []
    for module in model.modules():
        if isinstance(module, VisualContrastAttention):
            original = module.forward

            def spy(x, *args, _orig=original, _module=module, **kwargs):
                seen.append(_module.layout_source())
                return _orig(x, *args, **kwargs)

            module.forward = spy
    return seen


def test_deit_tiny_gains_the_papers_parameter_count():
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False)
    paper = VCAConfig(prefix_readout="contrast", stage2_temperature=False, token_magnitude=False)  # the paper's layer
    report = patch_model(model, paper)
    assert len(report.patched) == 12 and not report.skipped
    assert report.params_added == 256_512  # paper: 5.7 M -> 6.0 M
    default = timm.create_model("deit_tiny_patch16_224", pretrained=False)
    # + a Stage-II temperature per head, + the per-token gain (C x M weights, M biases) per layer
    assert patch_model(default).params_added == 256_512 + 12 * 3 + 12 * (192 * 3 + 3)
    assert [round(s.settings["lambda_init"], 3) for s in report.patched][:3] == [0.2, 0.356, 0.471]
    assert all(isinstance(b.attn, VisualContrastAttention) for b in model.blocks)


def test_carries_qkv_and_proj_objects():
    model, _ = tiny()
    qkv, proj = model.blocks[1].attn.qkv, model.blocks[1].attn.proj
    patch_model(model)
    assert model.blocks[1].attn.qkv is qkv and model.blocks[1].attn.proj is proj
    assert "blocks.1.attn.qkv.weight" in model.state_dict()


@pytest.mark.parametrize(
    ("name", "kwargs", "prefix"),
    [
        ("deit_tiny_patch16_224", {}, 1),
        ("deit_tiny_distilled_patch16_224", {}, 2),
        ("vit_base_patch16_reg4_gap_256", {"embed_dim": 64, "num_heads": 2}, 4),
        ("vit_base_patch16_224", {"embed_dim": 64, "num_heads": 2, "class_token": False, "global_pool": "avg"}, 0),
    ],
)
def test_prefix_tokens_come_from_the_model(name, kwargs, prefix):
    model, _ = tiny(name, **kwargs)
    patch_model(model, VCAConfig(contrast_tokens=4))
    seen = _layouts_seen(model)
    with torch.no_grad():
        out = model(torch.randn(2, 3, 64, 64))
    assert torch.isfinite(out).all()
    assert seen and all(layout == TokenLayout(prefix, (4, 4)) for layout in seen)


def test_dynamic_img_size_non_square_input_uses_the_real_grid():
    model, _ = tiny("vit_small_patch16_224", dynamic_img_size=True, reg_tokens=2)
    patch_model(model, VCAConfig(contrast_tokens=9))
    seen = _layouts_seen(model)
    with torch.no_grad():
        a = model(torch.randn(1, 3, 48, 112))  # 3 x 7 grid: not square, not derivable from sqrt(N)
        b = model(torch.randn(1, 3, 96, 64))  # 6 x 4
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert {layout.grid for layout in seen} == {(3, 7), (6, 4)}
    assert {layout.num_prefix_tokens for layout in seen} == {3}


def test_layer_selection_patches_only_those_blocks():
    model, _ = tiny(depth=4)
    report = patch_model(model, VCAConfig(layers=[0, 2]))
    assert [s.path for s in report.patched] == ["blocks.0.attn", "blocks.2.attn"]
    assert {s.path for s in report.skipped} == {"blocks.1.attn", "blocks.3.attn"}
    assert all("config.layers" in s.reason for s in report.skipped)
    kinds = [type(b.attn).__name__ for b in model.blocks]
    assert kinds == ["VisualContrastAttention", "Attention", "VisualContrastAttention", "Attention"]


def test_out_of_range_layers_fail_without_touching_the_model():
    model, _ = tiny()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(PatchError, match=r"layers \[5\] are out of range.*0\.\.1"):
        patch_model(model, VCAConfig(layers=[0, 5]))
    assert vca_patch.surgery.get_patch_state(model) is None
    assert model.state_dict().keys() == before.keys()


def test_a_refused_build_leaves_the_model_untouched(monkeypatch):
    model, _ = tiny()
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    calls = []
    real_build = VCAHandler.build_layer

    def failing(self, config, carried, layer_index):
        calls.append(layer_index)
        if layer_index == 1:
            raise ConfigError("boom")
        return real_build(self, config, carried, layer_index)

    monkeypatch.setattr(VCAHandler, "build_layer", failing)
    with pytest.raises(ConfigError, match="boom"):
        patch_model(model)
    assert calls == [0, 1]
    assert all(type(b.attn).__name__ == "Attention" for b in model.blocks)
    assert not model.patch_embed._forward_hooks and not model._forward_hooks
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_a_module_that_cannot_be_built_is_skipped_with_its_reason(monkeypatch):
    model, _ = tiny()
    real_build = VCAHandler.build_layer

    def failing(self, config, carried, layer_index):
        if layer_index == 1:
            raise RuntimeError("boom inside a library")
        return real_build(self, config, carried, layer_index)

    monkeypatch.setattr(VCAHandler, "build_layer", failing)
    report = patch_model(model)
    assert [s.layer_index for s in report.patched] == [0]
    (skipped,) = [s for s in report.skipped if s.path == "blocks.1.attn"]
    assert "RuntimeError: boom inside a library" in skipped.reason
    assert type(model.blocks[1].attn).__name__ == "Attention"
    model(torch.randn(1, 3, 64, 64))


def test_a_module_whose_verification_raises_is_skipped(monkeypatch):
    model, _ = tiny()
    real_call = TimmViTAdapter.call_original

    def raising(self, module, x):
        if module is model.blocks[0].attn:
            raise TypeError("forward() missing 1 required positional argument: 'position_embeddings'")
        return real_call(self, module, x)

    monkeypatch.setattr(TimmViTAdapter, "call_original", raising)
    report = patch_model(model)
    assert [s.path for s in report.patched] == ["blocks.1.attn"]
    (skipped,) = [s for s in report.skipped if s.path == "blocks.0.attn"]
    assert skipped.reason.startswith("verification raised TypeError: forward() missing")


def test_patching_twice_is_refused_and_unpatch_restores_exactly():
    model, _ = tiny()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    keys = list(model.state_dict())
    patch_model(model)
    with pytest.raises(PatchError, match="already patched"):
        patch_model(model)
    unpatch_model(model)
    assert list(model.state_dict()) == keys
    assert not model.patch_embed._forward_hooks
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_nothing_to_patch_is_a_clear_error():
    with pytest.raises(NothingToPatchError, match="no adapter knows"):
        patch_model(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    cnn = timm.create_model("resnet18", pretrained=False)
    before = {k: v.clone() for k, v in cnn.state_dict().items()}
    with pytest.raises(NothingToPatchError, match="ResNet") as caught:
        patch_model(cnn)
    assert caught.value.skipped == []  # no adapter: no candidate
    assert all(torch.equal(v, before[k]) for k, v in cnn.state_dict().items())  # unchanged


def test_nothing_to_patch_carries_every_skipped_candidate():
    """A model whose every attention fails verification: the error lists each one, in its message and `skipped`."""
    model, _ = tiny("vit_base_patch16_224", embed_dim=64, num_heads=2)
    for block in model.blocks:  # attention that is no longer softmax attention of its q/k/v: verification fails
        forward = block.attn.forward
        block.attn.forward = lambda x, *a, forward=forward, **k: 1.1 * forward(x, *a, **k)
    with pytest.raises(NothingToPatchError) as caught:
        patch_model(model, VCAConfig(contrast_tokens=4))
    assert [s.path for s in caught.value.skipped] == ["blocks.0.attn", "blocks.1.attn"]
    assert all("verification failed" in s.reason and s.path in str(caught.value) for s in caught.value.skipped)


def test_attention_pool_head_is_skipped_with_reason():
    model, _ = tiny("vit_base_patch16_224", embed_dim=64, num_heads=2, global_pool="map", class_token=False)
    report = patch_model(model, VCAConfig(contrast_tokens=4))
    assert len(report.patched) == 2
    pool = [s for s in report.skipped if s.path.startswith("attn_pool")]
    assert pool and "cross-attention" in pool[0].reason
    with torch.no_grad():
        assert torch.isfinite(model(torch.randn(1, 3, 64, 64))).all()


def test_deepcopy_of_a_patched_model_runs_independently():
    model, _ = tiny()
    patch_model(model)
    clone = copy.deepcopy(model)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(clone(x), model(x), rtol=0, atol=0)
        model(torch.randn(1, 3, 64, 64))  # the clone's layout tracker is its own
    assert clone.blocks[0].attn.layout_source.__self__ is not model.blocks[0].attn.layout_source.__self__


def test_patched_model_trains():
    model, _ = tiny()
    patch_model(model, VCAConfig(init="paper"))
    model.train()
    loss = model(torch.randn(2, 3, 64, 64)).logsumexp(-1).mean()
    loss.backward()
    vca = model.blocks[0].attn
    assert vca.contrast_embed_pos.grad.abs().sum() > 0 and vca.qkv.weight.grad.abs().sum() > 0


def test_seeded_conversion_is_deterministic():
    a, _ = tiny()
    b = copy.deepcopy(a)
    patch_model(a, VCAConfig(init="paper", seed=3))
    patch_model(b, VCAConfig(init="paper", seed=3))
    for (ka, va), (_, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(va, vb), ka
