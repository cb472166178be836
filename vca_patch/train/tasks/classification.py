"""The classification task: images and labels, top-1 / agreement / layer-error evaluation (also head-less models)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from vca_patch.checkpoint import from_pretrained
from vca_patch.core.model_io import model_input_size
from vca_patch.data import DatasetError, build_dataset
from vca_patch.train.evaluation import evaluate
from vca_patch.train.recipe import Recipe, RecipeError
from vca_patch.train.tasks.base import Task, TaskData, register_task, teacher_from


def check_data_fits(dataset: Any, input_size: tuple[int, int, int], recipe: Recipe) -> None:
    """Stop before training (DatasetError) when the recipe's images do not fit the model's input."""
    if len(dataset) == 0:
        raise DatasetError(f"recipe {recipe.name!r}: the training set ({recipe.data.kind}) is empty")
    image = dataset[0][0]
    shape = tuple(image.shape) if isinstance(image, torch.Tensor) else None
    if shape is not None and (len(shape) != 3 or shape != tuple(input_size)):
        raise DatasetError(
            f"recipe {recipe.name!r} gives {recipe.data.kind} images of shape {shape}, but the model takes "
            f"{tuple(input_size)} (channels, height, width); use a recipe whose data fit the model (e.g. an "
            "imagefolder of RGB images for a 3-channel model), or convert a model built for these images"
        )


def dataset_name(recipe: Recipe) -> str:
    """A short id of the recipe's dataset (the Hub id for "hf", the folder for ImageFolder)."""
    d = recipe.data
    if d.kind == "fashion_mnist":
        return "fashion_mnist"
    return str(d.path)


def card_metrics(metrics: dict[str, Any], recipe: Recipe) -> dict[str, Any]:
    """The model-card metrics block (numbers only) from a run's metrics.json content."""
    final, before = metrics.get("final", {}), metrics.get("before", {})
    out: dict[str, Any] = {"dataset": dataset_name(recipe), "split": recipe.data.eval_split}
    pairs = {
        "teacher_top1": final.get("top1_original"),
        "before_top1": before.get("top1_patched"),
        "after_top1": final.get("top1_patched"),
        "agreement_before": before.get("top1_agreement"),
        "agreement_after": final.get("top1_agreement"),
        "cls_cosine_before": before.get("cls_cosine"),
        "cls_cosine_after": final.get("cls_cosine"),
        "mean_layer_error_after": final.get("mean_layer_error"),
    }
    out.update({k: float(v) for k, v in pairs.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


def check_image_size(recipe: Recipe, height: int, converted: Path) -> None:
    """A recipe's data.img_size that is not the model's input size is refused before any data is read: the model
    would be trained at a size it does not run at (null: the model's own size)."""
    size = recipe.data.img_size
    if size is not None and size != height:
        raise RecipeError(
            f"recipe {recipe.name!r}: data.img_size is {size} px, but the converted model {converted} takes {height} "
            f"px; set data.img_size: {height}, or null (the model's own size)"
        )


@register_task("classification")
class ClassificationTask(Task):
    """Images from the recipe's data block; the engine's built-in attention_transfer and distill losses."""

    def load(self, converted: Path, recipe: Recipe) -> TaskData:
        student = from_pretrained(converted)
        teacher = teacher_from(student)
        _, height, _ = model_input_size(student)
        check_image_size(recipe, height, converted)
        model_cfg = dict(getattr(student, "pretrained_cfg", None) or {})
        model_cfg["input_size"] = model_input_size(student)
        train_set = build_dataset(recipe.data, "train", training=True, img_size=height, model_cfg=model_cfg)
        eval_set = build_dataset(recipe.data, "eval", training=False, img_size=height, model_cfg=model_cfg)
        check_data_fits(train_set, model_input_size(student), recipe)
        return TaskData(student, teacher, train_set, eval_set, int(getattr(student, "num_classes", 0) or 0))

    def batch_mixer(self, recipe: Recipe, num_classes: int) -> Callable[[Any, Any], tuple[Any, Any]] | None:
        if recipe.data.mixup > 0 or recipe.data.cutmix > 0:
            from vca_patch.data import mixup_fn

            return mixup_fn(recipe.data, num_classes)
        return None

    def evaluate(
        self, model: nn.Module, teacher: nn.Module, eval_set: Dataset | None, recipe: Recipe, accelerator: Any
    ) -> dict[str, Any]:
        return evaluate(model, teacher, eval_set, recipe.train.eval_images, accelerator)

    def card(self, metrics: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Any], list[str]]:
        return card_metrics(metrics, recipe), [dataset_name(recipe)]
