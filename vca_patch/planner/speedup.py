"""`make_faster`: one call from a pretrained ViT to a faster one, in place: plan, apply, calibrate, recover,
measure.

The planner (`plan_model`) chooses per block between softmax, VCA(n), MANO(k) and token merging within a latency
budget; `make_faster` applies its plan to the model itself (as `patch_model` does), calibrates the VCA blocks on the
calibration images, optionally recovers them (a `recover` hook, e.g. a recipe run: the planner knows no training
code), and measures the result against a copy of the original on images kept apart from calibration: the batch-1
latency ratio (both timed side by side) and the CLS and patch-token cosine of the final tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vca_patch.core.patch_state import get_patch_state
from vca_patch.eval.final_tokens import fidelity, latency, tokens
from vca_patch.planner.model_info import PlanError
from vca_patch.planner.planner import PlanResult, Recover, apply_plan, measured_score, plan_model
from vca_patch.targets.base import TargetConfig

HOLD_OUT_EVERY = 5  # without eval images: every 5th calibration image (counted from the last) is kept apart
VCA_PAYS_FROM_TOKENS = 250  # VCA with its defaults beats fused softmax attention from ~220-270 tokens (README)


def vca_pays(tokens: int) -> bool:
    """Whether a VCA block can be faster than softmax attention on `tokens` tokens (CLS included): below about
    VCA_PAYS_FROM_TOKENS its 2n contrast tokens are more work than the attention they replace."""
    return tokens >= VCA_PAYS_FROM_TOKENS


def held_out_split(count: int) -> tuple[list[int], list[int]]:
    """(calibration indices, held-out indices) of `count` images: every HOLD_OUT_EVERY-th image counted back from
    the last is held out (so the last always is), the rest calibrate; PlanError for fewer than 2 images."""
    if count < 2:
        raise PlanError(f"holding images out of the calibration ones needs at least 2 images, got {count}; "
                        "pass evaluation images")  # fmt: skip
    held = sorted(range(count - 1, -1, -HOLD_OUT_EVERY))
    return [i for i in range(count) if i not in set(held)], held


@dataclass
class SpeedupReport:
    """What `make_faster` applied and what it measured on the held-out images (the model vs. its original)."""

    plan: PlanResult  # the planner's choice, candidates and measurements (its `measured` is empty: see below)
    latency_ratio: float  # batch-1 latency / the original's, timed side by side at `plan.resolution`
    latency_ms: float
    original_ms: float
    cls_cosine: float  # mean over the held-out images
    patch_token_cosine: float  # mean over images of the mean over patch tokens
    mean_patch_cosine: float
    eval_images: int
    measured_on: str  # where the held-out images came from
    recovery: str | None = None  # what the `recover` hook did (None: not asked; said why when skipped)

    @property
    def config(self) -> TargetConfig:
        """The applied plan (`patch_model`'s config; `save_pretrained` stores it)."""
        return self.plan.config

    @property
    def within_budget(self) -> bool:
        """The measured latency ratio is within the budget (batch-1 timings move by a few percent between runs)."""
        return self.latency_ratio <= self.plan.budget

    def metrics(self) -> dict[str, Any]:
        """JSON-safe record for a checkpoint's metadata."""
        return {
            "plan": self.plan.chosen.describe(),
            "budget": self.plan.budget,
            "resolution": self.plan.resolution,
            "latency_ratio": self.latency_ratio,
            "latency_ms": self.latency_ms,
            "original_ms": self.original_ms,
            "cls_cosine": self.cls_cosine,
            "patch_token_cosine": self.patch_token_cosine,
            "mean_patch_cosine": self.mean_patch_cosine,
            "eval_images": self.eval_images,
            "measured_on": self.measured_on,
            "recovery": self.recovery,
        }

    def summary(self) -> str:
        """One line: the plan, the measured latency ratio against the budget, the fidelity and where measured."""
        verdict = "within" if self.within_budget else "OVER"
        return (
            f"{self.plan.chosen.describe()}: {self.latency_ratio:.2f}x the original's latency at "
            f"{self.plan.resolution} px ({verdict} the {self.plan.budget:g}x budget), CLS cosine "
            f"{self.cls_cosine:.4f}, patch-token cosine {self.patch_token_cosine:.4f} on {self.measured_on}"
        )


def _split(images: torch.Tensor, eval_images: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(calibration images, held-out images, where the held-out ones came from)."""
    if eval_images is not None:
        if eval_images.ndim != 4 or eval_images.shape[1:] != images.shape[1:] or not len(eval_images):
            raise PlanError(f"eval_images must be [N, {', '.join(map(str, images.shape[1:]))}] like the calibration "
                            f"images, got {tuple(eval_images.shape)}")  # fmt: skip
        return images, eval_images, f"{len(eval_images)} evaluation images"
    calib, held = held_out_split(len(images))
    where = f"{len(held)} of the {len(images)} images held out of calibration (every {HOLD_OUT_EVERY}th)"
    return images[calib], images[held], where


def measure_speedup(
    original: nn.Module, model: nn.Module, images: torch.Tensor, resolution: int, *, repeats: int, min_time: float
) -> dict[str, float]:
    """CLS / patch-token / mean-patch cosine of `model`'s final tokens to `original`'s on `images`, and their
    batch-1 latency at `resolution` (timed interleaved, `repeats` rounds and `min_time` seconds at least)."""
    scores = fidelity(tokens(original, images, 8), tokens(model, images, 8))
    timed = latency({"original": original, "model": model}, (resolution,), repeats, min_time=min_time)
    return {
        **scores,
        "latency_ratio": timed["model"][resolution]["ratio"],
        "latency_ms": timed["model"][resolution]["ms"],
        "original_ms": timed["original"][resolution]["ms"],
    }


def make_faster(
    model: nn.Module,
    images: torch.Tensor,
    *,
    resolution: int,
    budget: float,
    eval_images: torch.Tensor | None = None,
    repeats: int = 3,
    min_time: float = 0.5,
    log: Callable[[str], None] | None = None,
    recover: Recover | None = None,
    **plan_options: Any,
) -> SpeedupReport:
    """Make `model` (unpatched, eval mode) run within `budget` × its batch-1 latency at `resolution`, in place.

    `images` ([B, 3, resolution, resolution], normalised as the model expects) plan and calibrate; the result is
    measured on `eval_images` (same shape but B), or, without them, on every HOLD_OUT_EVERY-th of `images` (counted
    from the last), which are then kept out of planning and calibration. `plan_options` go to `plan_model`
    (contrast_tokens, merge_fractions, mano_windows, local_window, objective, ...). `recover(model, original)`, when
    given, recovers each planning finalist with VCA blocks before it is scored (recovered VCA is a candidate), and
    runs again after calibration on the chosen plan, whatever it is, returning a line for the report; a recovery
    that leaves the plan further from the original on the calibration images is undone (`_recovered`). A copy of
    the original is kept only while recovering and measuring.
    Raises PlanError (nothing changed) when no plan fits the budget, or the best one within it is the original.
    """
    if get_patch_state(model) is not None:
        raise PlanError("make_faster plans an unpatched model; this one is patched already (unpatch_model first)")
    calib, held, where = _split(images, eval_images)
    result = plan_model(
        model, calib, budget=budget, resolution=resolution, measure=False, repeats=repeats,
        min_time=min_time, log=log, recover=recover, **plan_options,
    )  # fmt: skip
    if result.chosen.is_original:
        raise PlanError(f"within {budget:g}x at {resolution} px the planner keeps the original: no conversion it "
                        "measured pays here; keep the original, or plan for a larger resolution")  # fmt: skip
    original = copy.deepcopy(model)
    if log is not None:
        log(f"applying {result.chosen.describe()}; measuring it on {where}")
    apply_plan(model, result.config, calib if plan_options.get("calibrate", True) else None)
    recovery = _recovered(model, original, result, recover, calib, log)
    measured = measure_speedup(original, model, held, resolution, repeats=repeats, min_time=min_time)
    return SpeedupReport(
        plan=result, latency_ratio=measured["latency_ratio"], latency_ms=measured["latency_ms"],
        original_ms=measured["original_ms"], cls_cosine=measured["cls_cosine"],
        patch_token_cosine=measured["patch_token_cosine"], mean_patch_cosine=measured["mean_patch_cosine"],
        eval_images=len(held), measured_on=where, recovery=recovery,
    )  # fmt: skip


def _recovered(
    model: nn.Module,
    original: nn.Module,
    result: PlanResult,
    recover: Recover | None,
    images: torch.Tensor,
    log: Callable | None,
) -> str | None:
    """What `recover` did to `model` (in place), or why it was undone: a recovery that leaves the plan further from
    the original on the calibration `images` than before it (mean of CLS and patch-token cosine) is undone, e.g. a
    recipe that trains a merge plan's linear weights, which derails its features (`recipes/dinov2_small_merge.yaml`
    trains its norms and biases instead)."""
    if recover is None:
        return None
    reference = tokens(original, images, 8)  # the original's final tokens, once for before and after
    before, kept = _closeness(reference, model, images), copy.deepcopy(model.state_dict())
    try:
        line = recover(model, original)
    except ValueError as error:  # e.g. a recipe whose learning rates train nothing this plan has
        model.load_state_dict(kept)
        line = f"not recovered: {error}"
    else:
        after = _closeness(reference, model, images)
        if after < before:
            model.load_state_dict(kept)
            line += (f"; undone: it left {result.chosen.describe()} further from the original on the calibration "
                     f"images ({before:.4f} -> {after:.4f}, mean of CLS and patch-token cosine)")  # fmt: skip
        else:
            line += f" (calibration images {before:.4f} -> {after:.4f}, mean of CLS and patch-token cosine)"
    if log is not None:
        log(line)
    return line


def _closeness(reference: torch.Tensor, model: nn.Module, images: torch.Tensor) -> float:
    """Mean of the CLS and patch-token cosine of `model`'s final tokens on `images` to `reference` (the original's
    there): `measured_score`'s "both"."""
    return measured_score(fidelity(reference, tokens(model, images, 8)), "both")
