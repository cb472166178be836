"""Recovery training: recipes (YAML schema), the accelerate-based engine, its tasks, and `finetune`."""

from vca_patch.train.engine import RunOptions, RunResult, TrainingDiverged, make_accelerator, run_recipe
from vca_patch.train.evaluation import evaluate
from vca_patch.train.finetune import finetune, publish, teacher_from
from vca_patch.train.recipe import DataSpec, Recipe, RecipeError, StageSpec, TrainSpec, load_recipe, recipe_from_dict
from vca_patch.train.tasks import register_task, task_for

__all__ = [
    "DataSpec",
    "Recipe",
    "RecipeError",
    "RunOptions",
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
    "register_task",
    "run_recipe",
    "task_for",
    "teacher_from",
]
