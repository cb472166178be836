"""--device / --dtype / --img-size on the CLI: clear one-line refusals, conversions that reload at their size."""

from __future__ import annotations

import json
import math

import pytest
import timm
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from tests.support.recovery import TINY_ARGS, needs_fashion_mnist, probe_images, tiny_vit
from vca_patch import VCAConfig, patch_model, save_pretrained
from vca_patch.checkpoint import from_pretrained
from vca_patch.cli import app
from vca_patch.core.model_io import model_input_size
from vca_patch.recovery import calibrate

runner = CliRunner()
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


def _one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and not isinstance(result.exception, (TypeError, RuntimeError))
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


@no_cuda
@pytest.mark.parametrize("command", ["convert", "fidelity", "bench"])
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_on_a_machine_without_it_is_one_clear_line(tmp_path, command, device):
    args = {
        "convert": ["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", str(tmp_path / "x")],
        "fidelity": ["fidelity", str(tmp_path / "missing")],
        "bench": ["bench", "deit_tiny_patch16_224"],
    }[command]
    line = _one_line_error(runner.invoke(app, [*args, "--device", device]))
    assert f"--device {device}: no CUDA GPU is available on this machine" in line
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--device", "tpu", "--device must be auto"), ("--dtype", "float64", "--dtype must be one of float32, bfloat16")],
)
def test_unknown_device_or_dtype_is_refused(tmp_path, option, value, message):
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", str(tmp_path / "x"), option, value]
    assert message in _one_line_error(runner.invoke(app, args))


def test_auto_device_picks_what_is_there(tmp_path):
    out = tmp_path / "auto"
    args = ["convert", "vit_tiny_patch16_224", "--no-pretrained", "-o", str(out), "--img-size", "64"]
    result = runner.invoke(app, [*args, "--device", "auto"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["metadata"]["dtype"] == "float32"


def test_convert_dinov2_at_another_img_size_reloads_at_that_size(tmp_path):
    out = tmp_path / "dino224"
    args = ["convert", "vit_small_patch14_dinov2", "--img-size", "224", "--no-pretrained", "-o", str(out), "--force"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["base"]["model_args"]["img_size"] == [224, 224]
    model = from_pretrained(out)
    assert model_input_size(model) == (3, 224, 224)
    assert model.pos_embed.shape[1] == 1 + (224 // 14) ** 2  # 257, not dinov2's native 518 px 1370
    with torch.no_grad():
        assert model.forward_features(torch.randn(1, 3, 224, 224)).shape == (1, 257, 384)


def test_inspect_at_an_img_size_builds_the_model_there(tmp_path, monkeypatch):
    import vca_patch.cli.inspect as inspect_cli

    seen = {}
    real = inspect_cli.inspect_model

    def spy(net, *args, **kwargs):
        seen["size"] = model_input_size(net)
        return real(net, *args, **kwargs)

    monkeypatch.setattr(inspect_cli, "inspect_model", spy)
    result = runner.invoke(app, ["inspect", "deit_tiny_patch16_224", "--img-size", "96"])
    assert result.exit_code == 0, result.output
    assert seen["size"] == (3, 96, 96)
    line = _one_line_error(runner.invoke(app, ["inspect", "resnet18", "--img-size", "96"]))
    assert "--img-size: resnet18 does not take an image size" in line
    assert "positive" in _one_line_error(runner.invoke(app, ["inspect", "deit_tiny_patch16_224", "--img-size", "0"]))


def test_transformers_model_takes_its_size_from_the_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "hf_vit"
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64
    )
    transformers.ViTModel(config).save_pretrained(folder)
    line = _one_line_error(runner.invoke(app, ["inspect", str(folder), "--img-size", "64"]))
    assert "transformers model" in line and "image_size=32" in line and "--img-size 32" in line
    assert runner.invoke(app, ["inspect", str(folder), "--img-size", "32"]).exit_code == 0


def test_convert_in_bfloat16_saves_bfloat16_weights(tmp_path):
    out = tmp_path / "bf16"
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", str(out), "--dtype", "bfloat16"]
    result = runner.invoke(app, [*args, "--device", "cpu"])
    assert result.exit_code == 0, result.output
    tensors = load_file(str(out / "model.safetensors"))
    lambdas = {k for k in tensors if ".lambda1." in k or ".lambda2." in k}  # VCA keeps λ in float32 by design
    assert lambdas and {tensors[k].dtype for k in lambdas} == {torch.float32}
    assert {t.dtype for k, t in tensors.items() if t.is_floating_point() and k not in lambdas} == {torch.bfloat16}
    meta = json.loads((out / "config.json").read_text())
    assert meta["metadata"]["dtype"] == "bfloat16" and len(meta["layers"]) == 12
    # The conversion's probe error (VCA against the original, random weights) is the float32 one, to bf16 rounding.
    assert runner.invoke(app, ["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", str(tmp_path / "f32"),
                               "--device", "cpu"]).exit_code == 0  # fmt: skip
    f32 = json.loads((tmp_path / "f32" / "config.json").read_text())["metadata"]["probe"]["relative_error"]
    assert abs(meta["metadata"]["probe"]["relative_error"] - f32) < 0.03 * f32


@needs_fashion_mnist
def test_fidelity_in_bfloat16_matches_float32_within_bf16_rounding(tmp_path):
    model = tiny_vit().eval()
    patch_model(model, VCAConfig(contrast_tokens=16))
    calibrate(model, [probe_images(64, "train")])  # layer errors ~0.3, not the uncalibrated norm scale's ~15
    save_pretrained(model, tmp_path / "ckpt", model_args=TINY_ARGS)
    reports = {}
    for dtype in ("float32", "bfloat16"):
        path = tmp_path / f"{dtype}.json"
        args = ["fidelity", str(tmp_path / "ckpt"), "--limit", "32", "--batch-size", "16", "--json", str(path)]
        result = runner.invoke(app, [*args, "--device", "cpu", "--dtype", dtype])
        assert result.exit_code == 0, result.output
        reports[dtype] = json.loads(path.read_text())
    f32, b16 = reports["float32"], reports["bfloat16"]
    assert f32["num_images"] == b16["num_images"] == 32
    assert b16["layer_error"] != f32["layer_error"]  # it really ran in bf16
    for a, b in zip(f32["layer_error"], b16["layer_error"], strict=True):
        assert math.isfinite(b) and b == pytest.approx(a, rel=5e-3)  # measured 9e-4
    assert b16["patch_cosine"] == pytest.approx(f32["patch_cosine"], abs=1e-4)  # measured 7e-6


def test_probe_follows_the_model_device_and_dtype():
    from vca_patch.eval.fidelity import probe_batch

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=1, img_size=32).to(torch.bfloat16)
    probe = probe_batch(model, 2, seed=3)
    assert probe.dtype == torch.bfloat16 and probe.shape == (2, 3, 32, 32)
    assert torch.equal(probe, probe_batch(model.float(), 2, seed=3).to(torch.bfloat16))  # same draw, cast
