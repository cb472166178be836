import json

import pytest
import torch

import vca_patch
from tests.support.models import tiny, trained_a_little
from vca_patch import VCAConfig, patch_model
from vca_patch.checkpoint import CheckpointError, OutputExistsError, WeightsMismatchError
from vca_patch.checkpoint import folder as checkpoint_module
from vca_patch.core.atomic import UnsafeOutputError
from vca_patch.surgery import PatchError
from vca_patch.targets import handler_for


@pytest.mark.parametrize("config", [VCAConfig(), VCAConfig(layers=[1], contrast_tokens=4, softmax="separate")])
def test_save_reload_gives_identical_outputs(tmp_path, config):
    model, args = tiny("deit_tiny_distilled_patch16_224")
    patch_model(model, config)
    trained_a_little(model, "contrast_embed", "dwc", "lambda")
    vca_patch.save_pretrained(model, tmp_path / "ckpt", model_args=args)
    again = vca_patch.from_pretrained(tmp_path / "ckpt")
    assert not again.training
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(model(x), again(x))
    # automatic choices saved as made (the default 49 contrast tokens fitted to this 4×4 grid: 16)
    config = model.vca_patch_state.config
    assert again.vca_patch_state.config == handler_for(config).as_built(config, model)
    assert [type(b.attn).__name__ for b in again.blocks] == [type(b.attn).__name__ for b in model.blocks]


def test_config_json_records_base_config_layers_and_version(tmp_path):
    model, args = tiny()
    patch_model(model, VCAConfig(layers=[0]))
    vca_patch.save_pretrained(model, tmp_path / "c", model_args=args, metadata={"base_weights": "random"})
    meta = json.loads((tmp_path / "c" / "config.json").read_text())
    assert meta["vca_patch_version"] == vca_patch.__version__
    assert meta["base"]["architecture"] == "deit_tiny_patch16_224"
    assert meta["base"]["pretrained_tag"] == "fb_in1k"
    assert meta["base"]["model_args"] == args
    assert meta["config"]["target"] == "vca" and meta["config"]["layers"] == [0]
    assert list(meta["layers"]) == ["blocks.0.attn"]
    assert (
        meta["params"]["after"] - meta["params"]["before"] == 2 * 16 * 192 + 10 * 64 + 10 * 192 + 3 + 192 * 3 + 3
    )  # temperatures, gain; the default 49 contrast tokens fitted to the 4×4 grid (16)
    card = (tmp_path / "c" / "README.md").read_text()
    assert card.startswith("---\n") and "library_name: vca-patch" in card and "license: apache-2.0" in card


def test_mano_card_shows_its_real_window_rate_tags_and_citation(tmp_path):
    model, args = tiny()
    patch_model(model, vca_patch.MANOConfig(window=2, rate=2))
    vca_patch.save_pretrained(model, tmp_path / "m", model_args=args)
    card = (tmp_path / "m" / "README.md").read_text()
    assert "with Multipole Attention (MANO)" in card
    assert "MANO attends within 2×2 windows" in card and "coarsened by 2 and" in card
    assert "| window k / rate r / levels | 2 / 2 / auto |" in card
    assert "{config" not in card and "{window" not in card  # every placeholder was filled in
    front = card.split("---")[1]
    assert "- mano" in front and "- multipole-attention" in front and "- vca\n" not in front
    assert "@article{colagrande2025mano" in card


def test_card_of_a_target_without_card_text_is_generic():
    from vca_patch.checkpoint.model_card import _method

    name, intro, rows, citation = _method({"target": "didb", "weights": True, "layers": None})
    assert name == "DIDB" and intro.startswith("vca-patch's DIDB target (Configuration of a DIDB-ViT")
    assert rows == "| weights | True |" and "didbvit2025" in citation
    name, intro, rows, citation = _method({"target": "unknown", "k": 3})
    assert (name, intro, rows) == ("UNKNOWN", "vca-patch's UNKNOWN target.", "| k | 3 |")
    assert citation == "% no citation recorded for this target"


def test_model_args_that_cannot_rebuild_the_model_are_refused(tmp_path):
    model, _ = tiny()
    patch_model(model)
    with pytest.raises(PatchError, match="pass model_args="):
        vca_patch.save_pretrained(model, tmp_path / "c")  # depth=2 is not recoverable from the name
    assert not (tmp_path / "c").exists()


def test_unpatched_model_cannot_be_saved(tmp_path):
    model, _ = tiny()
    with pytest.raises(PatchError, match="not patched"):
        vca_patch.save_pretrained(model, tmp_path / "c")


def test_non_empty_folder_is_refused_and_force_replaces_only_a_checkpoint(tmp_path):
    model, args = tiny()
    patch_model(model)
    out = tmp_path / "c"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError, match="not empty"):
        vca_patch.save_pretrained(model, out, model_args=args)
    with pytest.raises(UnsafeOutputError, match=r"did not write: keep\.txt"):
        vca_patch.save_pretrained(model, out, model_args=args, overwrite=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"
    (out / "keep.txt").unlink()
    vca_patch.save_pretrained(model, out, model_args=args)
    with pytest.raises(OutputExistsError, match="pass --force"):
        vca_patch.save_pretrained(model, out, model_args=args)
    vca_patch.save_pretrained(model, out, model_args=args, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_failed_write_leaves_the_old_checkpoint_and_no_debris(tmp_path, monkeypatch):
    model, args = tiny()
    patch_model(model)
    out = tmp_path / "c"
    vca_patch.save_pretrained(model, out, model_args=args)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint_module, "render_model_card", broken)
    with pytest.raises(OSError, match="disk full"):
        vca_patch.save_pretrained(model, out, model_args=args, overwrite=True)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["c"]


def test_loading_a_folder_that_is_not_a_checkpoint_says_what_is_missing(tmp_path):
    with pytest.raises(CheckpointError, match="nope: no such folder"):
        vca_patch.from_pretrained(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"missing model\.safetensors"):
        vca_patch.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="missing format_version, adapter, base, config, layers"):
        vca_patch.from_pretrained(tmp_path)


def test_checkpoint_from_a_newer_version_names_the_version_needed(tmp_path):
    model, args = tiny()
    patch_model(model)
    vca_patch.save_pretrained(model, tmp_path / "c", model_args=args)
    meta = json.loads((tmp_path / "c" / "config.json").read_text())
    meta.update(format_version=99, vca_patch_version="9.0.0")
    (tmp_path / "c" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"written by vca-patch 9\.0\.0.*vca-patch>=9\.0\.0"):
        vca_patch.from_pretrained(tmp_path / "c")


def test_weights_that_do_not_fit_name_the_keys(tmp_path):
    model, args = tiny()
    patch_model(model)
    vca_patch.save_pretrained(model, tmp_path / "c", model_args=args)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "c" / "model.safetensors"))
    del tensors["blocks.0.attn.dwc.weight"]
    tensors["blocks.1.attn.proj.weight"] = torch.zeros(3, 3)
    tensors["extra.weight"] = torch.zeros(1)
    save_file(tensors, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(CheckpointError) as info:
        vca_patch.from_pretrained(tmp_path / "c")
    message = str(info.value)
    assert "missing keys: blocks.0.attn.dwc.weight" in message
    assert "unexpected keys: extra.weight" in message
    assert "blocks.1.attn.proj.weight (3, 3) vs model (192, 192)" in message
    assert issubclass(CheckpointError, ValueError) and not issubclass(CheckpointError, WeightsMismatchError)
