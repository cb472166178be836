"""Issue #51: docs/extending.md names every hook a plug-in may give, and the example plug-in it walks through
(examples/plugin/) works in-process from its source (test_plugin_install.py installs it and runs it in fresh
processes, under the e2e marker)."""

from __future__ import annotations

import copy
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from typer.testing import CliRunner

import vca_patch
from vca_patch.cli import app
from vca_patch.families import ADAPTERS, ModelAdapter, ModelLibrary
from vca_patch.layers.macs import ATTENTION_MACS, attention_macs
from vca_patch.targets import CONFIG_TYPES, TargetConfig, TargetHandler, handler_for
from vca_patch.targets.handler import HANDLERS

ROOT = Path(__file__).resolve().parents[2]
GUIDE = (ROOT / "docs" / "extending.md").read_text()
# Hooks found by name on a handler or an adapter rather than declared on the base classes.
UNDECLARED_HOOKS = ("pack", "packed_state_dict", "load_packed", "install_replacement", "remove_replacement",
                    "vca_patch_input_size", "forward_features", "forward_head", "num_classes")  # fmt: skip
INHERITED_ONLY = {"to_dict", "from_dict", "to_json", "from_json", "layers", "include", "exclude", "seed"}


def _public(cls: type) -> set[str]:
    return {name for name in vars(cls) if not name.startswith("_")}


@pytest.mark.parametrize("cls", [TargetConfig, TargetHandler, ModelAdapter, ModelLibrary], ids=lambda c: c.__name__)
def test_the_guide_names_every_hook_of_the_plugin_classes(cls):
    missing = sorted(name for name in _public(cls) - INHERITED_ONLY if f"`{name}" not in GUIDE)
    assert missing == [], f"docs/extending.md does not document {cls.__name__}'s {missing}"


def test_the_guide_names_the_hooks_found_by_name_and_the_entry_point_groups():
    assert [name for name in UNDECLARED_HOOKS if f"`{name}" not in GUIDE] == []
    assert '[project.entry-points."vca_patch.targets"]' in GUIDE
    assert '[project.entry-points."vca_patch.families"]' in GUIDE
    example = (ROOT / "examples" / "plugin" / "pyproject.toml").read_text()
    for group in re.findall(r'\[project\.entry-points\."([\w.]+)"\]\n[^\n]+', GUIDE):
        assert f'[project.entry-points."{group}"]' in example


@pytest.fixture
def toy() -> Iterator[ModuleType]:
    """The example plug-in imported from its source (its modules register by hand too), removed afterwards."""
    sys.path.insert(0, str(ROOT / "examples" / "plugin" / "src"))
    try:
        import toy_plugin

        assert CONFIG_TYPES["temp-softmax"] is toy_plugin.TempSoftmaxConfig
        assert type(handler_for(toy_plugin.TempSoftmaxConfig)).__name__ == "TempSoftmaxHandler"  # with its config
        assert ADAPTERS["toy-vit"] is toy_plugin.ToyViTAdapter and list(ADAPTERS)[-2:] == ["toy-vit", "generic"]
        yield toy_plugin
    finally:
        registries = (
            (CONFIG_TYPES, "temp-softmax"), (ATTENTION_MACS, "temp-softmax"), (ADAPTERS, "toy-vit"),
            (HANDLERS, "toy_plugin.target.TempSoftmaxConfig"),
        )  # fmt: skip
        for registry, name in registries:
            if registry.holds(name):
                registry.unregister(name)
        sys.path.remove(str(ROOT / "examples" / "plugin" / "src"))
        for module in [m for m in sys.modules if m == "toy_plugin" or m.startswith("toy_plugin.")]:
            del sys.modules[module]


def test_the_example_plugin_patches_exactly_unpatches_and_reloads(toy, tmp_path):
    torch.manual_seed(0)
    model = toy.ToyViT().double().eval()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        expected = model(x)

    report = vca_patch.patch_model(model, toy.TempSoftmaxConfig())
    assert report.adapter == "toy-vit" and [s.path for s in report.patched] == ["blocks.0.attn", "blocks.1.attn"]
    assert report.params_added == 8  # one temperature per head, 4 heads, 2 blocks
    with torch.no_grad():
        assert (model(x) - expected).abs().max() < 1e-12  # temperature 1: the original attention
        model.blocks[1].attn.temperature.fill_(0.5)  # a sharper head changes the output
        changed = model(x)
    assert (changed - expected).abs().max() > 1e-4
    assert attention_macs("temp-softmax", vca_patch.layers.macs.AttentionShape(1, (4, 4), 32, 4)) == 2.0 * 17**2 * 32

    folder = vca_patch.save_pretrained(model, tmp_path / "ckpt")
    meta = json.loads((folder / "config.json").read_text())
    assert meta["adapter"] == "toy-vit" and meta["config"] == {
        "target": "temp-softmax", "version": 1, "temperature": 1.0, "layers": None, "include": None, "exclude": None,
        "seed": 0,
    }  # fmt: skip
    loaded = vca_patch.from_pretrained(folder)
    with torch.no_grad():
        assert torch.equal(loaded.double()(x), changed)

    vca_patch.unpatch_model(model)
    state = model.state_dict()
    assert list(state) == list(before) and all(torch.equal(state[k], before[k]) for k in before)


def test_the_example_plugin_through_the_cli(toy, tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["inspect", "toy-vit-tiny", "--to", "temp-softmax", "--temperature", "2"])
    assert result.exit_code == 0, result.output
    assert "blocks.1.attn" in result.output and "temperature=2" in result.output.replace(" ", "")
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "toy-vit-tiny", "--to", "temp-softmax", "-o", str(out), "--device", "cpu"])
    assert (
        result.exit_code == 2 and "error: toy-vit-tiny has no pretrained weights: pass --no-pretrained" in result.output
    )
    args = ["convert", "toy-vit-tiny", "--no-pretrained", "--to", "temp-softmax", "-o", str(out), "--device", "cpu"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["config"]["target"] == "temp-softmax"
