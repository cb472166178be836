import json

import pytest
import torch
from typer.testing import CliRunner

import vca_patch
from tests.support.models import tiny, trained_a_little
from vca_patch import ConfigError, MANOConfig, MultipoleAttention, TargetConfig, patch_model, unpatch_model
from vca_patch.cli import app
from vca_patch.eval.fidelity import compare_outputs


def _outputs(model, x):
    with torch.no_grad():
        return model(x)


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"])
@pytest.mark.parametrize("config", [MANOConfig(window=4), MANOConfig(window=9, up="nearest", init="multipole")])
def test_window_covering_grid_equals_original_model(name, config):
    model, _ = tiny(name)  # 64 px / 16 = 4×4 grid, 1 or 2 prefix tokens
    x = torch.randn(2, 3, 64, 64)
    reference = _outputs(model, x)
    patch_model(model, config)
    assert all(isinstance(b.attn, MultipoleAttention) for b in model.blocks)
    torch.testing.assert_close(_outputs(model, x), reference, atol=1e-5, rtol=1e-5)


def test_windowed_model_is_close_but_not_equal_and_unpatch_restores():
    model, _ = tiny(img_size=96)  # 6×6 grid, window 4: padded windows, 2 levels
    x = torch.randn(2, 3, 96, 96)
    reference = _outputs(model, x)
    patch_model(model, MANOConfig(window=4))
    assert model.blocks[0].attn.plan((6, 6))[0].padded == (8, 8)
    out = _outputs(model, x)
    metrics = compare_outputs(reference, out)
    assert torch.isfinite(out).all() and 0.9 < metrics["cosine"] < 1 - 1e-7
    unpatch_model(model)
    torch.testing.assert_close(_outputs(model, x), reference)


@pytest.mark.parametrize(
    "config",
    [MANOConfig(window=2), MANOConfig(window=3, down="avg", up="nearest", layers=[1], init="multipole", levels=2)],
)
def test_save_reload_gives_identical_outputs(tmp_path, config):
    model, args = tiny("deit_tiny_distilled_patch16_224")
    patch_model(model, config)
    trained_a_little(model, ".down.", ".up.", "up_gain")
    vca_patch.save_pretrained(model, tmp_path / "ckpt", model_args=args)
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["config"]["target"] == "mano"
    card = (tmp_path / "ckpt" / "README.md").read_text()
    assert "Multipole Attention" in card
    assert f"within {config.window}×{config.window} windows" in card and "{config" not in card
    again = vca_patch.from_pretrained(tmp_path / "ckpt")
    x = torch.randn(2, 3, 64, 64)
    assert torch.equal(_outputs(model, x), _outputs(again, x))
    assert again.vca_patch_state.config == config


def test_config_round_trip_and_validation():
    config = MANOConfig(window=5, rate=3, levels=2, down="avg", up="nearest", prefix="separate", layers=[3, 1])
    assert TargetConfig.from_json(config.to_json()) == config
    assert config.to_dict()["target"] == "mano" and config.layers == [1, 3]
    for bad, match in [
        ({"rate": 1}, "rate must be an integer ≥ 2"),
        ({"window": 0}, "window must be a positive integer"),
        ({"levels": 0}, "levels must be a positive integer or None"),
        ({"down": "max"}, "down must be one of 'conv', 'avg'"),
        ({"up": "bilinear"}, "up must be one of"),
        ({"init": "paper"}, "init must be one of"),
        ({"prefix": "drop"}, "prefix must be one of"),
        ({"pad": "yes"}, "pad must be true or false"),
    ]:
        with pytest.raises(ConfigError, match=match):
            MANOConfig(**bad)
    with pytest.raises(ConfigError, match="unknown MANOConfig keys"):
        TargetConfig.from_dict({"target": "mano", "contrast_tokens": 49})


def test_cli_convert_to_mano_end_to_end(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--output", str(out), "--to", "mano",
         "--window", "7", "--rate", "2", "--up", "nearest", "--layers", "0-3"],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "4 / 8" in result.output and "probe: output cosine to original" in result.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["config"]["target"] == "mano" and meta["config"]["window"] == 7 and meta["config"]["up"] == "nearest"
    assert meta["layers"]["blocks.0.attn"]["levels"] == "auto"
    # Zero gain at init: the first converted block's prefix output is exact, the model stays close.
    assert meta["metadata"]["probe"]["cosine"] > 0.9
    again = vca_patch.from_pretrained(out)
    assert isinstance(again.blocks[0].attn, MultipoleAttention) and not isinstance(
        again.blocks[5].attn, MultipoleAttention
    )

    bad = CliRunner().invoke(
        app,
        [
            "convert",
            "deit_tiny_patch16_224",
            "--no-pretrained",
            "-o",
            str(tmp_path / "b"),
            "--to",
            "mano",
            "--rate",
            "1",
        ],
    )
    assert bad.exit_code == 2 and "rate must be an integer ≥ 2" in bad.output


def test_dynamic_image_size_replans_levels_per_call():
    model, _ = tiny(dynamic_img_size=True)
    patch_model(model, MANOConfig(window=2))
    for px, grid in ((64, (4, 4)), (112, (7, 7)), (80, (5, 7))):
        x = torch.randn(1, 3, px, 16 * grid[1])
        out = _outputs(model, x)
        assert out.shape == (1, 1000) and torch.isfinite(out).all()
