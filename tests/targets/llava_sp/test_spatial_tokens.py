"""LLaVA-SP spatial tokens on a tiny random LLaVA: geometry, exactness, prompts, refusals, save/reload, undo."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.formats.llava_sp import load_spatial_tokens, save_spatial_tokens
from vca_patch.targets.llava_sp import (
    CroppingSpatialTokens,
    PoolingSpatialTokens,
    SpatialTokensConfig,
    SpatialTokensError,
    add_spatial_tokens,
    crop_windows,
    get_spatial_projector,
    image_token_count,
    remove_spatial_tokens,
)
from vca_patch.targets.llava_sp.tiny import IMAGE_TOKEN_ID, tiny_llava, tiny_processor

pytest.importorskip("transformers")

GRID = 12  # tiny_llava: 48 px / patch 4


def _prompt(count: int, batch: int = 1) -> torch.Tensor:
    return torch.cat(
        [
            torch.ones(batch, 1, dtype=torch.long),
            torch.full((batch, count), IMAGE_TOKEN_ID),
            torch.tensor([[5, 6, 7]] * batch),
        ],
        dim=1,
    )


def _pixels(batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 48, 48, generator=torch.Generator().manual_seed(seed))


# ---- config and geometry -------------------------------------------------------------------------------------


def test_config_json_round_trip_and_validation():
    config = SpatialTokensConfig(variant="cropping", num_tokens=3, hidden_dim=8, sizes=[2, 6, 12], seed=4)
    assert SpatialTokensConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match="variant must be one of"):
        SpatialTokensConfig(variant="tiling")
    with pytest.raises(ConfigError, match="sizes has 2 entries but num_tokens is 6"):
        SpatialTokensConfig(sizes=[4, 8])
    with pytest.raises(ConfigError, match="unknown SpatialTokensConfig keys \\['tokens'\\]"):
        SpatialTokensConfig.from_dict({"tokens": 6})
    with pytest.raises(ConfigError, match="exceeds the 12×12 patch grid"):
        SpatialTokensConfig(num_tokens=2, sizes=[4, 16]).view_sizes(12)


def test_default_geometry_is_the_papers_on_clip_l_336():
    config = SpatialTokensConfig(variant="cropping")
    assert config.view_sizes(24) == [4, 8, 12, 16, 20, 24]
    assert config.detail_geometry(24) == (16, 2)  # conv_CM: kernel 16, stride 2 -> 5×5 detail tokens
    # the authors' clip_encoder slices [10 - i, 14 + i) for i = 0, 2, ..., 10
    assert crop_windows(24, config.view_sizes(24)) == [(10 - i, 14 + i) for i in range(0, 11, 2)]


@pytest.mark.parametrize("grid", [12, 13, 16, 27])
def test_crop_windows_form_a_centred_nest(grid):
    sizes = SpatialTokensConfig().view_sizes(grid)
    windows = crop_windows(grid, sizes)
    assert windows[-1] == (0, grid)
    for (start, end), side in zip(windows, sizes, strict=True):
        assert end - start == side
        assert abs(start - (grid - end)) <= 1  # centred (to one patch when grid - side is odd)
    for (a0, b0), (a1, b1) in itertools.pairwise(windows):
        assert a1 <= a0 and b0 <= b1  # each crop contains the previous one


def test_parameter_counts_match_the_papers_clip_l_336_modules():
    sizes = [4, 8, 12, 16, 20, 24]
    with torch.device("meta"):
        pooling = PoolingSpatialTokens(1024, 512, 4096, 24, sizes)
        cropping = CroppingSpatialTokens(1024, 512, 4096, 24, sizes, 16, 2)
    convs = 1024 * 512 * sum(k * k for k in sizes)
    assert sum(p.numel() for p in pooling.parameters()) == convs + 512 * 4096  # 765.5 M
    qkv = 3 * (2 * 512 + 512 * 512 + 512)
    expected = convs + 1024 * 512 * 16 * 16 + qkv + 1024 * 4096 + 4096  # 902.6 M
    assert sum(p.numel() for p in cropping.parameters()) == expected
    assert round(expected / 1e6, 1) == 902.6


# ---- the modules against an independent float64 reference ---------------------------------------------------


def _adaptive_avg_reference(x: torch.Tensor, k: int) -> torch.Tensor:
    grid = x.shape[-1]
    out = torch.empty(*x.shape[:2], k, k, dtype=x.dtype)
    for i in range(k):
        r0, r1 = (i * grid) // k, math.ceil((i + 1) * grid / k)
        for j in range(k):
            c0, c1 = (j * grid) // k, math.ceil((j + 1) * grid / k)
            out[:, :, i, j] = x[:, :, r0:r1, c0:c1].mean(dim=(-1, -2))
    return out


def _layer_norm(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    return (x - mean) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def _gelu(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def test_pooling_tokens_match_a_float64_reference():
    sizes = SpatialTokensConfig().view_sizes(GRID)  # 2, 4, 6, 8, 10, 12: 8 and 10 pool unevenly
    layer = PoolingSpatialTokens(16, 8, 24, GRID, sizes).double()
    x = torch.randn(2, 16, GRID, GRID, dtype=torch.float64)
    tokens = []
    for k, view in zip(sizes, layer.views, strict=True):
        conv = view if isinstance(view, nn.Conv2d) else view[1]
        tokens.append(torch.einsum("bcij,hcij->bh", _adaptive_avg_reference(x, k), conv.weight))
    reference = _gelu(torch.stack(tokens, 1)) @ layer.out_proj[1].weight.T
    torch.testing.assert_close(layer(x), reference, rtol=0, atol=1e-12)


def test_cropping_tokens_match_a_float64_reference():
    sizes = SpatialTokensConfig().view_sizes(GRID)
    kernel, stride = SpatialTokensConfig().detail_geometry(GRID)
    layer = CroppingSpatialTokens(16, 8, 24, GRID, sizes, kernel, stride).double()
    for p in layer.parameters():  # non-trivial LayerNorm affine
        nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 16, GRID, GRID, dtype=torch.float64)
    c = torch.stack(
        [
            torch.einsum("bcij,hcij->bh", x[:, :, a:b, a:b], conv.weight)
            for (a, b), conv in zip([((GRID - k) // 2, (GRID - k) // 2 + k) for k in sizes], layer.views, strict=True)
        ],
        1,
    )
    side = (GRID - kernel) // stride + 1
    d = torch.stack(
        [
            torch.einsum(
                "bcij,hcij->bh",
                x[:, :, r * stride : r * stride + kernel, s * stride : s * stride + kernel],
                layer.detail.weight,
            )
            for r in range(side)
            for s in range(side)
        ],
        1,
    )
    assert d.shape[1] == 25  # a 5×5 detail map, as on CLIP-L/336

    def lin(seq, t):
        return _layer_norm(t, seq[0]) @ seq[1].weight.T + seq[1].bias

    q, k_, v = lin(layer.query, c), lin(layer.key, d), lin(layer.value, d)
    scores = q @ k_.transpose(1, 2) / math.sqrt(8)
    attn = torch.exp(scores - scores.amax(-1, keepdim=True))
    attn = attn / attn.sum(-1, keepdim=True)
    fused = torch.cat([c, attn @ v], -1)
    reference = _gelu(fused) @ layer.out_proj[1].weight.T + layer.out_proj[1].bias
    torch.testing.assert_close(layer(x), reference, rtol=0, atol=1e-10)


# ---- surgery on the tiny LLaVA -------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["pooling", "cropping"])
@pytest.mark.parametrize("strategy", ["default", "full"])
def test_projector_output_is_spatial_then_bit_identical_original(variant, strategy):
    model = tiny_llava(strategy=strategy)
    original = model.model.multi_modal_projector
    features = torch.randn(2, GRID * GRID + (strategy == "full"), 32)
    with torch.no_grad():
        expected = original(features)
        report = add_spatial_tokens(model, SpatialTokensConfig(variant=variant, hidden_dim=16))
        out = model.model.multi_modal_projector(features)
    assert out.shape == (2, 6 + features.shape[1], 64)
    assert torch.equal(out[:, 6:], expected)
    assert report.grid == GRID and report.image_tokens_after == report.image_tokens_before + 6
    assert report.added_parameters == sum(p.numel() for p in get_spatial_projector(model).spatial_tokens.parameters())
    with torch.no_grad():
        hidden = model.model.get_image_features(_pixels(2)).pooler_output
    assert [h.shape for h in hidden] == [torch.Size([report.image_tokens_after, 64])] * 2


def test_state_dict_keeps_the_original_names_and_adds_a_prefix():
    model = tiny_llava()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    add_spatial_tokens(model, SpatialTokensConfig(variant="cropping"))
    after = model.state_dict()
    old = [k for k in after if k in before]
    new = [k for k in after if k not in before]
    assert set(old) == set(before)
    assert all(torch.equal(after[k], before[k]) for k in old)
    assert new and all(k.startswith("model.multi_modal_projector.spatial_tokens.") for k in new)
    assert model.model.multi_modal_projector.linear_1 is get_spatial_projector(model).original.linear_1


def test_grid_comes_from_the_vision_config():
    model = tiny_llava(image_size=52, patch_size=4)  # 13×13: odd grid, odd crop offsets
    report = add_spatial_tokens(model)
    assert report.grid == 13 and image_token_count(model) == 169 + 6
    with torch.no_grad():
        logits = model(input_ids=_prompt(175), pixel_values=torch.randn(1, 3, 52, 52)).logits
    assert logits.shape == (1, 1 + 175 + 3, 100)


def test_remove_restores_bit_identical_logits_and_config():
    model = tiny_llava()
    keys = list(model.state_dict())
    with torch.no_grad():
        reference = model(input_ids=_prompt(144), pixel_values=_pixels()).logits
    add_spatial_tokens(model, SpatialTokensConfig(variant="cropping"))
    assert model.config.image_seq_length == 150
    remove_spatial_tokens(model)
    with torch.no_grad():
        restored = model(input_ids=_prompt(144), pixel_values=_pixels()).logits
    assert torch.equal(restored, reference)
    assert list(model.state_dict()) == keys and model.config.image_seq_length == 144
    assert not model.model._forward_pre_hooks  # the prompt check went with the tokens
    with pytest.raises(SpatialTokensError, match="no spatial tokens to remove"):
        remove_spatial_tokens(model)


@pytest.mark.parametrize("variant", ["pooling", "cropping"])
def test_generate_with_the_new_count_and_a_clear_error_with_the_old(variant):
    model = tiny_llava()
    add_spatial_tokens(model, SpatialTokensConfig(variant=variant))
    out = model.generate(input_ids=_prompt(150), pixel_values=_pixels(), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 1 + 150 + 3 + 4)
    with pytest.raises(SpatialTokensError, match=r"144 <image> tokens for 1 image\(s\).*needs 150 \(144 patch \+ 6"):
        model.generate(input_ids=_prompt(144), pixel_values=_pixels(), max_new_tokens=2)


def test_processor_count_is_updated_and_prompts_run():
    model, processor = tiny_llava(), tiny_processor()
    image = (np.random.default_rng(0).random((60, 50, 3)) * 255).astype("uint8")

    def image_tokens():
        batch = processor(images=image, text="<image> w5 w6", return_tensors="pt")
        return int((batch["input_ids"] == IMAGE_TOKEN_ID).sum()), batch

    assert image_tokens()[0] == 144
    add_spatial_tokens(model)
    assert image_token_count(model, processor) == 150
    assert image_token_count(model, processor) == 150  # idempotent
    count, batch = image_tokens()
    assert count == 150
    with torch.no_grad():
        assert model(**batch).logits.shape[1] == batch["input_ids"].shape[1]
    remove_spatial_tokens(model)
    assert image_token_count(model, processor) == 144 and image_tokens()[0] == 144


def test_wrong_vision_token_count_fails_in_the_projector():
    model = tiny_llava()
    add_spatial_tokens(model)
    with pytest.raises(ValueError, match=r"expect 144 vision tokens .* got 145"):
        model.model.get_image_features(_pixels(), vision_feature_select_strategy="full")


def test_refusals_name_the_reason():
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaNextConfig, LlavaNextForConditionalGeneration

    nxt = LlavaNextForConditionalGeneration(
        LlavaNextConfig(
            vision_config=CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, image_size=32, patch_size=8),
            text_config=LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, vocab_size=100),
            image_token_index=99, image_grid_pinpoints=[[32, 32]],
        )
    )  # fmt: skip
    with pytest.raises(SpatialTokensError, match="tiles images at any resolution"):
        add_spatial_tokens(nxt)
    with pytest.raises(SpatialTokensError, match="not a transformers LLaVA model"):
        add_spatial_tokens(nn.Sequential(nn.Linear(2, 2)))
    model = tiny_llava()
    model.model.multi_modal_projector = nn.Linear(32, 64)
    with pytest.raises(SpatialTokensError, match="unknown projector Linear"):
        add_spatial_tokens(model)
    model = tiny_llava()
    add_spatial_tokens(model)
    with pytest.raises(SpatialTokensError, match="already has spatial tokens"):
        add_spatial_tokens(model)


# ---- save / reload -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["pooling", "cropping"])
def test_save_reload_identity(tmp_path, variant):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model, processor = tiny_llava(), tiny_processor()
    add_spatial_tokens(model, SpatialTokensConfig(variant=variant, seed=3))
    with torch.no_grad():
        for p in get_spatial_projector(model).spatial_tokens.parameters():
            p.add_(0.01)  # "trained": differs from a fresh seed-3 build
        reference = model(input_ids=_prompt(150), pixel_values=_pixels()).logits
    keys = list(model.state_dict())
    folder = save_spatial_tokens(model, tmp_path / "sp", processor=processor, metadata={"note": "test"})
    assert list(model.state_dict()) == keys and model.config.image_seq_length == 150  # the model is intact
    meta = json.loads((folder / "spatial_tokens.json").read_text())
    assert meta["config"]["variant"] == variant and meta["image_tokens"] == 150 and meta["base_image_tokens"] == 144
    assert "6 visual spatial tokens" in (folder / "README.md").read_text()

    loaded = load_spatial_tokens(folder)
    assert list(loaded.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_prompt(150), pixel_values=_pixels()).logits, reference)
    assert loaded.config.image_seq_length == 150
    # the folder is also a plain LLaVA for transformers (the original keys only), and the processor counts 150
    plain, info = LlavaForConditionalGeneration.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and plain.config.image_seq_length == 144
    saved_processor = AutoProcessor.from_pretrained(folder)
    batch = saved_processor(images=np.zeros((48, 48, 3), "uint8"), text="<image> w3", return_tensors="pt")
    assert int((batch["input_ids"] == IMAGE_TOKEN_ID).sum()) == 150


def test_load_refuses_a_folder_without_spatial_tokens(tmp_path):
    tiny_llava().save_pretrained(tmp_path)
    with pytest.raises(SpatialTokensError, match=r"not a LLaVA-SP folder: no spatial_tokens\.json"):
        load_spatial_tokens(tmp_path)


def test_save_refuses_an_existing_folder_and_writes_nothing_half(tmp_path):
    model = tiny_llava()
    add_spatial_tokens(model)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        save_spatial_tokens(model, tmp_path / "out")
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]
    with pytest.raises(TypeError):
        save_spatial_tokens(model, tmp_path / "bad", metadata={"x": object()})
    assert not (tmp_path / "bad").exists()


def test_dtype_follows_the_projector():
    model = tiny_llava().to(torch.bfloat16)
    add_spatial_tokens(model)
    params = list(get_spatial_projector(model).spatial_tokens.parameters())
    assert all(p.dtype == torch.bfloat16 for p in params)
    out = model.model.multi_modal_projector(torch.randn(1, 144, 32, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (1, 150, 64)
    assert torch.isfinite(out.float()).all()


def test_convert_function_for_the_cli(tmp_path):
    from vca_patch.formats.llava_sp import convert_to_llava_sp

    source = tmp_path / "llava"
    tiny_llava().save_pretrained(source)
    tiny_processor().save_pretrained(source)
    report = convert_to_llava_sp(str(source), tmp_path / "sp", SpatialTokensConfig(variant="cropping"))
    assert report.image_tokens_after == 150
    loaded = load_spatial_tokens(tmp_path / "sp")
    assert get_spatial_projector(loaded).spatial_config.variant == "cropping"
    assert (tmp_path / "sp" / "processor_config.json").exists() or (
        tmp_path / "sp" / "preprocessor_config.json"
    ).exists()
    with pytest.raises(FileExistsError):
        convert_to_llava_sp(str(source), tmp_path / "sp", SpatialTokensConfig())


def test_convert_cli_adds_spatial_tokens_to_a_llava_folder(tmp_path):
    from typer.testing import CliRunner

    from vca_patch.cli import app

    model = tiny_llava()
    model.save_pretrained(tmp_path / "llava")
    out = tmp_path / "sp"
    args = ["convert", str(tmp_path / "llava"), "-o", str(out), "--to", "llava-sp", "--spatial-variant", "cropping"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    again = load_spatial_tokens(out)
    assert get_spatial_projector(again) is not None and image_token_count(again) == GRID * GRID + 6
    other = tmp_path / "other"
    bad = CliRunner().invoke(app, [*args[:3], str(other), "--to", "llava-sp", "--spatial-variant", "nope"])
    assert bad.exit_code == 2 and "variant" in bad.output and not other.exists()


def test_inspect_of_a_whole_llava_converts_the_vision_tower_and_never_the_language_model():
    from vca_patch.surgery import inspect_model

    report = inspect_model(tiny_llava())
    assert [s.path for s in report.patched] == [f"model.vision_tower.encoder.layers.{i}.self_attn" for i in (0, 1)]
    assert {s.reason for s in report.skipped} == {"text tower / language model (causal attention): never patched"}
