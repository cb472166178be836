"""The plan's measured latency against its budget: recorded in the plan file and warned about by the CLI."""

from __future__ import annotations

import dataclasses
import json

import timm
import torch

from vca_patch.bench.timing import RatioInterval
from vca_patch.cli.plan import over_budget_line
from vca_patch.planner import plan_model

RES = 56


def _planned():
    torch.manual_seed(0)
    model = timm.create_model(
        "vit_small_patch14_dinov2", pretrained=False, img_size=RES, depth=2, embed_dim=48, num_heads=2, num_classes=0
    ).eval()
    images = torch.randn(2, 3, RES, RES)
    return plan_model(
        model, images, budget=5.0, resolution=RES, contrast_tokens=(), mano_windows=(), merge_fractions=(0.5,),
        calibrate=False, repeats=1, min_time=0,
    )  # fmt: skip


def test_a_plan_measured_over_its_budget_is_flagged_and_recorded():
    result = _planned()
    ratio = result.measured["latency_ratio"]
    assert ratio == result.latency.ratio  # the chosen plan's timing, not a second one
    exact = dataclasses.replace(
        result, chosen=dataclasses.replace(result.chosen, measured_latency=RatioInterval.exact(ratio))
    )
    within = dataclasses.replace(exact, budget=ratio * 1.5)
    over = dataclasses.replace(exact, budget=ratio * 0.5)
    assert not within.over_budget and over_budget_line(within) is None
    assert over.over_budget
    line = over_budget_line(over)
    assert f"Measured {ratio:.3f}x is over the {ratio * 0.5:g}x budget" in line and "--min-time" in line
    assert json.loads(json.dumps(over.details("m")))["measured_over_budget"] is True
    assert within.details("m")["measured_over_budget"] is False


def test_a_measured_interval_holding_the_budget_is_said():
    result = _planned()
    ratio = result.measured["latency_ratio"]
    noisy = dataclasses.replace(result.chosen, measured_latency=RatioInterval(ratio, 0.9 * ratio, 1.1 * ratio, 5))
    straddling = dataclasses.replace(result, chosen=noisy, budget=1.05 * ratio)
    assert not straddling.over_budget and straddling.straddles_budget
    assert "lies inside this interval" in over_budget_line(straddling)
    assert straddling.details("m")["latency_interval"] == noisy.measured_latency.to_dict()
    clear = dataclasses.replace(straddling, budget=1.2 * ratio)
    assert not clear.straddles_budget and over_budget_line(clear) is None


def test_an_unmeasured_plan_is_never_over_budget():
    result = dataclasses.replace(_planned(), measured={}, budget=1e-6)
    assert not result.over_budget and over_budget_line(result) is None
