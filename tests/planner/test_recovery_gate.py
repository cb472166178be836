"""`make_faster`'s recovery of the chosen plan: kept when it leaves the plan at least as close to the original on the
calibration images, undone (weights restored exactly) when it leaves it further, and said either way."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from tests.support.recovery import tiny_vit
from vca_patch import MergeConfig, patch_model
from vca_patch.eval.final_tokens import tokens
from vca_patch.planner.speedup import _closeness, _recovered


def _plan() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    original = tiny_vit().eval()
    plan = copy.deepcopy(original)
    patch_model(plan, MergeConfig(r=2))
    return original, plan, torch.randn(4, 1, 28, 28)


RESULT = SimpleNamespace(chosen=SimpleNamespace(describe=lambda: "merge r=2 from block 0"))


def test_a_recovery_that_moves_the_plan_away_is_undone_exactly():
    original, plan, images = _plan()
    before = {k: v.clone() for k, v in plan.state_dict().items()}

    def derail(model, _original):
        _derailed(model)
        return "recovered with r.yaml"

    line = _recovered(plan, original, RESULT, derail, images, None)
    assert line.startswith("recovered with r.yaml; undone: it left merge r=2 from block 0 further from the original")
    assert all(torch.equal(before[k], v) for k, v in plan.state_dict().items())


def _derailed(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return model


def test_a_recovery_that_moves_the_plan_closer_is_kept():
    original, plan, images = _plan()
    derailed = _derailed(copy.deepcopy(plan))
    reference = tokens(original, images, 8)
    far, near = _closeness(reference, derailed, images), _closeness(reference, plan, images)
    lines: list[str] = []

    def heal(model, _original):  # back to the plan's weights: closer than the derailed start
        model.load_state_dict(plan.state_dict())
        return "recovered with r.yaml"

    assert _recovered(derailed, original, RESULT, heal, images, lines.append) == lines[0]
    assert far < near and lines[0] == (
        f"recovered with r.yaml (calibration images {far:.4f} -> {near:.4f}, mean of CLS and patch-token cosine)"
    )
    assert all(torch.equal(plan.state_dict()[k], v) for k, v in derailed.state_dict().items())


def test_a_recipe_that_trains_nothing_here_is_said_and_changes_nothing():
    original, plan, images = _plan()
    before = {k: v.clone() for k, v in plan.state_dict().items()}

    def trains_nothing(model, _original):
        with torch.no_grad():
            next(model.parameters()).add_(1.0)  # half-done when it fails
        raise ValueError("stage 'd' trains nothing: every learning rate is 0")

    line = _recovered(plan, original, RESULT, trains_nothing, images, None)
    assert line == "not recovered: stage 'd' trains nothing: every learning rate is 0"
    assert all(torch.equal(before[k], v) for k, v in plan.state_dict().items())
