"""The task registry: what the recipe engine and `finetune` need from a kind of model (classification, diffusion).

A task loads a converted checkpoint with its data (`load`), shapes batches (`batch_mixer`), measures a model
against its teacher (`evaluate`) and writes the model card's metrics (`card`). Its stage losses are registered
with `train.objective.register_stage_loss` when the task registers. A recipe names its task through `task_name`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from torch import nn
from torch.utils.data import Dataset

from vca_patch.surgery import unpatch_model
from vca_patch.train.objective import StageLoss, register_stage_loss
from vca_patch.train.recipe import Recipe


def teacher_from(model: nn.Module) -> nn.Module:
    """A frozen copy of the original model: the patched model with its original attention put back."""
    teacher = unpatch_model(copy.deepcopy(model)).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


@dataclass
class TaskData:
    """A converted checkpoint loaded for a recipe: student, frozen teacher and the data sets."""

    student: nn.Module
    teacher: nn.Module
    train_set: Dataset
    eval_set: Dataset | None
    num_classes: int = 0


class Task:
    """One kind of recovery run. Subclasses set `name`, `stage_losses` and override what differs."""

    name: ClassVar[str] = ""
    stage_losses: ClassVar[dict[str, StageLoss]] = {}  # stage kind -> loss(objective, x, y), registered with the task

    def load(self, converted: Path, recipe: Recipe) -> TaskData:
        """The student (`converted`), its teacher and the recipe's training and evaluation sets."""
        raise NotImplementedError

    def batch_mixer(self, recipe: Recipe, num_classes: int) -> Callable[[Any, Any], tuple[Any, Any]] | None:
        """A (x, y) -> (x, y) batch transform for distill stages (mixup / cutmix), or None."""
        return None

    def evaluate(
        self, model: nn.Module, teacher: nn.Module, eval_set: Dataset | None, recipe: Recipe, accelerator: Any
    ) -> dict[str, Any]:
        """The measurements of `model` against `teacher` recorded at each evaluation."""
        raise NotImplementedError

    def card(self, metrics: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Any], list[str]]:
        """(model-card metrics block, dataset ids) from a finished run's metrics.json content."""
        raise NotImplementedError


TASKS: dict[str, Task] = {}


def register_task(name: str) -> Callable[[type[Task]], type[Task]]:
    """Class decorator: register a `Task` subclass under `name`, and its stage losses with the objective."""

    def wrap(cls: type[Task]) -> type[Task]:
        cls.name = name
        TASKS[name] = cls()
        for kind, loss in cls.stage_losses.items():
            register_stage_loss(kind)(loss)
        return cls

    return wrap


def task_name(recipe: Recipe) -> str:
    """The task a recipe runs: "diffusion" with a `diffusion` block, else "classification"."""
    return "diffusion" if recipe.diffusion is not None else "classification"


def task_for(recipe: Recipe) -> Task:
    name = task_name(recipe)
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"recipe {recipe.name!r}: no task {name!r} registered; known: {sorted(TASKS)}") from None
