"""DIDB through surgery: patch a tiny timm DeiT, train step, unpatch, save/reload, config, selection."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import vca_patch
from tests.support.models import tiny, trained_a_little
from vca_patch import ConfigError, DIDBConfig, TargetConfig, patch_model, unpatch_model
from vca_patch.surgery import inspect_model
from vca_patch.targets.didb import BinaryLinear, DIDBAttention, ImprovedRPReLU, set_binarization

X = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_patch_forward_backward_and_unpatch_bit_identical():
    model, _ = tiny()
    reference, before = model(X), _snapshot(model)
    params = {name: p for name, p in model.named_parameters()}
    report = patch_model(model, DIDBConfig())
    block = model.blocks[0]
    assert isinstance(block.attn, DIDBAttention)
    assert isinstance(block.mlp.fc1, BinaryLinear) and isinstance(block.mlp.fc2, BinaryLinear)
    assert isinstance(block.mlp.act, ImprovedRPReLU)
    assert type(model.patch_embed.proj) is nn.Conv2d and type(model.head) is nn.Linear  # full precision
    assert block.mlp.fc1.weight is params["blocks.0.mlp.fc1.weight"]  # carried, same state-dict keys
    added = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in params.values())
    assert report.params_after - report.params_before == added == 2 * (16 + 2 + 4 * 768)

    model.train()
    out = model(X)
    assert out.isfinite().all() and not torch.allclose(out, reference, atol=1e-2)
    out.logsumexp(-1).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.isfinite().all(), name
    for name in ("mlp.fc1.act_clip", "mlp.act.slope", "attn.band_weight", "attn.attn_threshold"):
        assert model.get_parameter(f"blocks.1.{name}").grad.abs().sum() > 0, name

    model.zero_grad(set_to_none=True)
    unpatch_model(model.eval())
    assert type(model.blocks[0].mlp.fc1) is nn.Linear and type(model.blocks[0].mlp.act) is nn.GELU
    assert type(model.blocks[0].attn).__name__ == "Attention"
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(before[k], after[k]) for k in before)
    assert all(p is params[name] for name, p in model.named_parameters())
    assert torch.equal(model(X), reference)


def test_inspect_leaves_the_model_untouched_and_reports_the_same():
    model, _ = tiny()
    before = _snapshot(model)
    dry = inspect_model(model, DIDBConfig(layers=[1]))
    assert type(model.blocks[1].mlp.fc1) is nn.Linear
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    real = patch_model(model, DIDBConfig(layers=[1]))
    assert dry.params_after == real.params_after and [s.path for s in dry.patched] == ["blocks.1.attn"]


def test_selection_binarizes_only_the_chosen_blocks_and_linears():
    model, _ = tiny()
    patch_model(model, DIDBConfig(layers=[1], binarize=["qkv", "fc2"], rprelu=False))
    assert type(model.blocks[0].attn).__name__ == "Attention" and type(model.blocks[0].mlp.fc2) is nn.Linear
    assert model.blocks[1].attn.binary == ("qkv",)
    assert type(model.blocks[1].mlp.fc1) is nn.Linear and isinstance(model.blocks[1].mlp.fc2, BinaryLinear)
    assert type(model.blocks[1].mlp.act) is nn.GELU
    unpatch_model(model)
    other, _ = tiny()
    patch_model(other, DIDBConfig(exclude=r"blocks\.0\."))
    assert type(other.blocks[0].mlp.fc1) is nn.Linear and isinstance(other.blocks[1].mlp.fc1, BinaryLinear)


def _write_checkpoint(model: nn.Module, folder, args) -> None:
    """config.json + model.safetensors as save_pretrained writes them (without its model card, see below)."""
    from safetensors.torch import save_file

    from vca_patch.checkpoint.folder import checkpoint_metadata

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(checkpoint_metadata(model, model_args=args), indent=2))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))


def test_reload_gives_identical_outputs_after_a_stage_switch(tmp_path):
    model, args = tiny()
    patch_model(model, DIDBConfig(weights=False))  # stage 1: binary activations only
    trained_a_little(model, "act_clip", "band_weight", "attn_threshold", "local_weight", "mlp.act.", "fc1.weight")
    set_binarization(model, weights=True)  # stage 2
    assert model.blocks[0].mlp.fc2.binarize_weights and model.blocks[1].attn.binarize_weights
    _write_checkpoint(model, tmp_path / "ckpt", args)
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["config"]["target"] == "didb" and meta["config"]["weights"] is True
    again = vca_patch.from_pretrained(tmp_path / "ckpt")
    assert again.vca_patch_state.config == model.vca_patch_state.config
    assert isinstance(again.blocks[1].mlp.act, ImprovedRPReLU)
    assert torch.equal(model.eval()(X), again(X))


def test_save_pretrained_writes_a_didb_checkpoint(tmp_path):
    model, args = tiny()
    patch_model(model, DIDBConfig())
    vca_patch.save_pretrained(model, tmp_path / "ckpt", model_args=args)
    assert torch.equal(model(X), vca_patch.from_pretrained(tmp_path / "ckpt")(X))


def test_config_json_round_trip_and_validation():
    config = DIDBConfig(binarize=["fc2", "qkv"], hfsc=False, band_init=[0.5, 2], layers=[1], threshold_init=1.5)
    assert config.binarize == ["qkv", "fc2"] and config.band_init == [0.5, 2.0]
    again = TargetConfig.from_json(config.to_json())
    assert isinstance(again, DIDBConfig) and again == config and config.to_dict()["target"] == "didb"
    for bad, match in [
        ({"binarize": ["head"]}, "binarize must list Linears"),
        ({"weights": 1}, "weights must be true or false"),
        ({"act_clip_init": 0}, "act_clip_init must be a positive number"),
        ({"band_init": [1.0]}, "band_init must be two numbers"),
    ]:
        with pytest.raises(ConfigError, match=match):
            DIDBConfig(**bad)
    with pytest.raises(ConfigError, match="unknown DIDBConfig keys"):
        TargetConfig.from_dict({"target": "didb", "clip": 1})


def test_set_binarization_needs_a_didb_model():
    model, _ = tiny()
    with pytest.raises(vca_patch.PatchError, match="DIDBConfig"):
        set_binarization(model, weights=False)


def test_convert_cli_to_didb_saves_a_checkpoint_that_reloads(tmp_path):
    from typer.testing import CliRunner

    from vca_patch.cli import app

    out = tmp_path / "didb"
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--to", "didb", "--layers", "0-1", "-o", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    model = vca_patch.from_pretrained(out)
    assert model.vca_patch_state.config.target == "didb" and len(model.vca_patch_state.report.patched) == 2
    assert isinstance(model.blocks[0].mlp.act, ImprovedRPReLU) and not isinstance(
        model.blocks[2].mlp.act, ImprovedRPReLU
    )
    bad = CliRunner().invoke(app, [*args, "--force", "--window", "5"])
    assert bad.exit_code == 2 and "--window is for --to mano" in bad.output
