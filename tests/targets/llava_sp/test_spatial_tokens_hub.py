"""LLaVA-SP folders and models on a local fake Hub: push (checked to load first), card, from_pretrained, offline."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from huggingface_hub import ModelCard
from typer.testing import CliRunner

import vca_patch
from tests.support.hub import go_offline
from vca_patch import VCAConfig, patch_model
from vca_patch.checkpoint.folder import CheckpointError
from vca_patch.cli import app
from vca_patch.formats.llava_sp import load_spatial_tokens, save_spatial_tokens
from vca_patch.targets.llava_sp import (
    SpatialTokensConfig,
    add_spatial_tokens,
    get_spatial_projector,
)
from vca_patch.targets.llava_sp.tiny import IMAGE_TOKEN_ID, tiny_llava, tiny_processor

pytest.importorskip("transformers")

REPO = "acme/llava-sp-tiny"


def _logits(model, count: int = 150) -> torch.Tensor:
    ids = torch.cat([torch.ones(1, 1, dtype=torch.long), torch.full((1, count), IMAGE_TOKEN_ID)], dim=1)
    pixels = torch.randn(1, 3, 48, 48, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model.eval()(input_ids=ids, pixel_values=pixels).logits


def _digest(folder) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


@pytest.fixture
def converted(tmp_path):
    """A folder written by `vca-patch convert LLAVA --to llava-sp` (model, spatial tokens, processor, card)."""
    source = tmp_path / "llava"
    tiny_llava().save_pretrained(source)
    tiny_processor().save_pretrained(source)
    out = tmp_path / "sp"
    args = ["convert", str(source), "-o", str(out), "--to", "llava-sp", "--spatial-variant", "cropping"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_push_of_a_converted_folder_uploads_it_with_a_card_and_from_pretrained_rebuilds_it(hub, converted):
    before = _digest(converted)
    result = CliRunner().invoke(app, ["push", str(converted), REPO])
    assert result.exit_code == 0, result.output
    assert len(hub.commit_payloads) == 1
    header = hub.commit_payloads[0][0]
    assert header["value"]["summary"].startswith("Upload LLaVA-SP (cropping, 6 spatial tokens, +")
    files = hub.files(REPO)
    local = {p.name for p in converted.iterdir()}
    assert set(files) == local  # model, spatial tokens, processor and tokenizer files, card
    assert {"config.json", "model.safetensors", "spatial_tokens.json", "spatial_tokens.safetensors"} <= set(files)
    assert all(files[name] == (converted / name).read_bytes() for name in local - {"README.md"})
    assert _digest(converted) == before  # the local folder is untouched

    meta = json.loads(files["spatial_tokens.json"])
    card_text = files["README.md"].decode()
    assert hub.validated_yaml and set(hub.validated_yaml) == {card_text}
    card = ModelCard(card_text)
    assert "llava-sp" in card.data.tags and card.data.pipeline_tag == "image-text-to-text"
    assert card.data.base_model is None  # converted from a local folder: no Hub base to link
    assert "| variant | cropping |" in card_text and "| spatial tokens | 6 |" in card_text
    assert f"| new parameters | {meta['parameters']:,} |" in card_text and meta["parameters"] > 0
    assert "| image tokens per image | 144 → 150 |" in card_text
    assert f"`{converted.parent / 'llava'}` (pretrained weights)" in card_text  # the base model, named
    assert f'vca_patch.from_pretrained("{REPO}")' in card_text

    reference = _logits(load_spatial_tokens(converted))
    model = vca_patch.from_pretrained(REPO)
    assert get_spatial_projector(model).spatial_config.variant == "cropping" and not model.training
    assert torch.equal(_logits(model), reference)
    fetched = {p.rsplit("/", 1)[1] for m, p in hub.log if m == "GET" and "/resolve/" in p}
    assert {"spatial_tokens.json", "spatial_tokens.safetensors", "model.safetensors"} <= fetched


def test_push_of_a_trained_model_with_a_vca_tower_then_reload_online_and_offline(hub, monkeypatch):
    model = tiny_llava()
    patch_model(model.model.vision_tower, VCAConfig(contrast_tokens=4))
    add_spatial_tokens(model, SpatialTokensConfig(variant="pooling", seed=5))
    with torch.no_grad():  # "trained": neither a fresh seed-5 build nor a fresh VCA init
        for name, p in model.named_parameters():
            if "spatial_tokens" in name or "lambda" in name or "contrast_embed" in name:
                p.add_(0.02 * torch.randn_like(p))
    reference = _logits(model)
    metadata = {"model_name": "llava-hf/llava-1.5-7b-hf", "base_weights": "pretrained"}
    vca_patch.push_to_hub(model, REPO, metadata=metadata, revision="sp")
    files = hub.files(REPO, "sp")
    assert {"spatial_tokens.json", "vision_patch.safetensors"} <= set(files)
    card = ModelCard(files["README.md"].decode())
    assert card.data.base_model == "llava-hf/llava-1.5-7b-hf" and "vca" in card.data.tags
    assert "converted to VCA (2 layers" in card.text

    again = vca_patch.from_pretrained(REPO, revision="sp")
    assert type(again.model.vision_tower.encoder.layers[0].self_attn).__name__ == "VisualContrastAttention"
    assert torch.equal(_logits(again), reference)
    go_offline(monkeypatch)
    requests = len(hub.log)
    assert torch.equal(_logits(vca_patch.from_pretrained(REPO, revision="sp")), reference)  # from the cache
    assert len(hub.log) == requests


def test_a_folder_that_does_not_load_is_never_pushed(hub, converted):
    weights = converted / "spatial_tokens.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    result = CliRunner().invoke(app, ["push", str(converted), REPO])
    assert result.exit_code == 2
    assert "does not load, so nothing was pushed" in result.output
    assert not hub.repos and not hub.log


def test_push_keeps_a_card_edited_by_hand_and_local_from_pretrained_loads_the_folder(hub, tmp_path):
    model = tiny_llava()
    add_spatial_tokens(model)
    with pytest.raises(ValueError, match="form, model_args: for vca-patch checkpoints, not LLaVA-SP models"):
        vca_patch.push_to_hub(model, REPO, form="delta", model_args={"x": 1})
    assert not hub.repos
    folder = save_spatial_tokens(model, tmp_path / "sp")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# my own card\n")
    vca_patch.push_to_hub(folder, REPO, commit_message="mine")
    assert hub.files(REPO)["README.md"] == b"---\nlicense: mit\n---\n# my own card\n"
    assert hub.commit_payloads[-1][0]["value"]["summary"] == "mine"
    local = vca_patch.from_pretrained(folder)
    assert torch.equal(_logits(local), _logits(model))


def test_a_repo_that_is_neither_a_vca_nor_a_llava_sp_checkpoint_keeps_the_original_error(hub, tmp_path):
    tiny_llava().save_pretrained(tmp_path / "plain")
    hub.seed("acme/plain-llava", {p.name: p.read_bytes() for p in (tmp_path / "plain").iterdir()})
    with pytest.raises(CheckpointError, match="is not a vca-patch config"):
        vca_patch.from_pretrained("acme/plain-llava")


def test_save_pretrained_writes_a_llava_sp_model_in_its_format(tmp_path):
    """The generic save_pretrained hands a model a registered format owns to that format: the folder holds the
    format's marker, from_pretrained gives the same logits, and options of vca-patch folders are refused first."""
    model = tiny_llava()
    add_spatial_tokens(model)
    with pytest.raises(ValueError, match="form, packed do not apply to LLaVA-SP folders"):
        vca_patch.save_pretrained(model, tmp_path / "refused", form="delta", packed=True)
    assert not (tmp_path / "refused").exists()
    folder = vca_patch.save_pretrained(model, tmp_path / "sp", metadata={"note": "saved generically"})
    assert (folder / "spatial_tokens.json").is_file()
    assert torch.equal(_logits(vca_patch.from_pretrained(folder)), _logits(model))
