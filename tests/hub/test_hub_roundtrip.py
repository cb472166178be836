"""Merged and delta checkpoints through a folder, timm's create_model, the model card, and bad local inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import timm
import torch
from huggingface_hub import ModelCard, constants
from safetensors.torch import load_file, save_file

import vca_patch
from tests.support.models import tiny
from vca_patch import VCAConfig, patch_model
from vca_patch.checkpoint.delta import DeltaError
from vca_patch.checkpoint.folder import CheckpointError
from vca_patch.checkpoint.model_card import recipe_metadata, render_model_card
from vca_patch.hub import HubUnavailableError, InvalidRepoIdError

CONFIG = VCAConfig(contrast_tokens=4)


def _converted(name: str = "deit_tiny_patch16_224"):
    """A tiny patched model, its creation kwargs, and the base weights it was converted from."""
    model, args = tiny(name)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, CONFIG)
    return model, args, base


def _images() -> torch.Tensor:
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _out(model) -> torch.Tensor:
    return model.eval()(_images())


@pytest.mark.parametrize("name", ["deit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"])
def test_merged_and_delta_round_trips_give_identical_outputs(tmp_path, name):
    model, args, base = _converted(name)
    with torch.no_grad():  # stand-in for fine-tuning: a carried weight changes too
        model.blocks[1].attn.proj.weight.add_(0.01)
    save_file(base, str(tmp_path / "base.safetensors"))
    vca_patch.save_pretrained(model, tmp_path / "merged", model_args=args)
    vca_patch.save_pretrained(
        model, tmp_path / "delta", model_args=args, form="delta", base_weights=tmp_path / "base.safetensors"
    )
    expected = _out(model)
    merged = vca_patch.from_pretrained(tmp_path / "merged")
    delta = vca_patch.from_pretrained(tmp_path / "delta", base_weights=tmp_path / "base.safetensors")
    assert torch.equal(_out(merged), expected)
    assert torch.equal(_out(delta), expected)
    with pytest.raises(DeltaError, match=r"path written in config\.json is not followed.*base_weights=PATH"):
        vca_patch.from_pretrained(tmp_path / "delta")  # the recorded local path alone is not enough

    meta = json.loads((tmp_path / "delta" / "config.json").read_text())
    assert meta["checkpoint_form"] == "delta" and meta["format_version"] == 1
    assert meta["delta"]["base_weights"] == {"path": str((tmp_path / "base.safetensors").resolve())}
    assert meta["delta"]["changed"] == 1  # blocks.1.attn.proj.weight
    stored = load_file(str(tmp_path / "delta" / "delta.safetensors"))
    assert "blocks.1.attn.proj.weight" in stored and "blocks.0.attn.qkv.weight" not in stored
    assert all(k not in base or k == "blocks.1.attn.proj.weight" for k in stored)
    assert not (tmp_path / "delta" / "model.safetensors").exists()


def test_delta_from_base_state_dict_equals_delta_from_base_file(tmp_path):
    model, args, base = _converted()
    save_file(base, str(tmp_path / "base.safetensors"))
    ref = tmp_path / "base.safetensors"
    vca_patch.save_pretrained(model, tmp_path / "a", model_args=args, form="delta", base_weights=ref)
    vca_patch.save_pretrained(
        model, tmp_path / "b", model_args=args, form="delta", base_weights=ref, base_state_dict=base
    )
    assert (
        load_file(str(tmp_path / "a" / "delta.safetensors")).keys()
        == load_file(str(tmp_path / "b" / "delta.safetensors")).keys()
    )
    assert (
        json.loads((tmp_path / "a" / "config.json").read_text())["delta"]
        == json.loads((tmp_path / "b" / "config.json").read_text())["delta"]
    )


def test_delta_refuses_base_weights_that_are_not_the_base(tmp_path):
    model, args, base = _converted()
    save_file(base, str(tmp_path / "base.safetensors"))
    vca_patch.save_pretrained(
        model, tmp_path / "d", model_args=args, form="delta", base_weights=tmp_path / "base.safetensors"
    )
    other = {k: v + 1 if v.is_floating_point() else v for k, v in base.items()}
    save_file(other, str(tmp_path / "base.safetensors"))
    with pytest.raises(DeltaError, match="fingerprint mismatch"):
        vca_patch.from_pretrained(tmp_path / "d", base_weights=tmp_path / "base.safetensors")
    (tmp_path / "base.safetensors").unlink()
    with pytest.raises(DeltaError, match="does not exist"):
        vca_patch.from_pretrained(tmp_path / "d", base_weights=tmp_path / "base.safetensors")


def _cache_base(cache: Path, hub_id: str, base: dict) -> str:
    """Put `base` in a Hugging Face cache layout as `hub_id`'s model.safetensors; return the commit."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{hub_id.replace('/', '--')}"
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    save_file(base, str(repo / "snapshots" / sha / "model.safetensors"))
    return sha


def test_delta_against_cached_hub_base_pins_the_revision_and_loads_offline(tmp_path, monkeypatch, connections):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    model, args, base = _converted()
    hub_id = model.pretrained_cfg["hf_hub_id"]
    sha = _cache_base(tmp_path / "cache", hub_id, base)
    vca_patch.save_pretrained(model, tmp_path / "d", model_args=args, form="delta")  # default: the base's Hub id
    meta = json.loads((tmp_path / "d" / "config.json").read_text())
    assert meta["delta"]["base_weights"] == {"hf_hub_id": hub_id, "revision": sha, "filename": "model.safetensors"}
    assert torch.equal(_out(vca_patch.from_pretrained(tmp_path / "d")), _out(model))

    card = ModelCard.load(tmp_path / "d" / "README.md")
    assert card.data.base_model == hub_id and card.data.base_model_relation == "adapter"

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    connections.clear()
    with pytest.raises(
        HubUnavailableError, match=r"unreachable here \(HF_HUB_OFFLINE is set\).*not in the local cache"
    ):
        vca_patch.from_pretrained(tmp_path / "d")
    assert connections == []  # offline: fails at once, without trying the network


def test_timm_create_model_loads_converted_checkpoints_from_a_folder(tmp_path):
    model, args, base = _converted()
    save_file(base, str(tmp_path / "base.safetensors"))
    vca_patch.save_pretrained(model, tmp_path / "m", model_args=args)
    vca_patch.save_pretrained(
        model, tmp_path / "d", model_args=args, form="delta", base_weights=tmp_path / "base.safetensors"
    )
    expected = _out(model)
    for folder, extra in (("m", {}), ("d", {"base_weights": tmp_path / "base.safetensors"})):
        loaded = timm.create_model(f"local-dir:{tmp_path / folder}", pretrained=True, **extra)
        assert torch.equal(_out(loaded), expected)
        assert loaded.pretrained_cfg["architecture"] == "vca_patch"
    with pytest.raises(DeltaError, match="not followed"):
        timm.create_model(f"local-dir:{tmp_path / 'd'}", pretrained=True)

    fresh = timm.create_model(f"local-dir:{tmp_path / 'm'}")  # timm's default: architecture, fresh weights
    assert fresh.state_dict().keys() == model.state_dict().keys()
    assert not torch.equal(_out(fresh), expected)
    head = timm.create_model(f"local-dir:{tmp_path / 'm'}", pretrained=True, num_classes=7)
    assert _out(head).shape == (2, 7)
    with pytest.raises(ValueError, match="cannot change img_size"):
        timm.create_model(f"local-dir:{tmp_path / 'm'}", img_size=96)


def test_config_json_keeps_format_1_keys_and_adds_timm_keys(tmp_path):
    model, args, _ = _converted()
    vca_patch.save_pretrained(model, tmp_path / "m", model_args=args)
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    for key in ("vca_patch_version", "format_version", "adapter", "base", "config", "layers", "params", "metadata"):
        assert key in meta
    assert meta["format_version"] == 1 and meta["checkpoint_form"] == "merged"
    assert meta["architecture"] == "vca_patch"
    assert meta["model_args"] == meta["base"]["model_args"]
    assert meta["pretrained_cfg"]["input_size"] == [3, 64, 64]
    assert "hf_hub_id" not in meta["pretrained_cfg"] and "url" not in meta["pretrained_cfg"]


def test_old_checkpoint_without_new_keys_still_loads(tmp_path):
    model, args, _ = _converted()
    vca_patch.save_pretrained(model, tmp_path / "m", model_args=args)
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    for key in ("checkpoint_form", "architecture", "model_args", "pretrained_cfg"):
        del meta[key]
    (tmp_path / "m" / "config.json").write_text(json.dumps(meta))
    assert torch.equal(_out(vca_patch.from_pretrained(tmp_path / "m")), _out(model))


# -- model card ---------------------------------------------------------------------------------------------


def _card_meta(tmp_path, metadata: dict) -> dict:
    model, args, _ = _converted()
    vca_patch.save_pretrained(model, tmp_path / "m", model_args=args, metadata=metadata)
    return json.loads((tmp_path / "m" / "config.json").read_text())


def test_model_card_of_a_converted_only_checkpoint(tmp_path):
    probe = {"relative_error": 0.31, "cosine": 0.95, "max_abs_diff": 1.2, "top1_agreement": 0.75}
    meta = _card_meta(tmp_path, {"base_weights": "pretrained", "model_name": "deit_tiny_patch16_224", "probe": probe})
    text = (tmp_path / "m" / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.library_name == "vca-patch"
    assert card.data.base_model == "timm/deit_tiny_patch16_224.fb_in1k"
    assert card.data.base_model_relation == "finetune"
    assert card.data.license == "apache-2.0"
    assert {"vca", "image-classification", "timm"} <= set(card.data.tags)
    assert card.data.eval_results is None and card.data.datasets is None
    assert "| blocks converted | 2 (0, 1) |" in text and "| contrast tokens n | 4 |" in text
    added = meta["params"]["after"] - meta["params"]["before"]
    assert f"(+{added:,})" in text
    assert "| cosine | 0.95 |" in text
    assert "No fine-tuning recipe has been run" in text
    assert 'vca_patch.from_pretrained("path/or/repo-id")' in text

    with_repo = render_model_card(meta, repo_id="acme/deit-tiny-vca")
    assert 'vca_patch.from_pretrained("acme/deit-tiny-vca")' in with_repo
    assert 'timm.create_model("hf-hub:acme/deit-tiny-vca", pretrained=True)' in with_repo


def test_model_card_of_a_fine_tuned_checkpoint_reports_recipe_and_model_index(tmp_path):
    (tmp_path / "metrics.json").write_text(
        json.dumps(
            {
                "dataset": "imagenet-1k",
                "split": "validation",
                "teacher_top1": 0.722,
                "before_top1": 0.081,
                "after_top1": 0.705,
                "agreement_after": 0.91,
            }
        )
    )
    recipe = {"name": "distill-3stage", "images": 200000, "stages": [{"name": "attention-transfer", "epochs": 2}]}
    metadata = {"base_weights": "pretrained", **recipe_metadata(recipe, tmp_path / "metrics.json")}
    meta = _card_meta(tmp_path, metadata)
    card = ModelCard(render_model_card(meta, repo_id="acme/deit-tiny-vca"))
    assert card.data.datasets == ["imagenet-1k"]
    top1, agreement = card.data.eval_results
    assert (top1.task_type, top1.dataset_type, top1.dataset_split) == (
        "image-classification",
        "imagenet-1k",
        "validation",
    )
    assert (top1.metric_type, top1.metric_value) == ("accuracy", pytest.approx(70.5))
    assert agreement.metric_value == pytest.approx(91.0)
    assert card.data.model_name == "acme/deit-tiny-vca"
    assert "Recipe `distill-3stage`" in card.text and '"attention-transfer"' in card.text
    assert "| top-1, original model (teacher) | 72.20% |" in card.text
    assert "| top-1, after fine-tuning | 70.50% |" in card.text


def test_bad_metadata_is_refused_before_anything_is_written(tmp_path):
    model, args, _ = _converted()
    with pytest.raises(ValueError, match=r"metadata\['metrics'\] values must be numbers; not: after_top1"):
        vca_patch.save_pretrained(model, tmp_path / "m", model_args=args, metadata={"metrics": {"after_top1": "70%"}})
    with pytest.raises(ValueError, match="'name'"):
        vca_patch.save_pretrained(model, tmp_path / "m", model_args=args, metadata={"recipe": {"lr": 1}})
    with pytest.raises(ValueError, match="form must be one of"):
        vca_patch.save_pretrained(model, tmp_path / "m", model_args=args, form="lora")
    assert not (tmp_path / "m").exists()


# -- bad local inputs ---------------------------------------------------------------------------------------


def test_folder_that_is_not_a_converted_checkpoint_says_what_is_missing(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    with pytest.raises(CheckpointError, match=r"missing config\.json, model\.safetensors"):
        vca_patch.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"architecture": "vit_base_patch16_224", "num_classes": 10}))
    (folder / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"plain timm model config .*convert it with `vca-patch convert`"):
        vca_patch.from_pretrained(folder)
    (folder / "config.json").write_text(json.dumps({"format_version": 1, "checkpoint_form": "delta"}))
    with pytest.raises(CheckpointError, match=r"missing delta\.safetensors"):
        vca_patch.from_pretrained(folder)


def test_checkpoint_from_a_newer_vca_patch_names_the_version_needed(tmp_path):
    model, args, _ = _converted()
    vca_patch.save_pretrained(model, tmp_path / "c", model_args=args)
    meta = json.loads((tmp_path / "c" / "config.json").read_text())
    meta.update(format_version=2, vca_patch_version="0.4.0")
    (tmp_path / "c" / "config.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"vca-patch 0\.4\.0 \(format 2\).*pip install -U 'vca-patch>=0\.4\.0'"):
        vca_patch.from_pretrained(str(tmp_path / "c"))


def test_a_missing_path_or_invalid_repo_id_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="nope: no such folder"):
        vca_patch.from_pretrained(str(tmp_path / "nope"))
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"file\.txt is a file; a checkpoint is the folder"):
        vca_patch.from_pretrained(tmp_path / "file.txt")
    with pytest.raises(HubUnavailableError, match="no local folder acme/missing, and as a Hub repo id"):
        vca_patch.from_pretrained("acme/missing")  # offline in the tests
    with pytest.raises(
        InvalidRepoIdError, match=r"no local folder acme/bad--name, and as a Hub repo id: .* not a valid Hub repo id"
    ):
        vca_patch.from_pretrained("acme/bad--name")
    with pytest.raises(ValueError, match="revision='v1' applies to Hub repos"):
        vca_patch.from_pretrained(tmp_path, revision="v1")
