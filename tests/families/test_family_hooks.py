"""Issue #51 (family hooks instead of branches): an out-of-tree family gets the defaults of the hooks shared code
asks a family (probing, calling, describing its sites, where new parameters live, input sizes, image inputs), and
shared code (cli, checkpoint, train) calls its overrides, found through the registry."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import vca_patch
from tests.integration.test_extending import PlainViT, PlainViTAdapter
from vca_patch.checkpoint import base_model, load_base_model
from vca_patch.cli import app
from vca_patch.cli import convert as convert_cli
from vca_patch.cli import fidelity as fidelity_cli
from vca_patch.core.errors import UnsafeConfigError
from vca_patch.families import (
    ModelAdapter,
    ModelLibrary,
    hooks_for,
    library_for_name,
    register_family,
    unregister_family,
)
from vca_patch.train.params import parameter_groups

runner = CliRunner()
CALLS: list[str] = []  # the overriding hooks that shared code called, in order


class DefaultViT(PlainViT):
    """A model whose family declares none of the new hooks."""


class HookedViT(PlainViT):
    """A model whose family overrides every new hook."""

    def __init__(self) -> None:
        super().__init__()
        self.vca_patch_input_size = (3, 32, 32)


class HookedLibrary(ModelLibrary):
    name = "hooked"
    load_priority = 5  # before every built-in library

    def check_base(self, base: dict[str, Any], where: str) -> None:
        if base != {"library": self.name, "architecture": "HookedViT"}:
            raise UnsafeConfigError(f"{where}: base = {base!r} is not allowed")

    def claims(self, name: str) -> bool:
        return name in ("hooked-vit", "imageless-vit")

    def load(self, name: str, *, pretrained: bool = True, weights: Any = None, model_args: Any = None) -> nn.Module:
        CALLS.append(f"load {name}")
        return HookedViT()

    def sizes_from_config(self, name: str) -> bool:
        return name == "hooked-vit"

    def takes_no_images(self, name: str) -> bool:
        return name == "imageless-vit"


class DefaultAdapter(PlainViTAdapter):
    name = "test-hooks-default"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return isinstance(model, DefaultViT)


class HookedAdapter(PlainViTAdapter):
    name = "test-hooks-hooked"
    library = HookedLibrary()
    sites_title = "Hooked attention"

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return isinstance(model, HookedViT)

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        return {"library": "hooked", "architecture": "HookedViT"}

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        return HookedViT()

    @classmethod
    def probe_inputs(cls, model: nn.Module, batch_size: int, seed: int) -> Any:
        CALLS.append("probe_inputs")
        return {"images": torch.randn(batch_size, 3, 32, 32, generator=torch.Generator().manual_seed(seed))}

    @classmethod
    def predict(cls, model: nn.Module, inputs: Any) -> torch.Tensor:
        CALLS.append("predict")
        return model(inputs["images"])  # a dict the default `model(inputs)` could not take

    @classmethod
    def probe_fidelity(
        cls, model: nn.Module, inputs: Any, prediction: dict[str, float], batch_size: int
    ) -> tuple[dict[str, float], str] | None:
        CALLS.append("probe_fidelity")
        return {"hooked_error": prediction["relative_error"]}, f"{batch_size} hooked probes"

    @classmethod
    def describe_sites(cls, model: nn.Module) -> list[dict[str, str]]:
        CALLS.append("describe_sites")
        return [{"module": f"layers.{i}.mixer", "kind": "hooked kind", "tokens": "4x4"} for i in range(3)]

    @classmethod
    def new_parameters(cls, module: nn.Module) -> nn.Module | None:
        CALLS.append("new_parameters")
        return nn.Module()  # a holder with no parameters: every parameter of the site counts as carried


@pytest.fixture
def families() -> Iterator[None]:
    register_family(DefaultAdapter)
    register_family(HookedAdapter)
    CALLS.clear()
    try:
        yield
    finally:
        unregister_family(HookedAdapter.name)
        unregister_family(DefaultAdapter.name)


def test_a_family_that_declares_no_hook_gets_the_defaults(families):
    model = DefaultViT().eval()
    model.vca_patch_input_size = (3, 32, 32)
    family = hooks_for(model)
    assert family is DefaultAdapter and family.takes_images and family.sites_title == "Attention sites"
    probe = family.probe_inputs(model, 2, 0)
    assert probe.shape == (2, 3, 32, 32)  # a random image batch at the model's input size
    assert torch.equal(family.predict(model, probe), model(probe))
    assert family.probe_fidelity(model, probe, {"relative_error": 0.0}, 2) is None  # measured on images
    assert family.describe_sites(model) == []
    assert family.new_parameters(model.layers[0].mixer) is None
    library = ModelLibrary()
    assert not library.sizes_from_config("x") and not library.takes_no_images("x") and library.legacy_exports() == {}
    assert hooks_for(nn.Linear(2, 2)) is ModelAdapter  # no family: the base class's defaults


def test_loading_and_sizing_ask_the_library_that_claims_the_name(families):
    assert library_for_name("hooked-vit") is HookedAdapter.library
    assert isinstance(load_base_model("hooked-vit"), HookedViT) and CALLS == ["load hooked-vit"]
    assert base_model.sizes_from_config("hooked-vit") and base_model.is_transformers_source("hooked-vit")
    assert not base_model.sizes_from_config("deit_tiny_patch16_224")
    assert convert_cli._takes_no_images("imageless-vit") and not convert_cli._takes_no_images("hooked-vit")


def test_inspect_shows_the_family_site_table(families):
    result = runner.invoke(app, ["inspect", "hooked-vit"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "describe_sites" in CALLS and "Hooked attention" in result.output and "hooked kind" in result.output


def test_convert_probes_calls_and_measures_through_the_family(families, tmp_path: Path):
    out = tmp_path / "out"
    result = runner.invoke(
        app, ["convert", "hooked-vit", "-o", str(out), "--no-pretrained", "--probe-size", "3"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert CALLS == ["load hooked-vit", "probe_inputs", "predict", "predict", "probe_fidelity"]
    assert "(3 hooked probes)" in result.output and "hooked error" in result.output  # no image calibration ran
    assert isinstance(vca_patch.from_pretrained(out), HookedViT)


def test_convert_refuses_images_for_a_family_that_takes_none(families, tmp_path: Path, monkeypatch):
    images = tmp_path / "images"
    images.mkdir()
    args = ["convert", "imageless-vit", "-o", str(tmp_path / "out"), "--calibration-data", str(images)]
    result = runner.invoke(app, args)  # refused before loading: the library says so from the name
    assert result.exit_code == 2 and "takes images for vision encoders" in result.output, result.output
    assert CALLS == []
    monkeypatch.setattr(HookedAdapter, "takes_images", False)
    model = HookedViT()
    vca_patch.patch_model(model, vca_patch.VCAConfig())
    assert not fidelity_cli._takes_images(model)  # `fidelity` measures it on denoising-style probes


def test_parameter_groups_ask_the_family_where_new_parameters_live(families):
    default = DefaultViT()
    vca_patch.patch_model(default, vca_patch.VCAConfig())
    assert parameter_groups(default)["new"]  # replaced as a whole: the replacement's own parameters are new
    hooked = HookedViT()
    vca_patch.patch_model(hooked, vca_patch.VCAConfig())
    groups = parameter_groups(hooked)
    assert CALLS.count("new_parameters") == 3
    assert groups["new"] == [] and groups.get("lambda", []) == []  # the holder it named has none: all carried
    assert {name for name, _ in groups["carried"]} >= {f"layers.{i}.mixer.qkv.weight" for i in range(3)}


def test_old_imports_of_the_library_checks_and_loaders_still_resolve():
    """checkpoint/ imports no family: the names it re-exported come from the libraries' `legacy_exports`."""
    from vca_patch.checkpoint import config_guard
    from vca_patch.checkpoint.base_model import HUB_PREFIX, load_transformers_model
    from vca_patch.checkpoint.config_guard import TIMM_MODEL_ARGS, local_name_or_path_removed
    from vca_patch.families.timm import guard as timm_guard
    from vca_patch.families.timm.load import HUB_PREFIX as TIMM_HUB_PREFIX
    from vca_patch.families.transformers import guard as transformers_guard
    from vca_patch.families.transformers.load import load_transformers_model as transformers_loader

    assert TIMM_MODEL_ARGS is timm_guard.TIMM_MODEL_ARGS and HUB_PREFIX == TIMM_HUB_PREFIX
    assert local_name_or_path_removed is transformers_guard.local_name_or_path_removed
    assert load_transformers_model is transformers_loader
    with pytest.raises(AttributeError, match="no attribute 'check_toy_base'"):
        config_guard.check_toy_base  # noqa: B018
