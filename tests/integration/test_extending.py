"""Issue #41: an out-of-tree target and an out-of-tree model family, defined here (outside vca_patch/) and
registered the public way (`register_target` and `register_handler`; `register_family`), work end to end."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest
import timm
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from typer.testing import CliRunner

import vca_patch
from tests.support.models import tiny
from vca_patch.checkpoint import load_base_model
from vca_patch.cli import app
from vca_patch.core.errors import ConfigError, UnsafeConfigError
from vca_patch.families import (
    ADAPTERS,
    AttentionSite,
    ModelAdapter,
    ModelLibrary,
    SkippedSite,
    adapter_by_name,
    adapter_for,
    libraries,
    loadable_adapters,
    register_family,
    unregister_family,
)
from vca_patch.layers.carried import CarriedAttention, CarriedAttentionLayer
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.base import CONFIG_TYPES, TargetConfig, register_target, unregister_target
from vca_patch.targets.handler import TargetHandler, register_handler, unregister_handler

TARGET = "test-scaled"
FAMILY = "test-tinyvit"

# --- an out-of-tree target -------------------------------------------------------------------------------------


class ScaledAttention(CarriedAttentionLayer):
    """The carried softmax attention, its output times a learned scalar (1.0 at init: the function is kept)."""

    def __init__(self, *args: Any, scale: float = 1.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.initial_scale = float(scale)
        self.output_scale = nn.Parameter(torch.tensor(float(scale), **self.factory_kwargs))

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        q, k, v = self._qkv_heads(x)
        out = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v)
        out = self.norm_and_gate(x, self._merge_heads(out))
        return self.proj_drop(self.proj(out)) * self.output_scale


def _make_target_config() -> type[TargetConfig]:
    """Defined and registered on demand (`register_target`, `register_handler`), which the fixture undoes at
    teardown."""

    @register_target
    @dataclass
    class ScaledAttentionConfig(TargetConfig):
        target: ClassVar[str] = TARGET
        scale: float = field(default=1.0, metadata={"cli": "--scale", "help": "Output scale of every layer"})

        def validate(self) -> None:
            super().validate()
            if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or self.scale <= 0:
                raise ConfigError(f"scale must be a positive number, got {self.scale!r}")

    @register_handler(ScaledAttentionConfig)
    class ScaledAttentionHandler(TargetHandler):
        def build_layer(self, config: ScaledAttentionConfig, carried: CarriedAttention, layer_index: int) -> nn.Module:
            return ScaledAttention.from_carried(carried, scale=config.scale)

        def layer_settings(self, config: ScaledAttentionConfig, layer: nn.Module) -> dict[str, Any]:
            return {"scale": layer.initial_scale}  # from the build, not the weights (also called on meta)

    return ScaledAttentionConfig


@pytest.fixture
def scaled() -> Iterator[type[TargetConfig]]:
    assert TARGET not in CONFIG_TYPES
    config_cls = _make_target_config()
    assert CONFIG_TYPES[TARGET] is config_cls
    try:
        yield config_cls
    finally:
        unregister_target(TARGET)
        unregister_handler(config_cls)


def _outputs(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _relative_error(output: torch.Tensor, expected: torch.Tensor) -> float:
    return ((output - expected).norm() / expected.norm()).item()


def _assert_same_state(model: nn.Module, reference: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert list(state) == list(reference)
    assert all(torch.equal(state[k], reference[k]) for k in reference)


def test_target_registration_is_undone(scaled):
    assert TARGET in CONFIG_TYPES
    assert TargetConfig.from_dict({"target": TARGET, "scale": 2.0}).scale == 2.0
    with pytest.raises(ConfigError, match="scale"):
        scaled(scale=-1.0)


def test_target_patch_preserves_function_and_unpatches_exactly(scaled):
    model, _ = tiny()
    model = model.double()  # float64: the reference is exact up to rounding
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    expected = _outputs(model, x)

    report = vca_patch.patch_model(model, scaled())
    assert report.target == TARGET and TARGET.upper() in str(report)
    assert [s.path for s in report.patched] == ["blocks.0.attn", "blocks.1.attn"]
    assert all(s.settings == {"scale": 1.0} for s in report.patched)
    assert all(isinstance(model.get_submodule(s.path), ScaledAttention) for s in report.patched)
    assert report.params_added == 2  # one output scale per layer
    assert (_outputs(model, x) - expected).abs().max() < 1e-12

    with torch.no_grad():  # the scale is live: a different one changes the output
        model.blocks[0].attn.output_scale.fill_(2.0)
    assert (_outputs(model, x) - expected).abs().max() > 1e-3
    with torch.no_grad():
        model.blocks[0].attn.output_scale.fill_(1.0)

    vca_patch.unpatch_model(model)
    _assert_same_state(model, before)
    assert torch.equal(_outputs(model, x), expected)


def test_target_checkpoint_round_trip_and_card(scaled, tmp_path):
    model, args = tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    vca_patch.patch_model(model, scaled(scale=1.5))
    with torch.no_grad():
        model.blocks[1].attn.output_scale.fill_(0.75)  # "trained": the reload must carry it, not re-init
    x = torch.randn(2, 3, 64, 64)
    expected = _outputs(model, x)

    folder = vca_patch.save_pretrained(model, tmp_path / "merged", model_args=args, metadata={"base_weights": "random"})
    meta = json.loads((folder / "config.json").read_text())
    assert meta["config"] == {
        "target": TARGET, "version": 1, "scale": 1.5, "layers": None, "include": None, "exclude": None, "seed": 0,
    }  # fmt: skip
    assert meta["layers"]["blocks.1.attn"]["scale"] == 1.5
    card = (folder / "README.md").read_text()
    assert TARGET in card or TARGET.upper() in card
    loaded = vca_patch.from_pretrained(folder)
    assert isinstance(loaded.blocks[1].attn, ScaledAttention)
    assert loaded.blocks[1].attn.output_scale.detach().item() == 0.75
    assert torch.equal(_outputs(loaded, x), expected)

    # Delta form: only the new tensors (the output scales) are stored; the base weights come from the caller.
    weights = tmp_path / "base.safetensors"
    save_file(base, str(weights))
    delta = vca_patch.save_pretrained(
        model, tmp_path / "delta", model_args=args, form="delta", base_weights=weights, base_state_dict=base
    )

    stored = load_file(str(next(delta.glob("*.safetensors"))))
    assert sorted(stored) == ["blocks.0.attn.output_scale", "blocks.1.attn.output_scale"]
    restored = vca_patch.from_pretrained(delta, base_state_dict=base)
    assert torch.equal(_outputs(restored, x), expected)


runner = CliRunner()


def test_cli_inspect_and_convert_to_out_of_tree_target(scaled, tmp_path):
    torch.manual_seed(3)
    net = timm.create_model("deit_tiny_patch16_224", pretrained=False, img_size=64).eval()
    weights = tmp_path / "w.safetensors"
    save_file(net.state_dict(), str(weights))
    common = ("deit_tiny_patch16_224", "--weights", str(weights), "--img-size", "64", "--to", TARGET)

    result = runner.invoke(app, ["inspect", *common])
    assert result.exit_code == 0, result.output
    assert "blocks.11.attn" in result.output and "scale=1.000" in result.output and "12 / 0" in result.output

    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", *common, "--output", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["config"]["target"] == TARGET
    x = torch.randn(2, 3, 64, 64)
    reference = copy.deepcopy(net)
    vca_patch.patch_model(reference, scaled())
    assert torch.equal(_outputs(vca_patch.from_pretrained(out), x), _outputs(reference, x))


def test_cli_takes_out_of_tree_target_options(scaled, tmp_path):
    """A target's own fields as CLI options (--scale), like the built-in targets' fields."""
    result = runner.invoke(
        app, ["inspect", "deit_tiny_patch16_224", "--img-size", "64", "--to", TARGET, "--scale", "2.0"]
    )
    assert result.exit_code == 0, result.output
    assert "scale=2" in result.output.replace(" ", "")


# --- an out-of-tree model family ----------------------------------------------------------------------------------


class Mixer(nn.Module):
    """Softmax self-attention with a fused qkv and an output Linear; the generic adapter would also take it."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4)
        weights = (q @ k.transpose(-1, -2) * (C // self.num_heads) ** -0.5).softmax(-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(B, N, C))


class Layer(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mixer = Mixer(dim, num_heads)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mixer(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class PlainViT(nn.Module):
    """A hand-written ViT: a patch convolution, a class token, `Layer`s and a linear head."""

    def __init__(self, dim: int = 32, depth: int = 3, num_heads: int = 4, patch: int = 8, classes: int = 5) -> None:
        super().__init__()
        self.img_size = 32
        self.stem = nn.Conv2d(3, dim, patch, stride=patch)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 1 + (32 // patch) ** 2, dim) * 0.02)
        self.layers = nn.ModuleList(Layer(dim, num_heads) for _ in range(depth))
        self.head = nn.Linear(dim, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stem(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for layer in self.layers:
            x = layer(x)
        return self.head(x[:, 0])


class PlainLibrary(ModelLibrary):
    """The family's library hooks: its config.json guard and loading by name (`load_base_model("plain-vit")`)."""

    name = "test"

    def check_base(self, base: dict[str, Any], where: str) -> None:
        if base != {"library": self.name, "architecture": "PlainViT"}:
            raise UnsafeConfigError(f"{where}: base = {base!r} is not allowed: expected the PlainViT description")

    def claims(self, name: str) -> bool:
        return name == "plain-vit"

    def load(self, name: str, *, pretrained: bool = True, weights: Any = None, model_args: Any = None) -> nn.Module:
        return PlainViT()


class PlainViTAdapter(ModelAdapter):
    name = FAMILY
    library = PlainLibrary()

    @classmethod
    def applies_to(cls, model: nn.Module) -> bool:
        return isinstance(model, PlainViT)

    def find_sites(self, model: nn.Module) -> tuple[list[AttentionSite], list[SkippedSite]]:
        sites = [
            AttentionSite(f"layers.{i}.mixer", layer.mixer, i, layer.mixer.qkv.in_features, layer.mixer.num_heads)
            for i, layer in enumerate(model.layers)
        ]
        return sites, []

    def embedding_module(self, model: nn.Module) -> nn.Module:
        return model.stem

    def layout_from_embedding(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> TokenLayout:
        return TokenLayout(1, (int(output.shape[-2]), int(output.shape[-1])))

    def default_layout(self, model: nn.Module) -> TokenLayout | None:
        side = model.img_size // model.stem.stride[0]
        return TokenLayout(1, (side, side))

    def carry(self, site: AttentionSite) -> CarriedAttention:
        mixer = site.module
        return CarriedAttention(
            qkv=mixer.qkv, proj=mixer.proj, num_heads=mixer.num_heads, head_dim=site.dim // mixer.num_heads
        )

    def adapt_call(self, replacement: nn.Module, site: AttentionSite) -> None:
        pass  # called as mixer(x), which every replacement takes

    def describe_base(self, model: nn.Module) -> dict[str, Any]:
        return {"library": "test", "architecture": "PlainViT"}

    @classmethod
    def create_base(cls, description: dict[str, Any]) -> nn.Module:
        return PlainViT()


@pytest.fixture
def family() -> Iterator[type[ModelAdapter]]:
    order = list(ADAPTERS)
    register_family(PlainViTAdapter)
    try:
        yield PlainViTAdapter
    finally:
        unregister_family(FAMILY)
    assert list(ADAPTERS) == order


def test_register_family_priority_and_errors():
    model = PlainViT()
    assert type(adapter_for(model)).name == "generic"  # unregistered, generic detection would take it
    built_in = list(ADAPTERS)
    register_family(PlainViTAdapter)
    try:
        assert list(ADAPTERS) == [*built_in[:-1], FAMILY, "generic"]  # after the families, before the fallback
        assert isinstance(adapter_for(model), PlainViTAdapter)
        assert isinstance(adapter_by_name(FAMILY), PlainViTAdapter)
        assert type(adapter_for(tiny()[0])).name == "timm-vit"  # the built-in families keep their models
        assert register_family(PlainViTAdapter) is PlainViTAdapter  # the same class again: a no-op
        assert list(ADAPTERS).count(FAMILY) == 1

        class Impostor(PlainViTAdapter):
            name = FAMILY

        with pytest.raises(ValueError, match="already registered"):
            register_family(Impostor)  # another class under a taken name: refused
        assert ADAPTERS[FAMILY] is PlainViTAdapter
    finally:
        unregister_family(FAMILY)
    assert list(ADAPTERS) == built_in

    register_family(PlainViTAdapter, before="timm-vit")
    try:
        assert list(ADAPTERS)[built_in.index("timm-vit")] == FAMILY
    finally:
        unregister_family(FAMILY)
    with pytest.raises(ValueError, match="not a registered adapter"):
        register_family(PlainViTAdapter, before="no-such-adapter")
    with pytest.raises(TypeError):
        register_family(PlainViT)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cannot be unregistered"):
        unregister_family("generic")
    assert list(ADAPTERS) == built_in


def test_family_patch_with_vca_and_unpatch(family):
    torch.manual_seed(0)
    model = PlainViT().eval()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(4, 3, 32, 32)
    expected = _outputs(model, x)
    handles = [layer.mixer.register_forward_hook(lambda m, a, out: torch.zeros_like(out)) for layer in model.layers]
    no_attention = _relative_error(_outputs(model, x), expected)  # the model with its attention dropped: ~0.8
    for handle in handles:
        handle.remove()
    carried = [(layer.mixer.qkv, layer.mixer.proj) for layer in model.layers]

    report = vca_patch.patch_model(model, vca_patch.VCAConfig())
    assert report.adapter == FAMILY and report.target == "vca"
    assert [s.path for s in report.patched] == [f"layers.{i}.mixer" for i in range(3)]
    assert report.layout == TokenLayout(1, (4, 4))
    assert all(isinstance(model.get_submodule(s.path), vca_patch.VisualContrastAttention) for s in report.patched)
    assert report.params_added > 0
    assert [(m.qkv, m.proj) for m in (layer.mixer for layer in model.layers)] == carried  # reused, not copied
    # VCA at init approximates the softmax attention it replaces: measured 0.31 relative error on these random
    # logits (cosine 0.98), against 0.81 with the attention dropped altogether.
    patched = _outputs(model, x)
    assert _relative_error(patched, expected) < 0.45
    assert _relative_error(patched, expected) < 0.5 * no_attention
    assert F.cosine_similarity(patched.flatten(), expected.flatten(), 0) > 0.95

    vca_patch.unpatch_model(model)
    assert all(type(layer.mixer) is Mixer for layer in model.layers)
    _assert_same_state(model, before)
    assert torch.equal(_outputs(model, x), expected)


def test_family_with_out_of_tree_target(family, scaled):
    """Both extensions together: the hand-written model converted to the out-of-tree target, exactly."""
    torch.manual_seed(1)
    model = PlainViT().double().eval()
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    expected = _outputs(model, x)
    report = vca_patch.patch_model(model, scaled(layers=[0, 2]))
    assert report.adapter == FAMILY and [s.path for s in report.patched] == ["layers.0.mixer", "layers.2.mixer"]
    assert (_outputs(model, x) - expected).abs().max() < 1e-12


def test_family_checkpoint_round_trip_through_its_library(family, tmp_path):
    """With its library hooks declared, the out-of-tree family loads by name, saves and reloads (merged form) with
    identical outputs, and its own guard check refuses a config.json it did not write."""
    assert loadable_adapters()[FAMILY] is libraries()["test"] is PlainViTAdapter.library
    torch.manual_seed(2)
    model = load_base_model("plain-vit").eval()  # asked of the family's library before timm's fallback
    assert isinstance(model, PlainViT)
    vca_patch.patch_model(model, vca_patch.VCAConfig())
    x = torch.randn(2, 3, 32, 32)
    expected = _outputs(model, x)

    folder = vca_patch.save_pretrained(model, tmp_path / "ckpt")
    meta = json.loads((folder / "config.json").read_text())
    assert meta["adapter"] == FAMILY and meta["base"] == {"library": "test", "architecture": "PlainViT"}
    assert "model_args" not in meta  # timm's own keys belong to timm bases only
    loaded = vca_patch.from_pretrained(folder).eval()
    assert type(loaded) is PlainViT and all(
        isinstance(layer.mixer, vca_patch.VisualContrastAttention) for layer in loaded.layers
    )
    assert torch.equal(_outputs(loaded, x), expected)

    meta["base"]["architecture"] = "os.system"
    (folder / "config.json").write_text(json.dumps(meta))
    with pytest.raises(UnsafeConfigError, match="expected the PlainViT description"):
        vca_patch.from_pretrained(folder)


def test_family_without_library_cannot_be_saved(tmp_path):
    """An adapter that declares no library converts models, but config.json may not name it."""

    class NoLibraryAdapter(PlainViTAdapter):
        name = "test-no-library"
        library = None

    register_family(NoLibraryAdapter)
    try:
        model = PlainViT().eval()
        vca_patch.patch_model(model, vca_patch.VCAConfig())
        with pytest.raises(UnsafeConfigError, match="adapter = 'test-no-library' is not allowed: expected one of"):
            vca_patch.save_pretrained(model, tmp_path / "ckpt")
    finally:
        unregister_family("test-no-library")
