"""`make_faster`: the one-call API plans, applies the plan to the model itself and measures it on held-out images."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F

import vca_patch
from tests.integration.attention_cost import quadratic_softmax
from vca_patch.core.patch_state import get_patch_state
from vca_patch.planner import PlanError, speedup
from vca_patch.planner.speedup import held_out_split, make_faster, vca_pays

RES = 112  # 8x8 patches + CLS
SEARCH = {"contrast_tokens": (16,), "merge_fractions": (0.5,), "mano_windows": (), "repeats": 3, "min_time": 0.0}


@pytest.fixture
def steady_timing(monkeypatch):
    with quadratic_softmax(monkeypatch):
        yield


def sharp_dinov2(depth: int = 2) -> torch.nn.Module:
    """A small random-weight DINOv2-style timm ViT with peaked attention, so every conversion changes its outputs."""
    model = timm.create_model(
        "vit_small_patch14_dinov2", pretrained=False, img_size=RES, depth=depth, embed_dim=64, num_heads=2,
        init_values=0.5, num_classes=0,
    )  # fmt: skip
    with torch.no_grad():
        for block in model.blocks:
            block.attn.qkv.weight[:128].mul_(8.0)
    return model.eval()


def cosines(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """(CLS cosine, patch-token cosine) averaged over images, computed here from the final tokens."""
    cls = F.cosine_similarity(reference[:, 0].double(), candidate[:, 0].double(), dim=-1).mean()
    patch = F.cosine_similarity(reference[:, 1:].double(), candidate[:, 1:].double(), dim=-1).mean()
    return float(cls), float(patch)


def test_make_faster_applies_its_plan_in_place_and_reports_what_it_measured(steady_timing):
    model = sharp_dinov2()
    original = copy.deepcopy(model)
    calibration, held = torch.randn(2, 3, RES, RES), torch.randn(2, 3, RES, RES)
    report = vca_patch.make_faster(model, calibration, resolution=RES, budget=0.7, eval_images=held, **SEARCH)

    state = get_patch_state(model)  # the model itself carries the plan, as patch_model leaves it
    assert state is not None and state.config == report.config == report.plan.config
    chosen = report.plan.chosen
    assert chosen.vca_layers or any(chosen.schedule)  # a conversion, not the original
    with torch.no_grad():
        reference, converted = original.forward_features(held), model.forward_features(held)
    assert not torch.allclose(reference, converted)
    cls, patch = cosines(reference, converted)
    assert report.cls_cosine == pytest.approx(cls, abs=1e-6)
    assert report.patch_token_cosine == pytest.approx(patch, abs=1e-6)
    assert report.eval_images == 2 and report.measured_on == "2 evaluation images"
    assert report.latency_ratio > 0 and report.within_budget == (report.latency_ratio <= 0.7)
    assert report.metrics()["plan"] == chosen.describe() and chosen.describe() in report.summary()


def test_without_eval_images_the_held_out_ones_never_calibrate(steady_timing, monkeypatch):
    seen = []
    real = speedup.plan_model

    def recording(model, images, **options):
        seen.append(images.clone())
        return real(model, images, **options)

    monkeypatch.setattr(speedup, "plan_model", recording)
    model = sharp_dinov2(depth=1)
    original = copy.deepcopy(model)
    images = torch.randn(3, 3, RES, RES)
    report = make_faster(model, images, resolution=RES, budget=0.7, **SEARCH)
    calibrated, held = held_out_split(3)
    assert (calibrated, held) == ([0, 1], [2])  # every 5th counted back from the last: image 2
    assert torch.equal(seen[0], images[calibrated])
    with torch.no_grad():
        cls, patch = cosines(original.forward_features(images[held]), model.forward_features(images[held]))
    assert (report.cls_cosine, report.patch_token_cosine) == (
        pytest.approx(cls, abs=1e-6),
        pytest.approx(patch, abs=1e-6),
    )
    assert report.measured_on == "1 of the 3 images held out of calibration (every 5th)"


def test_the_held_out_split_and_where_vca_pays():
    assert held_out_split(2) == ([0], [1])
    assert held_out_split(6) == ([1, 2, 3, 4], [0, 5])
    assert held_out_split(11) == ([1, 2, 3, 4, 6, 7, 8, 9], [0, 5, 10])
    with pytest.raises(PlanError, match="at least 2 images"):
        held_out_split(1)
    assert not vca_pays(197) and not vca_pays(249) and vca_pays(257) and vca_pays(1370)


def test_make_faster_refuses_before_any_work():
    model = sharp_dinov2(depth=1)
    images = torch.randn(2, 3, RES, RES)
    with pytest.raises(PlanError, match=r"eval_images must be \[N, 3, 112, 112\]"):
        make_faster(model, images, resolution=RES, budget=0.5, eval_images=torch.randn(1, 3, 224, 224))
    assert get_patch_state(model) is None
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=16))
    with pytest.raises(PlanError, match="patched already"):
        make_faster(model, images, resolution=RES, budget=0.5)
