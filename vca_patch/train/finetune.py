"""`finetune`: run a recipe on a converted checkpoint and publish the recovered checkpoint."""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.checkpoint import from_pretrained, save_pretrained
from vca_patch.checkpoint.folder import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, read_checkpoint_config
from vca_patch.checkpoint.model_card import recipe_metadata
from vca_patch.core.atomic import atomic_write_text
from vca_patch.core.model_io import model_input_size
from vca_patch.data import DatasetError, build_dataset
from vca_patch.surgery import unpatch_model
from vca_patch.train.checkpoints import latest_checkpoint, trainer_state
from vca_patch.train.engine import RunResult, make_accelerator, run_recipe
from vca_patch.train.recipe import Recipe, load_recipe


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C (or SIGINT): metrics.json says "interrupted"; the message says how to resume."""


def resume_point(output: Path) -> int | None:
    """The optimizer step `--resume` continues from (the latest complete checkpoint's), or None without one."""
    ckpt = latest_checkpoint(output)
    return None if ckpt is None else int(trainer_state(ckpt)["global_step"])


def mark_interrupted(output: Path, *, write: bool = True) -> str:
    """Mark output/metrics.json "interrupted" with the step `--resume` continues from; return the message."""
    step = resume_point(output)
    if write and (output / "metrics.json").is_file():
        try:
            metrics = json.loads((output / "metrics.json").read_text())
        except (OSError, json.JSONDecodeError):
            metrics = None
        if isinstance(metrics, dict):
            metrics.update(status="interrupted", resume_step=step)
            atomic_write_text(output / "metrics.json", json.dumps(metrics, indent=2) + "\n")
    if step is None:
        return f"interrupted before the first checkpoint; nothing to resume in {output}: run again without --resume"
    return (
        f"interrupted; {output}/metrics.json is marked interrupted. Continue with --resume: it restarts from "
        f"step {step} ({latest_checkpoint(output)})"
    )


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


def teacher_from(model: nn.Module) -> nn.Module:
    """A frozen copy of the original model: the patched model with its original attention put back."""
    teacher = unpatch_model(copy.deepcopy(model)).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def publish(model: nn.Module, output: Path, *, model_args: dict | None, metadata: dict[str, Any]) -> None:
    """Write model.safetensors, config.json and README.md into `output` (each file replaced atomically),
    leaving metrics.json and checkpoints/ beside them."""
    output.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}-publish-"))
    try:
        save_pretrained(model, stage / "ckpt", model_args=model_args, metadata=metadata)
        for name in (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME):
            os.replace(stage / "ckpt" / name, output / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


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


def finetune(
    converted: str | Path,
    recipe: Recipe | str | Path,
    output: str | Path,
    *,
    resume: bool = False,
    stop_after_steps: int | None = None,
    accelerator: Any = None,
    device: str = "auto",
    mixed_precision: str | None = None,
) -> RunResult:
    """Recover a converted checkpoint with a recipe; writes a loadable checkpoint and metrics.json to `output`.

    Without an `accelerator`, one is made for `device` ("auto", "cpu", "cuda", "cuda:N") and `mixed_precision`
    ("auto", "no", "bf16", "fp16"; default: the recipe's train.mixed_precision).
    """
    converted, output = Path(converted), Path(output)
    recipe = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    accelerator = accelerator or make_accelerator(
        mixed_precision or recipe.train.mixed_precision, device=device, grad_accum=recipe.train.grad_accum
    )
    if recipe.diffusion is not None:  # latents and diffusion losses instead of images (train.diffusion_finetune)
        from vca_patch.train.diffusion_finetune import finetune_diffusion

        return finetune_diffusion(
            converted, recipe, output, resume=resume, stop_after_steps=stop_after_steps, accelerator=accelerator
        )
    meta = read_checkpoint_config(converted)
    student = from_pretrained(converted)
    teacher = teacher_from(student)
    _, height, _ = model_input_size(student)
    model_cfg = dict(getattr(student, "pretrained_cfg", None) or {})
    model_cfg["input_size"] = model_input_size(student)
    train_set = build_dataset(recipe.data, "train", training=True, img_size=height, model_cfg=model_cfg)
    eval_set = build_dataset(recipe.data, "eval", training=False, img_size=height, model_cfg=model_cfg)
    check_data_fits(train_set, model_input_size(student), recipe)
    try:
        result = run_recipe(
            student,
            teacher,
            recipe,
            output,
            train_set=train_set,
            eval_set=eval_set,
            resume=resume,
            accelerator=accelerator,
            num_classes=int(getattr(student, "num_classes", 0) or 0),
            stop_after_steps=stop_after_steps,
            extra_metrics={"converted_from": str(converted)},
        )
    except KeyboardInterrupt:
        raise TrainingInterrupted(mark_interrupted(output, write=accelerator.is_main_process)) from None
    if result.completed and accelerator.is_main_process:
        metadata = dict(meta.get("metadata") or {})
        metadata.update(
            recipe_metadata(
                {"name": recipe.name, "budget": recipe.budget, **recipe.to_dict()},
                card_metrics(result.metrics, recipe),
                [dataset_name(recipe)],
            )
        )
        publish(result.model.to("cpu"), output, model_args=meta["base"].get("model_args"), metadata=metadata)
    accelerator.wait_for_everyone()
    torch.set_grad_enabled(True)
    return result
