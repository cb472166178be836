"""Recovery training: recipes (YAML schema), the accelerate-based engine, and `finetune`."""

from vca_patch.train.engine import RunResult, TrainingDiverged, make_accelerator, run_recipe
from vca_patch.train.evaluation import evaluate
from vca_patch.train.finetune import finetune, publish, teacher_from
from vca_patch.train.recipe import DataSpec, Recipe, RecipeError, StageSpec, TrainSpec, load_recipe, recipe_from_dict

__all__ = [
    "DataSpec",
    "Recipe",
    "RecipeError",
    "RunResult",
    "StageSpec",
    "TrainSpec",
    "TrainingDiverged",
    "evaluate",
    "finetune",
    "load_recipe",
    "make_accelerator",
    "publish",
    "recipe_from_dict",
    "run_recipe",
    "teacher_from",
]
