"""`finetune` for diffusion recipes: distil a converted diffusion transformer on latents and publish it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vca_patch.checkpoint import from_pretrained
from vca_patch.checkpoint.folder import read_checkpoint_config
from vca_patch.checkpoint.model_card import recipe_metadata
from vca_patch.train.diffusion_data import latent_datasets, model_family
from vca_patch.train.engine import RunResult, run_recipe
from vca_patch.train.recipe import Recipe, RecipeError


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


def finetune_diffusion(
    converted: Path, recipe: Recipe, output: Path, *, resume: bool, stop_after_steps: int | None, accelerator: Any
) -> RunResult:
    """Run a diffusion `recipe` on the converted diffusers checkpoint `converted`; publish into `output`."""
    from vca_patch.train.finetune import TrainingInterrupted, mark_interrupted, publish, teacher_from

    meta = read_checkpoint_config(converted)
    student = from_pretrained(converted)
    try:
        model_family(student)
    except ValueError as exc:
        raise RecipeError(f"recipe {recipe.name!r} is a diffusion recipe: {exc}") from None
    teacher = teacher_from(student)
    train_set, eval_set = latent_datasets(student, recipe.diffusion)
    try:
        result = run_recipe(
            student, teacher, recipe, output, train_set=train_set, eval_set=eval_set, resume=resume,
            accelerator=accelerator, stop_after_steps=stop_after_steps,
            extra_metrics={"converted_from": str(converted)},
        )  # fmt: skip
    except KeyboardInterrupt:
        raise TrainingInterrupted(mark_interrupted(output, write=accelerator.is_main_process)) from None
    if result.completed and accelerator.is_main_process:
        metadata = dict(meta.get("metadata") or {})
        card = diffusion_card_metrics(result.metrics, recipe)
        metadata.update(
            recipe_metadata({"name": recipe.name, "budget": recipe.budget, **recipe.to_dict()}, card, [card["dataset"]])
        )
        publish(result.model.to("cpu"), output, model_args=meta["base"].get("model_args"), metadata=metadata)
    accelerator.wait_for_everyone()
    torch.set_grad_enabled(True)
    return result
