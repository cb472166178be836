"""A new user's audit: inputs of the wrong kind to the Python API and files that are not what they claim to be
end in one clear error of vca-patch's own (no traceback from inside torch, timm or the standard library), and
leave every input as it was."""

from __future__ import annotations

import pytest
import torch

import vca_patch
from tests.support.cli import one_error_line, run_unchanged, runner
from tests.support.models import tiny
from vca_patch import ConfigError, PatchError, VCAConfig, calibrate, patch_model, save_pretrained
from vca_patch.checkpoint.folder import CheckpointError
from vca_patch.cli import app
from vca_patch.data.errors import DatasetError
from vca_patch.train.recipe import RecipeError, load_recipe

ARGS = {"depth": 1, "img_size": 32, "patch_size": 8, "embed_dim": 16, "num_heads": 2, "num_classes": 3}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, args = tiny(**ARGS)
    patch_model(model, VCAConfig(contrast_tokens=4))
    return vca_patch.save_pretrained(model, tmp_path_factory.mktemp("ckpt") / "ckpt", model_args=args)


@pytest.mark.parametrize("model", ["deit_tiny_patch16_224", None, torch.zeros(1)], ids=["str", "none", "tensor"])
def test_anything_but_a_module_as_the_model_is_one_line(model, tmp_path):
    out = tmp_path / "out"
    for call in (lambda: patch_model(model), lambda: save_pretrained(model, out), lambda: calibrate(model, [])):
        with pytest.raises(PatchError, match=r"expected the model, a torch\.nn\.Module, but got \w+"):
            call()
    assert not out.exists()


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ("vca", "config must be a target config such as VCAConfig()"),
        ({"target": "vca"}, "TargetConfig.from_dict"),
        (VCAConfig, "config is the class VCAConfig; pass an instance: VCAConfig()"),
    ],
    ids=["name", "dict", "class"],
)
def test_a_config_that_is_not_a_config_instance_says_what_to_pass(config, needle):
    model, _ = tiny(**ARGS)
    with pytest.raises(ConfigError) as caught:
        patch_model(model, config)
    assert needle in str(caught.value)
    assert not hasattr(model, "vca_patch_state")


@pytest.mark.parametrize(
    ("images", "needle"),
    [
        (torch.randn(2, 1, 32, 32), "has shape (2, 1, 32, 32), but the model takes images of shape [batch, 3, "),
        (torch.randn(2, 3), "has shape (2, 3), but the model takes images of shape [batch, 3, height, width]"),
        (torch.randn(2, 3, 24, 24), "cannot run calibration batch 0 of shape (2, 3, 24, 24): Input height (24)"),
    ],
    ids=["channels", "not-images", "size"],
)
def test_calibration_batches_the_model_cannot_take_are_one_line(images, needle):
    model, _ = tiny(**ARGS)
    patch_model(model, VCAConfig(contrast_tokens=4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(DatasetError) as caught:
        calibrate(model, [images])
    assert needle in str(caught.value), str(caught.value)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_binary_recipe_is_a_recipe_error(tmp_path):
    (tmp_path / "r.yaml").write_bytes(bytes(range(256)))
    with pytest.raises(RecipeError, match=r"r\.yaml is not a readable YAML text file"):
        load_recipe(tmp_path / "r.yaml")


@pytest.fixture
def binary_config(ckpt, tmp_path):
    folder = tmp_path / "binary"
    folder.mkdir()
    for f in ckpt.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "config.json").write_bytes(bytes(range(256)))
    return folder


def test_a_binary_config_json_is_a_checkpoint_error_in_python(binary_config):
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        vca_patch.from_pretrained(binary_config)


@pytest.mark.parametrize("command", [["fidelity", "{x}", "--device", "cpu"], ["export", "{x}"], ["push", "{x}", "a/b"]])
def test_a_binary_config_json_is_one_line_in_every_command(binary_config, command):
    args = [a.replace("{x}", str(binary_config)) for a in command]
    one_error_line(run_unchanged(args, [binary_config]), 2, "config.json is not valid JSON")


def test_model_args_for_a_transformers_folder_are_a_config_error(tmp_path):
    transformers = pytest.importorskip("transformers")
    from vca_patch.checkpoint import load_base_model

    config = transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16,
                                    image_size=32, patch_size=8)  # fmt: skip
    transformers.ViTModel(config).save_pretrained(tmp_path / "vit")
    with pytest.raises(ConfigError, match=r"model_args are timm constructor options \(img_size\)"):
        load_base_model(str(tmp_path / "vit"), pretrained=False, model_args={"img_size": 64})
    result = runner.invoke(app, ["bench", str(tmp_path / "vit"), "--resolutions", "32"])
    assert "internal error" not in result.output and result.exit_code in (1, 2), result.output


def test_an_img_size_that_is_not_whole_patches_is_refused_before_any_work(tmp_path):
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "40", "--contrast-tokens", "1"]
    args += ["-o", str(tmp_path / "o")]
    one_error_line(runner.invoke(app, args), 2, "takes 40×40 px, not a whole number of 16×16 patches",
                   "--img-size 32 or 48")  # fmt: skip
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("data", "needle"),
    [("nosuchname", "no local folder nosuchname, and as a Hugging Face dataset name: "),
     ("no/such/dir", "data folder no/such/dir does not exist")],
)  # fmt: skip
def test_data_that_is_no_folder_here_says_so(ckpt, tmp_path, monkeypatch, data, needle):
    monkeypatch.chdir(tmp_path)
    one_error_line(run_unchanged(["fidelity", str(ckpt), "--data", data, "--device", "cpu"], [ckpt]), 2, needle)
