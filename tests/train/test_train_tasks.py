"""The recipe engine's task registry and the targets' recovery-training hooks (no training runs)."""

from __future__ import annotations

import pytest
import torch

import vca_patch
from tests.support.recovery import head_less_pair
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.handler import handler_for
from vca_patch.targets.vca.training import lambda_parameters
from vca_patch.train import recipe_from_dict
from vca_patch.train.objective import STAGE_LOSSES
from vca_patch.train.params import guard_parameters, parameter_groups, parameter_trace
from vca_patch.train.recipe import TrainSpec
from vca_patch.train.tasks import TASKS, Task, register_task, task_for, task_name

STAGES = [{"name": "s", "kind": "distill", "steps": 1}]


def test_builtin_tasks_are_registered_with_their_stage_losses():
    assert {"classification", "diffusion"} <= set(TASKS)
    assert {"attention_transfer", "distill", "distill_diffusion"} <= set(STAGE_LOSSES)
    recipe = recipe_from_dict({"name": "r", "stages": STAGES})
    assert task_name(recipe) == "classification" and task_for(recipe) is TASKS["classification"]


def test_register_task_adds_the_task_and_its_losses():
    def loss(objective, x, y):
        return torch.zeros(())

    try:

        @register_task("toy")
        class Toy(Task):
            stage_losses = {"toy_loss": loss}  # noqa: RUF012

        assert isinstance(TASKS["toy"], Toy) and Toy.name == "toy" and STAGE_LOSSES["toy_loss"] is loss
    finally:
        TASKS.pop("toy", None)
        STAGE_LOSSES.pop("toy_loss", None)


def test_target_training_hooks_default_to_nothing():
    config, handler = TargetConfig(), handler_for(TargetConfig)
    model = torch.nn.Linear(2, 2)
    assert handler.parameter_groups(config, model) == {} and handler.guard_parameters(config, model, None) == 0
    assert handler.parameter_trace(config, model) == {}
    assert guard_parameters(model, TrainSpec()) == 0 and parameter_trace(model) == {}  # not patched: no target


def test_vca_hooks_group_trace_and_guard_lambda():
    _, model, _ = head_less_pair()
    groups = parameter_groups(model)
    assert {id(p) for _, p in groups["lambda"]} == {id(p) for p in lambda_parameters(model)} and groups["lambda"]
    assert all(".lambda1." in n or ".lambda2." in n for n, _ in groups["lambda"])
    trace = parameter_trace(model)["lambda"]
    assert trace and all(len(pair) == 2 for pair in trace)
    layer = next(m for m in model.modules() if isinstance(m, vca_patch.VisualContrastAttention))
    lam = layer.lambda2
    with torch.no_grad():
        lam.q1.add_(lam.k1 / lam.k1.norm() ** 2 * 3.0)  # exp⟨q1, k1⟩ grows by e³: λ₂ far above 0.95
    assert float(lam().detach()) > 0.95
    assert guard_parameters(model, TrainSpec(options={"lambda_max": 0.95})) == 1
    assert float(lam().detach()) == pytest.approx(0.95, abs=1e-5)
