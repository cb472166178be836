"""The child of a converted diffusers attention that holds the replacement's new parameters is named for the target
(`attn.mano.…` for MANO, `attn.vca.…` for VCA: tests/families/diffusers/test_diffusers_dit.py); checkpoints saved
when every target's holder was `vca` still load, and a plug-in installer written before the target was passed works."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[diffusers]')")

from safetensors.torch import load_file, save_file  # noqa: E402

from tests.support.diffusers_models import latent, tiny_pixart  # noqa: E402
from vca_patch import MANOConfig, patch_model, unpatch_model  # noqa: E402
from vca_patch.checkpoint.folder import from_pretrained, save_pretrained  # noqa: E402
from vca_patch.families import register_family, unregister_family  # noqa: E402
from vca_patch.families.diffusers.dit import DiffusersDiTAdapter, patched_processors  # noqa: E402
from vca_patch.families.diffusers.processor import holder_name  # noqa: E402
from vca_patch.train.params import parameter_groups  # noqa: E402

CONFIG = MANOConfig(window=4)  # 8x8 grid: a coarse level beside the 4x4 windows
SITES = ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
WEIGHTS = {"merged": "model.safetensors", "delta": "delta.safetensors"}


def pixart_call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    B = x.shape[0]
    text = latent(B, 5, 24, seed=3).to(x)
    return model(x, encoder_hidden_states=text, timestep=torch.arange(B) * 7 + 3, added_cond_kwargs={}).sample


def _perturbed(model: nn.Module, holder: str) -> nn.Module:
    """`model` with its holders' new parameters moved off their init, so that a reload that lost them would show."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for path in SITES:
            for p in model.get_submodule(f"{path}.{holder}").parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=generator))
    return model


def _saved_mano(folder: Path, form: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A MANO-converted tiny PixArt (new parameters perturbed) saved to `folder/ckpt` in `form`: the probe latent,
    the converted model's output on it, and the keyword arguments that load the folder."""
    model, x = tiny_pixart(), latent(2, 4, 16, 24)
    base = folder / "base.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(base))
    patch_model(model, CONFIG)
    with torch.no_grad():
        expected = pixart_call(_perturbed(model, "mano"), x)
    save_pretrained(model, folder / "ckpt", **({"form": "delta", "base_weights": base} if form == "delta" else {}))
    return x, expected, {"base_weights": base} if form == "delta" else {}


def test_a_mano_conversion_holds_its_new_parameters_under_mano():
    model = tiny_pixart()
    before = set(model.state_dict())
    patch_model(model, CONFIG)
    added = set(model.state_dict()) - before
    assert added and all(k.split(".mano.")[0] in SITES for k in added)
    attn = model.transformer_blocks[0].attn1
    assert "vca" not in attn._modules and DiffusersDiTAdapter.new_parameters(attn) is attn.mano
    assert attn.processor.holder == "mano"
    new = {name for name, _ in parameter_groups(model)["new"]}
    assert new == {k for k in added if k.endswith("weight")}  # training finds them under the new name
    unpatch_model(model)
    assert set(model.state_dict()) == before and "mano" not in attn._modules
    assert holder_name("temp-softmax") == "temp_softmax" and holder_name(None) == "vca"


@pytest.mark.parametrize("form", ["merged", "delta"])
def test_a_mano_checkpoint_saves_mano_keys_and_reloads_to_the_same_outputs(tmp_path, diffusers_loadable, form):
    x, expected, options = _saved_mano(tmp_path, form)
    stored = load_file(str(tmp_path / "ckpt" / WEIGHTS[form]))
    assert any(".mano." in k for k in stored) and not any(".vca." in k for k in stored)
    loaded = from_pretrained(tmp_path / "ckpt", **options)
    assert sorted(patched_processors(loaded)) == SITES
    with torch.no_grad():
        assert torch.equal(pixart_call(loaded, x), expected)


@pytest.mark.parametrize("form", ["merged", "delta"])
def test_a_checkpoint_saved_with_the_old_vca_holder_loads_into_the_mano_holder(tmp_path, diffusers_loadable, form):
    """Before holders were named for their target, a MANO checkpoint held `attn.vca.…`: it loads, the same."""
    x, expected, options = _saved_mano(tmp_path, form)
    weights = tmp_path / "ckpt" / WEIGHTS[form]
    old = {k.replace(".mano.", ".vca."): v for k, v in load_file(str(weights)).items()}
    assert sum(".attn1.vca." in k for k in old) == 4  # down and up of both sites
    save_file(old, str(weights))
    loaded = from_pretrained(tmp_path / "ckpt", **options)
    assert "vca" not in loaded.transformer_blocks[0].attn1._modules
    assert torch.equal(
        loaded.transformer_blocks[1].attn1.mano.down.weight, old["transformer_blocks.1.attn1.vca.down.weight"]
    )
    with torch.no_grad():
        assert torch.equal(pixart_call(loaded, x), expected)


class OldInstallerAdapter(DiffusersDiTAdapter):
    """A plug-in family written before the target's name reached `install_replacement` (three arguments)."""

    name = "test-old-installer"

    def install_replacement(self, model: nn.Module, path: str, layer: nn.Module) -> Any:
        return super().install_replacement(model, path, layer)


@pytest.fixture
def old_installer() -> Iterator[None]:
    register_family(OldInstallerAdapter, before=DiffusersDiTAdapter.name)
    try:
        yield
    finally:
        unregister_family(OldInstallerAdapter.name)


def test_an_installer_that_takes_no_target_keeps_the_default_holder(old_installer):
    model, x = tiny_pixart(), latent(2, 4, 16, 24)
    with torch.no_grad():
        reference = pixart_call(model, x)
    patch_model(model, CONFIG)
    attn = model.transformer_blocks[0].attn1
    assert attn.processor.holder == "vca" and OldInstallerAdapter.new_parameters(attn) is attn.vca
    assert {name.split(".vca.")[0] for name, _ in parameter_groups(model)["new"]} == set(SITES)
    with torch.no_grad():
        assert pixart_call(_perturbed(model, "vca"), x).isfinite().all()
    unpatch_model(model)
    assert "vca" not in attn._modules
    with torch.no_grad():
        assert torch.equal(pixart_call(model, x), reference)
