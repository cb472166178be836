"""Recipe files are data: validation names the bad key and lists the valid ones."""

from __future__ import annotations

import pytest

from tests.support.paths import RECIPES
from vca_patch.train import RecipeError, load_recipe, recipe_from_dict

RECIPES = RECIPES
MINIMAL = {"name": "r", "stages": [{"name": "a", "kind": "distill", "steps": 2}]}


@pytest.mark.parametrize("name", ["fashion_mnist.yaml", "deit_tiny_imagenet.yaml"])
def test_shipped_recipes_validate(name):
    recipe = load_recipe(RECIPES / name)
    assert recipe.total_steps > 0 and recipe.budget


def test_deit_recipe_states_its_gpu_budget():
    recipe = load_recipe(RECIPES / "deit_tiny_imagenet.yaml")
    assert "GPU" in recipe.budget and recipe.data.kind in ("imagefolder", "hf")


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"stages": [{"name": "a", "kind": "distill", "steps": 2, "lrr": 1}]}, "unknown key 'lrr'; valid keys: ["),
        ({"train": {"batchsize": 8}}, "recipe.train: unknown key 'batchsize'; valid keys: ['batch_size'"),
        ({"train": {"batch_size": "8"}}, "recipe.train.batch_size: expected an integer, got '8'"),
        ({"train": {"ema_decay": "high"}}, "recipe.train.ema_decay: expected a number"),
        ({"stages": [{"name": "a", "kind": "magic", "steps": 1}]}, "kind: expected one of 'calibrate'"),
        ({"stages": [{"name": "a", "kind": "distill"}]}, "stages[0].steps must be >= 1"),
        ({"stages": [{"kind": "distill", "steps": 1}]}, "missing required key 'name'"),
        ({"data": {"kind": "imagefolder", "eval_limit": 1.5}}, "recipe.data.eval_limit: expected int or null"),
        ({"extra": 1}, "unknown key 'extra'; valid keys: ['budget', 'data', 'description', 'diffusion', 'name'"),
        ({"train": {"lambda_max": 1.5}}, "train.lambda_max must be in (0, 1)"),
        ({"stages": []}, "at least one stage"),
    ],
)
def test_invalid_recipes_name_the_key(patch, message):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict({**MINIMAL, **patch})
    assert message in str(info.value)


def test_missing_or_broken_file(tmp_path):
    with pytest.raises(RecipeError, match="does not exist"):
        load_recipe(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed")
    with pytest.raises(RecipeError, match="not valid YAML"):
        load_recipe(tmp_path / "bad.yaml")
