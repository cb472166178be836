"""The recipe schema is generic; a target declares the keys it adds to recipes (`recipe_options`:
VCA's lambda_lr, lambda_guard and lambda_max), which the schema types and validates with the target's dataclass,
the optimizer reads for the target's parameter groups and the engine hands to the target's guard."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import vca_patch
from tests.support.models import tiny
from tests.support.paths import RECIPES
from vca_patch.core.errors import ConfigError
from vca_patch.layers.carried import CarriedAttention, CarriedAttentionLayer
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets.base import CONFIG_TYPES, RecipeOptions, TargetConfig, register_target
from vca_patch.targets.handler import TargetHandler, register_handler, unregister_handler
from vca_patch.targets.vca.recipe import VCARecipeStage, VCARecipeTrain
from vca_patch.train import RecipeError, StageSpec, TrainSpec, load_recipe, recipe_from_dict
from vca_patch.train.optim import stage_optimizer
from vca_patch.train.params import guard_parameters, parameter_groups
from vca_patch.train.target_keys import declared

TARGET = "test-scale"
STAGE = {"name": "a", "kind": "distill", "steps": 2}


class ScaledAttention(CarriedAttentionLayer):
    """The carried softmax attention times a learned output scale (1 at init)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.output_scale = nn.Parameter(torch.ones((), **self.factory_kwargs))

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        q, k, v = self._qkv_heads(x)
        out = self.norm_and_gate(
            x, self._merge_heads(F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v))
        )
        return self.proj_drop(self.proj(out)) * self.output_scale


@dataclass(frozen=True)
class ScaleStage:
    scale_lr: float = field(default=0.5, metadata={"group": "scale", "help": "learning rate of the output scales"})

    def __post_init__(self) -> None:
        if self.scale_lr < 0:
            raise ConfigError(f"scale_lr must be >= 0, got {self.scale_lr}")


@dataclass(frozen=True)
class ScaleTrain:
    scale_max: float = field(default=2.0, metadata={"help": "the output scales are clamped to at most this"})

    def __post_init__(self) -> None:
        if not self.scale_max > 0:
            raise ConfigError(f"scale_max must be > 0, got {self.scale_max}")


def _scales(model: nn.Module) -> list[nn.Parameter]:
    return [m.output_scale for m in model.modules() if isinstance(m, ScaledAttention)]


def _make_target() -> type[TargetConfig]:
    @register_target
    @dataclass
    class ScaleConfig(TargetConfig):
        target: ClassVar[str] = TARGET
        recipe_options: ClassVar[RecipeOptions] = RecipeOptions(train=ScaleTrain, stage=ScaleStage)

    @register_handler(ScaleConfig)
    class ScaleHandler(TargetHandler):
        def build_layer(self, config: ScaleConfig, carried: CarriedAttention, layer_index: int) -> nn.Module:
            return ScaledAttention.from_carried(carried)

        def parameter_groups(self, config: ScaleConfig, model: nn.Module) -> dict[str, list[nn.Parameter]]:
            return {"scale": _scales(model)}

        def guard_parameters(self, config: ScaleConfig, model: nn.Module, options: Any) -> int:
            assert isinstance(options, ScaleTrain)  # its own keys, as its dataclass
            moved = [p for p in _scales(model) if float(p.detach()) > options.scale_max]
            with torch.no_grad():
                for p in moved:
                    p.fill_(options.scale_max)
            return len(moved)

    return ScaleConfig


@pytest.fixture
def scale() -> Iterator[type[TargetConfig]]:
    config_cls = _make_target()
    try:
        yield config_cls
    finally:
        CONFIG_TYPES.pop(TARGET, None)
        unregister_handler(config_cls)


def test_the_schema_names_no_target_key_and_vca_declares_its_own():
    for spec in (StageSpec, TrainSpec):
        assert not {f.name for f in fields(spec)} & {"lambda_lr", "lambda_guard", "lambda_max"}
    stage, train = declared("stage"), declared("train")
    assert stage["lambda_lr"].owner is VCARecipeStage and stage["lambda_lr"].group == "lambda"
    assert stage["lambda_lr"].default == 1e-4 and train["lambda_max"].owner is VCARecipeTrain
    assert vca_patch.MergeConfig.recipe_options is vca_patch.VCAConfig.recipe_options  # its VCA blocks' λ
    with pytest.raises(RecipeError, match=r"recipe.stages\[0\].lambda_lr must be >= 0, got -1.0"):
        recipe_from_dict({"name": "r", "stages": [{**STAGE, "lambda_lr": -1}]})
    with pytest.raises(RecipeError, match=r"recipe.train.lambda_guard: expected one of 'clamp', 'none', got 'on'"):
        recipe_from_dict({"name": "r", "stages": [STAGE], "train": {"lambda_guard": "on"}})


def test_shipped_recipes_keep_their_lambda_keys_and_round_trip():
    recipe = load_recipe(RECIPES / "dinov2_small.yaml")
    assert recipe.stages[0].options["lambda_lr"] == 1e-5  # the file's value, not the default
    assert recipe.train.options == {"lambda_guard": "clamp", "lambda_max": 0.95}
    written = recipe.to_dict()
    assert written["stages"][0]["lambda_lr"] == 1e-5 and written["train"]["lambda_max"] == 0.95
    assert "options" not in written["train"] and recipe_from_dict(written) == load_recipe(RECIPES / "dinov2_small.yaml")
    minimal = recipe_from_dict({"name": "r", "stages": [STAGE]})
    assert minimal.stages[0].options == {"lambda_lr": 1e-4} and minimal.train.options["lambda_guard"] == "clamp"
    assert recipe_from_dict(minimal.to_dict()) == minimal


def test_out_of_tree_target_keys_are_typed_validated_and_go_away_with_it(scale):
    recipe = recipe_from_dict({"name": "r", "stages": [{**STAGE, "scale_lr": 0.25}], "train": {"scale_max": "3e0"}})
    assert recipe.stages[0].options == {"lambda_lr": 1e-4, "scale_lr": 0.25}  # every declared key, at its default
    assert recipe.train.options == {"lambda_guard": "clamp", "lambda_max": 0.95, "scale_max": 3.0}
    for bad, message in (
        ({"stages": [{**STAGE, "scale_lr": -0.5}]}, r"recipe.stages\[0\].scale_lr must be >= 0, got -0.5"),
        ({"stages": [{**STAGE, "scale_lr": "fast"}]}, r"recipe.stages\[0\].scale_lr: expected a number, got 'fast'"),
        ({"stages": [STAGE], "train": {"scale_max": 0}}, r"recipe.train.scale_max must be > 0, got 0.0"),
    ):
        with pytest.raises(RecipeError, match=message):
            recipe_from_dict({"name": "r", **bad})
    CONFIG_TYPES.pop(TARGET)
    with pytest.raises(RecipeError, match=r"unknown key 'scale_lr'; valid keys: \["):
        recipe_from_dict({"name": "r", "stages": [{**STAGE, "scale_lr": 0.25}]})


def test_out_of_tree_group_trains_at_its_stage_key_and_its_guard_gets_its_train_keys(scale):
    model, _ = tiny()
    vca_patch.patch_model(model, scale())
    groups = parameter_groups(model)
    assert list(groups) == ["new", "lambda", "scale", "carried", "rest"] and not groups["lambda"]
    assert {id(p) for _, p in groups["scale"]} == {id(p) for p in _scales(model)} and not groups["new"]
    optimizer = stage_optimizer(model, StageSpec("s", "distill", 1, lr=1e-3, options={"scale_lr": 4e-3}))
    by_group = {g["group"]: g for g in optimizer.param_groups}
    assert by_group["scale"]["lr_scale"] == pytest.approx(1.0) and by_group["scale"]["lr"] == pytest.approx(4e-3)
    assert len(by_group["scale"]["params"]) == 2
    with torch.no_grad():
        _scales(model)[0].fill_(2.5)
    assert guard_parameters(model, TrainSpec()) == 1 and float(_scales(model)[0].detach()) == 2.0  # its default bound
    assert guard_parameters(model, TrainSpec(options={"scale_max": 0.5})) == 2
    assert [float(p.detach()) for p in _scales(model)] == [0.5, 0.5]


def test_vca_guard_follows_its_train_keys():
    model, _ = tiny()
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    layer = next(m for m in model.modules() if isinstance(m, vca_patch.VisualContrastAttention))
    lam = layer.lambda2
    with torch.no_grad():
        lam.q1.add_(lam.k1 / lam.k1.norm() ** 2 * 3.0)  # λ₂ far above any bound
    before = float(lam().detach())
    assert guard_parameters(model, TrainSpec(options={"lambda_guard": "none"})) == 0
    assert float(lam().detach()) == before
    assert guard_parameters(model, TrainSpec(options={"lambda_max": 0.9})) == 1
    assert float(lam().detach()) == pytest.approx(0.9, abs=1e-5)
