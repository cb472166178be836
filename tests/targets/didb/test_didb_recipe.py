"""The two-stage DIDB recipe: per-stage target_state (schema, engine switch, resume), parameter groups, CPU recipe."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import vca_patch
from tests.support.paths import RECIPES
from tests.support.recovery import needs_fashion_mnist, tiny_vit
from vca_patch import ConfigError, DIDBConfig, VCAConfig
from vca_patch.targets.didb import BinaryLinear, DIDBAttention
from vca_patch.targets.handler import handler_for
from vca_patch.train import RecipeError, load_recipe, recipe_from_dict, run_recipe, teacher_from
from vca_patch.train.engine import stage_target_state
from vca_patch.train.params import parameter_groups

RECIPES = RECIPES


def _recipe(stage1: dict, stage2: dict, **train) -> dict:
    return {
        "name": "tiny-didb",
        "train": {"batch_size": 8, "eval_every": 100, "checkpoint_every": 1, "eval_images": 8, **train},
        "stages": [
            {"name": "acts", "kind": "distill", "steps": 2, "lr": 1e-3, "carried_lr": 1e-3, **stage1},
            {"name": "weights", "kind": "distill", "steps": 3, "lr": 1e-3, "carried_lr": 1e-3, **stage2},
        ],
    }


SWITCH = _recipe({"target_state": {"activations": True}}, {"target_state": {"weights": True}})


def _student() -> nn.Module:
    """A random tiny ViT, binarised with both switches off (as the two-stage recipe must turn them on)."""
    torch.manual_seed(0)
    model = tiny_vit().eval()
    vca_patch.patch_model(model, DIDBConfig(weights=False, activations=False))
    return model


def _data(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g))


def _flags(model: nn.Module) -> set[tuple[bool, bool]]:
    """{(binarize_weights, binarize_activations)} over every binarised module."""
    return {
        (m.binarize_weights, m.binarize_activations)
        for m in model.modules()
        if isinstance(m, (BinaryLinear, DIDBAttention))
    }


def _record_training_flags(model: nn.Module) -> list[set[tuple[bool, bool]]]:
    """The binarisation flags at every training-mode forward of `model` (evaluation forwards run in eval mode)."""
    seen: list[set[tuple[bool, bool]]] = []
    first = next(m for m in model.modules() if isinstance(m, BinaryLinear))  # the engine may call submodules only
    first.register_forward_pre_hook(lambda m, a: seen.append(_flags(model)) if m.training else None)
    return seen


# --- schema ---------------------------------------------------------------------------------------------------


def test_schema_accepts_target_state_and_round_trips():
    recipe = recipe_from_dict(SWITCH)
    assert [s.target_state for s in recipe.stages] == [{"activations": True}, {"weights": True}]
    assert recipe_from_dict(recipe.to_dict()).stages == recipe.stages
    assert recipe_from_dict(_recipe({}, {})).stages[0].target_state == {}  # default: leave the target as it is
    assert stage_target_state(recipe, 0) == {"activations": True}
    assert stage_target_state(recipe, 1) == {"activations": True, "weights": True}  # earlier stages' keys carry on


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ([True], "stages[0].target_state: expected a mapping with string keys"),
        ({1: True}, "stages[0].target_state: expected a mapping with string keys"),
        ({"weights": float("nan")}, "stages[0].target_state.weights: expected a finite number"),
        ({"weights": {"deep": [object()]}}, "stages[0].target_state.weights.deep[0]: expected JSON-safe data"),
    ],
)
def test_schema_refuses_target_state_that_is_not_json_data(state, message):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(_recipe({"target_state": state}, {}))
    assert message in str(info.value)


def test_shipped_didb_recipes_validate_and_switch_activations_then_weights():
    for name in ("didb_fashion_mnist.yaml", "didb_deit_small_imagenet.yaml"):
        recipe = load_recipe(RECIPES / name)
        assert recipe.budget and [s.kind for s in recipe.stages] == ["distill", "distill"]
        assert stage_target_state(recipe, 0) == {"weights": False, "activations": True}
        assert stage_target_state(recipe, 1) == {"weights": True, "activations": True}
        assert all(s.carried_lr > 0 for s in recipe.stages)  # the latent binary weights train
    assert "GPU" in load_recipe(RECIPES / "didb_deit_small_imagenet.yaml").budget


# --- the target's hook ----------------------------------------------------------------------------------------


def test_target_without_stage_state_refuses_it_before_any_work(tmp_path):
    model = tiny_vit().eval()
    vca_patch.patch_model(model, VCAConfig(contrast_tokens=4))
    with pytest.raises(ConfigError, match=r"target 'vca' \(VCAConfig\) has no per-stage state"):
        handler_for(VCAConfig).apply_stage_state(VCAConfig(), model, {"weights": True})
    handler_for(VCAConfig).apply_stage_state(VCAConfig(), model, {})  # empty: fine
    with pytest.raises(RecipeError, match=r"stage 'acts': target 'vca' \(VCAConfig\) has no per-stage state"):
        run_recipe(model, teacher_from(model), recipe_from_dict(SWITCH), tmp_path / "run", train_set=_data())
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("state", "message"),
    [
        ({"weight": True}, "unknown target_state key 'weight'; valid keys: ['weights', 'activations']"),
        ({"activations": 1}, "target_state.activations must be true or false, got 1"),
    ],
)
def test_didb_refuses_unknown_or_non_boolean_state_before_any_work(tmp_path, state, message):
    model = _student()
    with pytest.raises(RecipeError, match="stage 'acts': target 'didb'") as info:
        spec = recipe_from_dict(_recipe({"target_state": state}, {}))
        run_recipe(model, teacher_from(model), spec, tmp_path, train_set=_data())
    assert message in str(info.value) and not (tmp_path / "metrics.json").exists()


def test_apply_stage_state_switches_the_modules_and_the_saved_config():
    model = _student()
    config = model.vca_patch_state.config
    handler = handler_for(config)
    handler.apply_stage_state(config, model, {"activations": True})
    assert _flags(model) == {(False, True)} and (config.weights, config.activations) == (False, True)
    handler.apply_stage_state(config, model, {"weights": True, "activations": False})
    assert _flags(model) == {(True, False)} and (config.weights, config.activations) == (True, False)


# --- the engine -----------------------------------------------------------------------------------------------


def test_each_stage_trains_with_its_binarisation(tmp_path):
    model = _student()
    seen = _record_training_flags(model)
    result = run_recipe(model, teacher_from(model), recipe_from_dict(SWITCH), tmp_path, train_set=_data())
    assert seen == [{(False, True)}] * 2 + [{(True, True)}] * 3  # 2 steps activations only, then 3 with weights
    assert model.vca_patch_state.config.weights and model.vca_patch_state.config.activations  # saved as trained
    records = result.metrics["evaluations"]
    assert [(r["stage"], r["target_state"]) for r in records] == [
        ("acts", {"activations": True}),
        ("weights", {"activations": True, "weights": True}),
    ]


def test_resume_in_the_second_stage_reapplies_its_state(tmp_path):
    recipe = recipe_from_dict(SWITCH | {"train": {**SWITCH["train"], "ema_decay": 0.5}})
    full = _student()
    teacher = teacher_from(full)
    whole = run_recipe(full, teacher, recipe, tmp_path / "whole", train_set=_data())

    first = _student()
    part = run_recipe(first, teacher, recipe, tmp_path / "split", train_set=_data(), stop_after_steps=3)
    assert not part.completed and _flags(first) == {(True, True)}

    again = _student()  # a fresh process: the model as converted, both switches off
    seen = _record_training_flags(again)
    resumed = run_recipe(again, teacher, recipe, tmp_path / "split", train_set=_data(), resume=True)
    assert resumed.completed and seen == [{(True, True)}] * 2  # the 2 remaining steps of stage 2
    assert _flags(resumed.model) == {(True, True)} and resumed.model is not again  # the EMA copy switched too
    assert resumed.model.vca_patch_state.config.weights
    expected, got = whole.model.state_dict(), resumed.model.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)  # same as the uninterrupted run


# --- parameter groups -----------------------------------------------------------------------------------------


def test_parameter_groups_put_block_edit_parameters_in_new_and_their_weights_in_carried():
    model = _student()
    groups = {k: [n for n, _ in v] for k, v in parameter_groups(model).items()}
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n for group in groups.values() for n in group) == sorted(names)  # a partition
    for block in ("blocks.0", "blocks.1"):
        carried = {f"{block}.attn.{m}.{t}" for m in ("qkv", "proj") for t in ("weight", "bias")}
        carried |= {f"{block}.mlp.{m}.{t}" for m in ("fc1", "fc2") for t in ("weight", "bias")}
        assert carried <= set(groups["carried"])
        new = {f"{block}.mlp.fc1.act_clip", f"{block}.mlp.fc2.act_clip", f"{block}.attn.band_weight"}
        new |= {f"{block}.mlp.act.{t}" for t in ("shift", "slope", "bias", "token_mix")}
        assert new <= set(groups["new"])
        assert {f"{block}.norm1.weight", f"{block}.norm2.bias"} <= set(groups["rest"])
    assert not groups["lambda"] and {"head.weight", "patch_embed.proj.weight", "cls_token"} <= set(groups["rest"])
    assert not any(".mlp." in n for n in groups["rest"])


def test_parameter_groups_recognise_carried_weights_after_an_assigning_load():
    model = _student()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new Parameter objects: identity with the originals is lost
    groups = {k: [n for n, _ in v] for k, v in parameter_groups(model).items()}
    assert {"blocks.0.mlp.fc1.weight", "blocks.1.mlp.fc2.bias"} <= set(groups["carried"])
    assert "blocks.0.mlp.fc1.act_clip" in groups["new"]


# --- the shipped CPU recipe -----------------------------------------------------------------------------------


@needs_fashion_mnist
def test_fashion_mnist_didb_recipe_runs_both_stages_with_finite_losses(tmp_path):
    from vca_patch.data import load_fashion_mnist

    spec = load_recipe(RECIPES / "didb_fashion_mnist.yaml")
    short = [dataclasses.replace(s, steps=3, warmup_steps=1) for s in spec.stages]
    train = dataclasses.replace(spec.train, batch_size=8, eval_every=3, eval_images=32, checkpoint_every=3)
    spec = dataclasses.replace(spec, stages=short, train=train)
    torch.manual_seed(0)
    model = tiny_vit().eval()  # random weights: this checks the run, not the accuracy it reaches
    vca_patch.patch_model(model, DIDBConfig())
    teacher = teacher_from(model)
    seen = _record_training_flags(model)
    result = run_recipe(
        model, teacher, spec, tmp_path, train_set=load_fashion_mnist("train", limit=64),
        eval_set=load_fashion_mnist("test", limit=32),
    )  # fmt: skip
    assert result.completed and seen == [{(False, True)}] * 3 + [{(True, True)}] * 3
    records = result.metrics["evaluations"]
    assert [r["stage"] for r in records] == ["binary_activations", "binary_weights"]
    assert all(math.isfinite(r["loss"]) and r["loss"] > 0 for r in records)
    assert all(0 <= r["top1_agreement"] <= 1 for r in records)
