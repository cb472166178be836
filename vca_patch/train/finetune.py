"""`finetune`: run a recipe on a converted checkpoint and publish the recovered checkpoint.

One entry for every task: the recipe's task (`train.tasks`: classification, diffusion) loads the model and its
data, measures it, and writes the model card's metrics; the engine (`train.engine.run_recipe`) trains.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.checkpoint import save_pretrained
from vca_patch.checkpoint.folder import CARD_NAME, CONFIG_NAME, WEIGHTS_NAME, read_checkpoint_config
from vca_patch.checkpoint.model_card import recipe_metadata
from vca_patch.core.atomic import atomic_write_text, signals_deferred
from vca_patch.train.checkpoints import latest_checkpoint, trainer_state
from vca_patch.train.engine import RunOptions, RunResult, make_accelerator, run_recipe
from vca_patch.train.recipe import Recipe, load_recipe
from vca_patch.train.tasks import Task, task_for, teacher_from
from vca_patch.train.tasks.classification import card_metrics, check_data_fits, dataset_name

__all__ = [  # card_metrics, check_data_fits, dataset_name, teacher_from: re-exported from train.tasks
    "TrainingInterrupted", "card_metrics", "check_data_fits", "dataset_name", "finetune", "mark_interrupted",
    "publish", "publish_result", "resume_point", "teacher_from",
]  # fmt: skip


class TrainingInterrupted(KeyboardInterrupt):
    """A run stopped by Ctrl-C, SIGTERM or SIGHUP: metrics.json says "interrupted"; the message says how to
    resume."""


def resume_point(output: Path) -> int | None:
    """The optimizer step `--resume` continues from (the latest complete checkpoint's), or None without one."""
    ckpt = latest_checkpoint(output)
    return None if ckpt is None else int(trainer_state(ckpt)["global_step"])


def mark_interrupted(output: Path, *, write: bool = True, recipe: str | None = None) -> str:
    """Mark output/metrics.json "interrupted" with the step `--resume` continues from; return the message. With
    `recipe` (its name), a run stopped before its first evaluation (loading data, measuring the student) gets a
    metrics.json that says so, rather than none."""
    step = resume_point(output)
    marked = False
    if write:
        metrics = _metrics_to_mark(output, recipe)
        if metrics is not None:
            metrics.update(status="interrupted", resume_step=step, interrupted_at=f"step {step or 0}")
            atomic_write_text(output / "metrics.json", json.dumps(metrics, indent=2) + "\n")
            marked = True
    said = f"{output}/metrics.json is marked interrupted. " if marked else ""
    if step is None:
        said = f" ({output}/metrics.json says so)" if marked else ""
        return f"interrupted before the first checkpoint{said}; nothing to resume: run again without --resume"
    return f"interrupted; {said}Continue with --resume: it restarts from step {step} ({latest_checkpoint(output)})"


def _metrics_to_mark(output: Path, recipe: str | None) -> dict[str, Any] | None:
    """output/metrics.json's content to mark; a new record for `recipe` when there is none yet (the output folder
    made if missing; its parent must exist); None when there is nothing to mark or it cannot be read."""
    path = output / "metrics.json"
    if path.is_file():
        try:
            metrics = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        return metrics if isinstance(metrics, dict) else None
    if recipe is None or os.path.lexists(path):
        return None
    try:
        output.mkdir(exist_ok=True)
    except OSError:
        return None
    return {"recipe": recipe, "status": "interrupted", "evaluations": []}


def publish(model: nn.Module, output: Path, *, model_args: dict | None, metadata: dict[str, Any]) -> None:
    """Write model.safetensors, config.json and README.md into `output` (each file replaced atomically),
    leaving metrics.json and checkpoints/ beside them."""
    output.mkdir(exist_ok=True)  # its parent must exist: missing parents are never made
    stage = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}-publish-"))
    try:
        save_pretrained(model, stage / "ckpt", model_args=model_args, metadata=metadata)
        for name in (WEIGHTS_NAME, CONFIG_NAME, CARD_NAME):
            os.replace(stage / "ckpt" / name, output / name)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


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
    task = task_for(recipe)  # classification (images) or diffusion (latents, diffusion losses): train.tasks
    data = None
    try:  # an interrupt while loading is marked like one while training
        data = task.load(converted, recipe)
        options = RunOptions(
            train_set=data.train_set,
            eval_set=data.eval_set,
            resume=resume,
            accelerator=accelerator,
            num_classes=data.num_classes,
            stop_after_steps=stop_after_steps,
            extra_metrics={"converted_from": str(converted)},
        )
        result = run_recipe(data.student, data.teacher, recipe, output, options)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM / SIGHUP (the CLI raises KeyboardInterrupt for them)
        with signals_deferred():  # a second signal must not stop the marking half way
            message = mark_interrupted(output, write=accelerator.is_main_process, recipe=recipe.name)
        raise TrainingInterrupted(message) from None
    finally:
        if data is not None:
            _report_skipped(data.train_set, data.eval_set)
    if result.completed and accelerator.is_main_process:
        publish_result(task, result, recipe, converted, output)
    accelerator.wait_for_everyone()
    torch.set_grad_enabled(True)
    return result


def _report_skipped(*datasets: Any) -> None:
    """A warning line on stderr for each dataset that skipped unreadable images (data.skip_bad_images)."""
    from vca_patch.data.images import skipped_images

    for dataset in datasets:
        skipped = skipped_images(dataset)
        line = skipped.summary() if skipped is not None else None
        if line:
            print(f"warning: {line}", file=sys.stderr)


def publish_result(task: Task, result: RunResult, recipe: Recipe, converted: Path, output: Path) -> None:
    """Publish a completed run's weights into `output` with the converted checkpoint's metadata, the recipe and
    the task's card metrics."""
    meta = read_checkpoint_config(converted)
    metadata = dict(meta.get("metadata") or {})
    card, datasets = task.card(result.metrics, recipe)
    metadata.update(recipe_metadata({"name": recipe.name, "budget": recipe.budget, **recipe.to_dict()}, card, datasets))
    publish(result.model.to("cpu"), output, model_args=meta["base"].get("model_args"), metadata=metadata)
