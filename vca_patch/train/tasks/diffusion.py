"""The diffusion task: a diffusers diffusion transformer distilled on latents (`distill_diffusion` stages)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from torch import nn
from torch.utils.data import Dataset

from vca_patch.checkpoint import from_pretrained
from vca_patch.train.diffusion import distill_diffusion_loss, evaluate_diffusion
from vca_patch.train.diffusion_data import latent_datasets, model_family
from vca_patch.train.objective import StageLoss
from vca_patch.train.recipe import Recipe, RecipeError
from vca_patch.train.tasks.base import Task, TaskData, register_task, teacher_from


def diffusion_card_metrics(metrics: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """The model-card metrics block of a diffusion run: prediction and layer errors before and after."""
    spec = recipe.diffusion
    final, before = metrics.get("final", {}), metrics.get("before", {})
    out: dict[str, Any] = {"dataset": spec.latents or "generated random latents", "split": "eval"}
    pairs = {
        "prediction_error_before": before.get("prediction_error"),
        "prediction_error_after": final.get("prediction_error"),
        "mean_layer_error_before": before.get("mean_layer_error"),
        "mean_layer_error_after": final.get("mean_layer_error"),
    }
    out.update({k: float(v) for k, v in pairs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


@register_task("diffusion")
class DiffusionTask(Task):
    """Latents (a folder, or generated) and the recipe's `diffusion` block; layer and prediction errors."""

    stage_losses: ClassVar[dict[str, StageLoss]] = {"distill_diffusion": distill_diffusion_loss}

    def load(self, converted: Path, recipe: Recipe) -> TaskData:
        student = from_pretrained(converted)
        try:
            model_family(student)
        except ValueError as exc:
            raise RecipeError(f"recipe {recipe.name!r} is a diffusion recipe: {exc}") from None
        teacher = teacher_from(student)
        train_set, eval_set = latent_datasets(student, recipe.diffusion)
        return TaskData(student, teacher, train_set, eval_set)

    def evaluate(
        self, model: nn.Module, teacher: nn.Module, eval_set: Dataset | None, recipe: Recipe, accelerator: Any
    ) -> dict[str, Any]:
        return evaluate_diffusion(model, teacher, eval_set, recipe.train.eval_images, recipe.diffusion)

    def card(self, metrics: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Any], list[str]]:
        card = diffusion_card_metrics(metrics, recipe)
        return card, [card["dataset"]]
