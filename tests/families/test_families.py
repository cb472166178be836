"""Every supported family: patch, run at two resolutions, verify, unpatch, save and reload (random weights)."""

import pytest
import timm
import torch

import vca_patch
from tests.support.custom_models import PlainViT
from vca_patch import NothingToPatchError, PatchError, VCAConfig, patch_model, unpatch_model
from vca_patch.surgery import inspect_model

transformers = pytest.importorskip("transformers")

SMALL = {"depth": 2}
TIMM = [
    # name, kwargs, native input, second input (None: the model has a fixed size), prefix, approximate
    ("eva02_tiny_patch14_224", {"img_size": 56, "dynamic_img_size": True}, 56, (42, 70), 1, True),
    ("vit_small_patch16_rope_224", {"img_size": 64, "dynamic_img_size": True}, 64, (48, 80), 1, True),
    ("beit_base_patch16_224", {"img_size": 64, "embed_dim": 64, "num_heads": 2}, 64, None, 1, True),
    ("cait_xxs24_224", {"img_size": 64}, 64, None, 0, True),
    ("vit_small_r26_s32_224", {"img_size": 128, "dynamic_img_size": True}, 128, (96, 160), 1, False),
    ("vit_small_patch16_224", {"img_size": 64, "reg_tokens": 4, "dynamic_img_size": True}, 64, (48, 80), 5, False),
    ("vit_small_patch16_224", {"img_size": 64, "class_token": False, "global_pool": "avg"}, 64, None, 0, False),
]


@pytest.mark.parametrize(("name", "kwargs", "size", "second", "prefix", "approximate"), TIMM)
def test_timm_families(name, kwargs, size, second, prefix, approximate):
    model = timm.create_model(name, pretrained=False, **SMALL, **kwargs).eval()
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = model(x)
    report = patch_model(model, VCAConfig(contrast_tokens=4))
    assert len(report.patched) == 2 and report.layout.num_prefix_tokens == prefix
    assert all(bool(s.notes) == approximate for s in report.patched)
    assert all(s.verified for s in report.patched if not approximate)
    with torch.no_grad():
        out = model(x)
        assert out.shape == expected.shape and torch.isfinite(out).all()
        if second is not None:
            assert torch.isfinite(model(torch.randn(1, 3, *second))).all()
    unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(x), expected)


def test_cait_class_attention_stays_and_strict_refuses_approximations():
    model = timm.create_model("cait_xxs24_224", pretrained=False, depth=1, img_size=64)
    report = inspect_model(model, VCAConfig(contrast_tokens=4))
    class_attn = [s for s in report.skipped if s.class_name == "ClassAttn"]
    assert len(class_attn) == 2 and "class attention" in class_attn[0].reason
    assert "talking-heads" in report.patched[0].notes[0]
    with pytest.raises(PatchError, match=r"strict mode refuses.*talking-heads"):
        patch_model(model, VCAConfig(contrast_tokens=4), strict=True)
    assert vca_patch.surgery.get_patch_state(model) is None


SMALL_HF = {
    "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
    "image_size": 32, "patch_size": 8,
}  # fmt: skip
HF = [
    # config class, model class, extra config, prefix tokens, approximate
    ("ViTConfig", "ViTForImageClassification", {}, 1, False),
    ("DeiTConfig", "DeiTForImageClassificationWithTeacher", {}, 2, False),
    ("Dinov2Config", "Dinov2Model", {}, 1, False),
    ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", {"num_register_tokens": 4}, 5, False),
    ("Dinov2WithRegistersConfig", "Dinov2WithRegistersModel", {"num_register_tokens": 0}, 1, False),
    ("CLIPVisionConfig", "CLIPVisionModel", {}, 1, False),
    ("SiglipVisionConfig", "SiglipVisionModel", {}, 0, False),
    ("BeitConfig", "BeitForImageClassification", {"use_relative_position_bias": True}, 1, True),
    ("ViTMSNConfig", "ViTMSNModel", {}, 1, False),
    ("IJepaConfig", "IJepaModel", {}, 0, False),
]


def _tensor(output):
    return output.logits if getattr(output, "logits", None) is not None else output.last_hidden_state


@pytest.mark.parametrize(("config_cls", "model_cls", "extra", "prefix", "approximate"), HF)
def test_transformers_encoders(config_cls, model_cls, extra, prefix, approximate, tmp_path):
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**SMALL_HF, **extra)
    model = getattr(transformers, model_cls)(config).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = _tensor(model(pixel_values=x))
    dry = inspect_model(model, VCAConfig(contrast_tokens=4))
    with torch.no_grad():
        assert torch.equal(_tensor(model(pixel_values=x)), expected)  # inspect changed nothing
    report = patch_model(model, VCAConfig(contrast_tokens=4, layers=[1]))
    assert [s.path for s in report.patched] == [dry.patched[1].path]
    assert report.layout.num_prefix_tokens == prefix and report.layout.grid == (4, 4)
    assert all(s.verified for s in report.patched) and all(bool(s.notes) == approximate for s in report.patched)
    with torch.no_grad():
        out = _tensor(model(pixel_values=x))
        second = _tensor(model(pixel_values=torch.randn(1, 3, 48, 64), interpolate_pos_encoding=True))
    assert out.shape == expected.shape and torch.isfinite(out).all() and torch.isfinite(second).all()

    vca_patch.save_pretrained(model, tmp_path / "hybrid")  # block 0 softmax, block 1 VCA
    again = vca_patch.from_pretrained(tmp_path / "hybrid")
    with torch.no_grad():
        assert torch.equal(_tensor(again(pixel_values=x)), out)

    unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(_tensor(model(pixel_values=x)), expected)


def test_clip_text_tower_and_siglip_pooling_head_are_never_patched():
    text = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}
    clip = transformers.CLIPModel(transformers.CLIPConfig(vision_config=SMALL_HF, text_config=text)).eval()
    report = patch_model(clip, VCAConfig(contrast_tokens=4))
    assert all(s.path.startswith("vision_model.") for s in report.patched)
    assert {s.reason for s in report.skipped} == {"text tower / language model (causal attention): never patched"}
    with torch.no_grad():
        out = clip(input_ids=torch.tensor([[1, 2, 3]]), pixel_values=torch.randn(1, 3, 32, 32))
    assert torch.isfinite(out.logits_per_image).all()

    siglip = transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**SMALL_HF))
    report = inspect_model(siglip, VCAConfig(contrast_tokens=4))
    assert any("attention pooling head" in s.reason for s in report.skipped if s.path == "head.attention")


def test_a_transformers_folder_converts_from_the_cli(tmp_path):
    from typer.testing import CliRunner

    from vca_patch.cli import app

    transformers.ViTForImageClassification(transformers.ViTConfig(**SMALL_HF)).save_pretrained(tmp_path / "vit")
    result = CliRunner().invoke(app, ["convert", str(tmp_path / "vit"), "--output", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    model = vca_patch.from_pretrained(tmp_path / "out")
    assert type(model).__name__ == "ViTForImageClassification"
    assert sum(type(m).__name__ == "VisualContrastAttention" for m in model.modules()) == 2


def test_generic_detection_patches_verified_attention():
    model = PlainViT().eval()
    report = patch_model(model, VCAConfig(contrast_tokens=4))
    assert report.adapter == "generic" and [s.path for s in report.patched] == ["layers.0", "layers.1"]
    assert all(s.verified for s in report.patched) and report.layout.num_prefix_tokens == 1
    with torch.no_grad():
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 5)
        assert torch.isfinite(model(torch.randn(1, 3, 48, 64))).all()


def test_verification_rejects_a_module_that_only_looks_like_attention():
    model = PlainViT(mode="relu")
    with pytest.raises(NothingToPatchError, match="verification failed: reference softmax attention differs"):
        patch_model(model)
    assert all(type(m).__name__ == "PlainAttention" for m in model.layers)


def test_transformers_attention_in_an_unknown_layout_names_the_class_and_why():
    model = transformers.Data2VecVisionModel(transformers.Data2VecVisionConfig(**SMALL_HF))
    for layer in model.encoder.layer:  # the split layout with its query renamed: a layout no adapter knows
        attention = layer.attention.attention
        attention.q = attention.query
        del attention.query
    with pytest.raises(NothingToPatchError, match=r"Data2VecVision\w*SelfAttention: expected q_proj/k_proj/v_proj"):
        patch_model(model)


def test_convert_cli_strict_and_exclude(tmp_path):
    from typer.testing import CliRunner

    from vca_patch.cli import app

    common = ["--no-pretrained", "--contrast-tokens", "4"]
    strict = CliRunner().invoke(
        app, ["convert", "eva02_tiny_patch14_224", *common, "-o", str(tmp_path / "a"), "--strict"]
    )
    assert strict.exit_code == 1 and "strict mode refuses" in strict.output and "rope" in strict.output
    assert not (tmp_path / "a").exists()
    result = CliRunner().invoke(
        app, ["convert", "deit_tiny_patch16_224", *common, "-o", str(tmp_path / "b"), "--exclude", r"blocks\.(0|11)\."]
    )
    assert result.exit_code == 0, result.output
    assert vca_patch.from_pretrained(tmp_path / "b").vca_patch_state.config.exclude == r"blocks\.(0|11)\."
    layers = vca_patch.checkpoint.read_checkpoint_config(tmp_path / "b")["layers"]
    assert sorted(v["layer_index"] for v in layers.values()) == list(range(1, 11))
