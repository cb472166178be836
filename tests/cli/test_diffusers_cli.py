"""diffusers models through the CLI and checkpoints: `inspect` and `convert` on a local pipeline folder
(model_index.json + transformer/) or transformer folder, a Hub id offline, the skipped list, and delta checkpoints
whose base is a local diffusers folder (sharded too) or a Hub repo's transformer/ subfolder at a pinned commit."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[diffusers]')")

import vca_patch  # noqa: E402
from tests.support.diffusers_models import (  # noqa: E402
    tiny_dit,
    tiny_flux,
    tiny_pixart,
)
from vca_patch import VCAConfig, patch_model  # noqa: E402
from vca_patch.checkpoint import load_base_model  # noqa: E402
from vca_patch.checkpoint.delta import DeltaError  # noqa: E402
from vca_patch.cli import app  # noqa: E402
from vca_patch.families.diffusers.dit import patched_processors  # noqa: E402
from vca_patch.families.diffusers.probe import attention_errors, predict, probe_inputs  # noqa: E402
from vca_patch.families.diffusers.source import SOURCE, load_diffusers_transformer  # noqa: E402
from vca_patch.surgery import inspect_model  # noqa: E402

runner = CliRunner()
CONFIG = VCAConfig(contrast_tokens=16)


def invoke(*args: str):
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def pipeline_folder(root, transformer, pipeline="DiTPipeline", **save):
    """A diffusers pipeline folder: model_index.json naming the transformer, and transformer/ saved in it."""
    transformer.save_pretrained(root / "transformer", **save)
    index = {"_class_name": pipeline, "_diffusers_version": diffusers.__version__}
    (root / "model_index.json").write_text(
        json.dumps({**index, "transformer": ["diffusers", type(transformer).__name__]})
    )
    return root


@pytest.fixture(scope="module")
def dit_pipeline(tmp_path_factory):
    model = tiny_dit()
    return model, pipeline_folder(tmp_path_factory.mktemp("dit"), model)


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    model = tiny_flux()
    folder = tmp_path_factory.mktemp("flux") / "transformer"
    model.save_pretrained(folder)
    return model, folder


# -- loading -------------------------------------------------------------------------------------------------


def test_pipeline_and_transformer_folders_load_with_their_weights(dit_pipeline, flux_folder):
    for original, folder in (dit_pipeline, flux_folder):
        loaded = load_base_model(str(folder))
        assert type(loaded) is type(original) and not loaded.training
        assert all(torch.equal(v, original.state_dict()[k]) for k, v in loaded.state_dict().items())
        assert loaded.__dict__[SOURCE] == {"hf_hub_id": None, "subfolder": None, "revision": None}
    torch.manual_seed(123)
    random = load_base_model(str(dit_pipeline[1]), pretrained=False)
    assert not torch.equal(random.pos_embed.proj.weight, dit_pipeline[0].pos_embed.proj.weight)


def test_a_pipeline_without_a_transformer_and_an_offline_hub_id_fail_with_one_clear_line(tmp_path, monkeypatch):
    (tmp_path / "unet").mkdir()
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    result = invoke("inspect", str(tmp_path))
    assert result.exit_code == 1
    assert "pipeline folder without a transformer/ subfolder (it has unet)" in result.output

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = invoke("convert", "acme/not-cached-dit", "-o", str(tmp_path / "out"))
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    assert "unreachable here (HF_HUB_OFFLINE is set)" in result.output and "model_index.json" in result.output
    assert "Traceback" not in result.output


def test_a_transformer_folder_of_an_unsupported_class_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"_class_name": "UNet2DConditionModel", "_diffusers_version": diffusers.__version__})
    )
    result = invoke("inspect", str(tmp_path))
    assert result.exit_code == 1 and "'UNet2DConditionModel' is not a diffusion transformer" in result.output


# -- inspect ---------------------------------------------------------------------------------------------------


def test_inspect_lists_kind_and_grid_per_site(dit_pipeline, flux_folder, tmp_path):
    result = invoke("inspect", str(dit_pipeline[1]), "--contrast-tokens", "16")
    assert result.exit_code == 0, result.output
    assert result.output.count("image self-attention") == 2 and "8x8 at sample_size" in result.output

    result = invoke("inspect", str(flux_folder[1]), "--contrast-tokens", "16")
    assert result.exit_code == 0, result.output
    assert result.output.count("joint attention (image + text)") == 2
    assert result.output.count("single-stream joint attention (text + image)") == 2
    assert "from img_ids (any size) + text tokens (text first)" in result.output

    pixart = tiny_pixart()
    pixart.save_pretrained(tmp_path / "pixart")
    result = invoke("inspect", str(tmp_path / "pixart"), "--contrast-tokens", "16")
    assert result.exit_code == 0, result.output
    assert result.output.count("cross-attention (image -> text)") == 2
    assert "skip: cross-attention (image -> text, already O(N·L)): left as it is" in result.output


def test_ip_adapter_and_linear_processors_are_listed_as_skipped_with_why(tmp_path):
    from diffusers.models.attention_processor import IPAdapterAttnProcessor2_0
    from diffusers.models.transformers.transformer_flux import FluxIPAdapterAttnProcessor

    dit = tiny_dit()
    dit.transformer_blocks[0].attn1.set_processor(IPAdapterAttnProcessor2_0(32, cross_attention_dim=32))
    report = inspect_model(dit, CONFIG)
    assert [s.path for s in report.patched] == ["transformer_blocks.1.attn1"]
    (skipped,) = report.skipped
    assert "unknown attention processor" in skipped.reason and "IPAdapterAttnProcessor2_0" in skipped.reason

    flux = tiny_flux()
    flux.transformer_blocks[1].attn.set_processor(FluxIPAdapterAttnProcessor(32, cross_attention_dim=24))
    report = inspect_model(flux, CONFIG)
    assert "transformer_blocks.1.attn" not in [s.path for s in report.patched] and len(report.patched) == 3
    (skipped,) = report.skipped
    assert skipped.path == "transformer_blocks.1.attn" and "FluxIPAdapterAttnProcessor" in skipped.reason

    torch.manual_seed(0)
    diffusers.SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24,
        sample_size=16, patch_size=1,
    ).save_pretrained(tmp_path / "sana")  # fmt: skip
    result = invoke("inspect", str(tmp_path / "sana"))
    assert result.exit_code == 1 and "already linear attention (SanaLinearAttnProcessor2_0)" in result.output


# -- convert ---------------------------------------------------------------------------------------------------


def test_convert_a_dit_pipeline_folder_writes_the_patched_transformer(dit_pipeline, tmp_path):
    original, folder = dit_pipeline
    out = tmp_path / "out"
    result = invoke("convert", str(folder), "-o", str(out), "--contrast-tokens", "16", "--probe-size", "2")
    assert result.exit_code == 0, result.output
    assert "attention error mean" in result.output and "prediction relative error" in result.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["adapter"] == "diffusers-dit" and meta["base"]["architecture"] == "DiTTransformer2DModel"
    loaded = vca_patch.from_pretrained(out)

    mine = copy.deepcopy(original)  # the folder's weights, patched with the same config
    inputs = probe_inputs(mine, 2, seed=0)
    with torch.no_grad():
        reference = predict(mine, inputs)
        patch_model(mine, CONFIG)
        expected = predict(mine, inputs)
        assert torch.equal(predict(loaded, inputs), expected)
    error = float((expected - reference).norm() / reference.norm())
    assert meta["metadata"]["probe"]["relative_error"] == pytest.approx(error, rel=1e-6)


def test_convert_flux_converts_double_and_single_stream_blocks(flux_folder, tmp_path):
    out = tmp_path / "out"
    result = invoke(
        "convert", str(flux_folder[1]), "-o", str(out), "--contrast-tokens", "16", "--probe-size", "1", "--seed", "3"
    )
    assert result.exit_code == 0, result.output
    assert "4 / 0" in result.output  # 2 double-stream + 2 single-stream sites, none skipped
    loaded = vca_patch.from_pretrained(out)
    assert sorted(patched_processors(loaded)) == [
        "single_transformer_blocks.0.attn", "single_transformer_blocks.1.attn",
        "transformer_blocks.0.attn", "transformer_blocks.1.attn",
    ]  # fmt: skip


def test_convert_refuses_calibration_images_and_an_image_size_for_diffusers(dit_pipeline, tmp_path):
    (tmp_path / "images").mkdir()
    result = invoke(
        "convert", str(dit_pipeline[1]), "-o", str(tmp_path / "a"), "--calibration-data", str(tmp_path / "images")
    )
    assert result.exit_code == 2 and "random latents, timesteps and conditions" in result.output
    result = invoke("inspect", str(dit_pipeline[1]), "--img-size", "64")
    assert result.exit_code == 2 and "is a diffusers model: no img_size" in result.output
    assert not (tmp_path / "a").exists()


def test_attention_errors_are_zero_for_an_exact_conversion():
    """A layer made to compute its original exactly (its processor swapped back) measures 0; VCA does not."""
    model = tiny_dit()
    patch_model(model, CONFIG)
    inputs = probe_inputs(model, 2, seed=1)
    errors = attention_errors(model, inputs)
    assert sorted(errors) == ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    assert all(e > 1e-2 for e in errors.values())
    processor = patched_processors(model)["transformer_blocks.0.attn1"]
    processor.layer.forward = lambda x, layout=None: processor.original(  # type: ignore[method-assign]
        model.transformer_blocks[0].attn1, x
    )
    assert attention_errors(model, inputs)["transformer_blocks.0.attn1"] == 0.0


# -- delta checkpoints -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("sharded", [False, True])
def test_delta_against_a_local_diffusers_folder_reloads_with_its_subfolder(tmp_path, sharded):
    from safetensors.torch import load_file

    original = tiny_dit()
    folder = pipeline_folder(tmp_path / "pipe", original, **({"max_shard_size": "40KB"} if sharded else {}))
    index = folder / "transformer" / "diffusion_pytorch_model.safetensors.index.json"
    assert index.is_file() == sharded
    model = load_diffusers_transformer(str(folder))
    patch_model(model, CONFIG)
    vca_patch.save_pretrained(model, tmp_path / "ckpt", form="delta", base_weights=folder)
    ref = json.loads((tmp_path / "ckpt" / "config.json").read_text())["delta"]["base_weights"]
    weights = index if sharded else folder / "transformer" / "diffusion_pytorch_model.safetensors"
    assert ref == {"path": str(weights.resolve())}
    assert all(".vca." in k for k in load_file(str(tmp_path / "ckpt" / "delta.safetensors")))

    loaded = vca_patch.from_pretrained(tmp_path / "ckpt", base_weights=folder)
    inputs = probe_inputs(model, 2, seed=2)
    with torch.no_grad():
        assert torch.equal(predict(loaded, inputs), predict(model, inputs))
    other = pipeline_folder(tmp_path / "other", tiny_dit(num_classes=10).requires_grad_(False).apply(_jitter))
    with pytest.raises(DeltaError, match="fingerprint mismatch"):
        vca_patch.from_pretrained(tmp_path / "ckpt", base_weights=other)


def _jitter(module: torch.nn.Module) -> None:
    for param in module.parameters(recurse=False):
        param.add_(0.01)


def test_delta_against_a_hub_pipeline_records_repo_subfolder_and_commit(hub, tmp_path, monkeypatch):
    from huggingface_hub import constants

    original = tiny_dit()
    folder = pipeline_folder(tmp_path / "pipe", original)
    files = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    sha = hub.seed("acme/tiny-dit", files)

    model = load_base_model("acme/tiny-dit")  # online (to the fake Hub): the pipeline's transformer/
    assert model.__dict__[SOURCE] == {"hf_hub_id": "acme/tiny-dit", "subfolder": "transformer", "revision": sha}
    assert all(torch.equal(v, original.state_dict()[k]) for k, v in model.state_dict().items())
    patch_model(model, CONFIG)
    vca_patch.save_pretrained(model, tmp_path / "ckpt", form="delta")  # the base named by where it came from
    meta = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert meta["base"]["hf_hub_id"] == "acme/tiny-dit" and meta["base"]["subfolder"] == "transformer"
    assert meta["delta"]["base_weights"] == {
        "hf_hub_id": "acme/tiny-dit", "revision": sha, "filename": "diffusion_pytorch_model.safetensors",
        "subfolder": "transformer",
    }  # fmt: skip

    # Loaded by diffusers itself (no record of the subfolder): the weights are found in transformer/ all the same.
    del model.__dict__[SOURCE]
    model.register_to_config(_name_or_path="acme/tiny-dit")
    vca_patch.save_pretrained(model, tmp_path / "ckpt2", form="delta")
    again = json.loads((tmp_path / "ckpt2" / "config.json").read_text())["delta"]["base_weights"]
    assert again == meta["delta"]["base_weights"]

    hub.seed("acme/tiny-dit", {**files, "transformer/diffusion_pytorch_model.safetensors": b"moved on"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the pinned commit is in the cache: no Hub needed
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    loaded = vca_patch.from_pretrained(tmp_path / "ckpt")
    inputs = probe_inputs(model, 2, seed=4)
    with torch.no_grad():
        assert torch.equal(predict(loaded, inputs), predict(model, inputs))


def test_a_recorded_subfolder_must_be_one_plain_folder_name(tmp_path):
    from vca_patch.checkpoint.config_guard import UnsafeConfigError
    from vca_patch.checkpoint.delta import check_base_weights_ref

    good = {"hf_hub_id": "acme/x", "revision": "a" * 40, "filename": "diffusion_pytorch_model.safetensors"}
    check_base_weights_ref({**good, "subfolder": "transformer"}, "config.json")
    check_base_weights_ref({**good, "filename": "diffusion_pytorch_model.safetensors.index.json"}, "config.json")
    for subfolder in ("../secrets", "/etc", "a/b", 3):
        with pytest.raises(UnsafeConfigError, match="subfolder"):
            check_base_weights_ref({**good, "subfolder": subfolder}, "config.json")
    with pytest.raises(UnsafeConfigError, match="filename"):
        check_base_weights_ref({**good, "filename": "../x.safetensors.index.json"}, "config.json")
