import json

import pytest
import timm
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

import vca_patch
from tests.support.models import tiny
from vca_patch.cli import app

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


@pytest.fixture(scope="module")
def deit_weights(tmp_path_factory):
    torch.manual_seed(1)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False).eval()
    path = tmp_path_factory.mktemp("w") / "deit_tiny.safetensors"
    save_file(model.state_dict(), str(path))
    return model, path


def test_convert_with_local_weights_end_to_end(tmp_path, deit_weights):
    original, weights = deit_weights
    out = tmp_path / "out"
    result = invoke("convert", "deit_tiny_patch16_224", "--weights", str(weights), "--output", str(out))
    assert result.exit_code == 0, result.output
    assert "12 / 0" in result.output and "+0.263 M" in result.output
    assert "probe: output cosine to original" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    meta = json.loads((out / "config.json").read_text())
    assert meta["metadata"]["base_weights"] == "local file"
    assert 0 <= meta["metadata"]["probe"]["top1_agreement"] <= 1

    # The saved model is exactly "these weights, patched with the default config".
    expected = vca_patch.from_pretrained(out)
    import copy

    mine = copy.deepcopy(original)
    vca_patch.patch_model(mine)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(expected(x), mine(x))


def test_convert_random_weights_with_options(tmp_path):
    out = tmp_path / "out"
    result = invoke(
        "convert", "deit_tiny_patch16_224", "--no-pretrained", "--output", str(out),
        "--layers", "0-2,5", "--contrast-tokens", "16", "--softmax", "separate",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["config"]["layers"] == [0, 1, 2, 5]
    assert meta["config"]["contrast_tokens"] == 16 and meta["config"]["softmax"] == "separate"
    assert meta["metadata"]["base_weights"] == "random"
    assert "4 / 8" in result.output and "skipped" in result.output


def test_random_weights_follow_the_seed(tmp_path):
    """The offline demo is reproducible: the same --seed gives the same random base model (and so the same
    probe figures); another seed gives another model. The global RNG is left as it was."""
    from safetensors.torch import load_file

    def convert(name: str, seed: str) -> dict[str, torch.Tensor]:
        out = tmp_path / name
        args = ("convert", "deit_tiny_patch16_224", "--no-pretrained", "--layers", "0", "--output", str(out))
        result = invoke(*args, "--seed", seed)
        assert result.exit_code == 0, result.output
        return load_file(str(out / "model.safetensors"))

    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    first, again, other = convert("a", "0"), convert("b", "0"), convert("c", "1")
    assert torch.equal(torch.rand(1), expected_next)
    assert all(torch.equal(first[key], again[key]) for key in first)
    assert not torch.equal(first["patch_embed.proj.weight"], other["patch_embed.proj.weight"])


def test_offline_pretrained_fails_fast_and_names_the_alternatives(tmp_path, connections):
    result = invoke("convert", "deit_tiny_patch16_224", "--output", str(tmp_path / "o"))
    assert connections == []  # offline: not one connection attempted
    assert result.exit_code == 1
    assert "HF_HUB_OFFLINE" in result.output
    assert "--weights" in result.output and "--no-pretrained" in result.output
    assert not (tmp_path / "o").exists()


def test_unreachable_hub_fails_fast(tmp_path, monkeypatch, connections):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    result = invoke("convert", "deit_tiny_patch16_224", "--output", str(tmp_path / "o"))
    assert 1 <= len(connections) <= 2  # one probe of the endpoint (no retry loop)
    assert result.exit_code == 1
    assert "cannot connect to 127.0.0.1:9" in result.output and "--no-pretrained" in result.output


def test_unknown_model_suggests_close_names(tmp_path):
    result = invoke("convert", "deit_tiny_patch16_22", "--no-pretrained", "--output", str(tmp_path / "o"))
    assert result.exit_code == 1
    assert "unknown model 'deit_tiny_patch16_22'" in result.output and "deit_tiny_patch16_224" in result.output


def test_weights_that_do_not_fit_name_the_keys(tmp_path, deit_weights):
    _, weights = deit_weights
    result = invoke("convert", "deit_small_patch16_224", "--weights", str(weights), "--output", str(tmp_path / "o"))
    assert result.exit_code == 1
    assert "shape mismatches: cls_token (1, 1, 192) vs model (1, 1, 384)" in result.output
    missing = invoke("convert", "deit_tiny_patch16_224", "--weights", str(tmp_path / "nope.pt"), "--output", "x")
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_non_empty_output_needs_force_and_force_replaces_only_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for force in ((), ("--force",)):  # a user's file: refused, also with --force
        result = invoke("convert", "deit_tiny_patch16_224", "--no-pretrained", "--output", str(out), *force)
        assert result.exit_code == 2 and "not empty" in result.output and "did not write: notes.txt" in result.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"] and (out / "notes.txt").read_text() == "keep me"
    (out / "notes.txt").unlink()
    model, args = tiny()
    vca_patch.patch_model(model)
    vca_patch.save_pretrained(model, out, model_args=args)  # a previous checkpoint: --force replaces it
    result = invoke("convert", "deit_tiny_patch16_224", "--no-pretrained", "--output", str(out))
    assert result.exit_code == 2 and "holds a vca-patch output" in result.output and "--force" in result.output
    forced = invoke("convert", "deit_tiny_patch16_224", "--no-pretrained", "--output", str(out), "--force")
    assert forced.exit_code == 0, forced.output
    assert json.loads((out / "config.json").read_text())["base"]["architecture"] == "deit_tiny_patch16_224"


def test_model_with_nothing_to_patch_exits_non_zero(tmp_path):
    result = invoke("convert", "resnet18", "--no-pretrained", "--output", str(tmp_path / "o"))
    assert result.exit_code == 1 and "no adapter knows" in result.output and "ResNet" in result.output
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--layers", "2-a"], "not a block index or range"),
        (["--layers", "40"], "layers [40] are out of range"),
        (["--contrast-tokens", "50"], "perfect square"),
        (["--softmax", "both"], "'joint' or 'separate'"),
    ],
)
def test_bad_options_are_explained(tmp_path, args, message):
    result = invoke("convert", "deit_tiny_patch16_224", "--no-pretrained", "--output", str(tmp_path / "o"), *args)
    assert result.exit_code != 0
    assert message in result.output
    assert not (tmp_path / "o").exists()
