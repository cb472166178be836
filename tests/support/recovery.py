"""Shared helpers for the recovery/recipe tests: a tiny ViT trained on real Fashion-MNIST, cached per session."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import timm
import torch

from vca_patch.data.fashion_mnist import DEFAULT_ROOT, load_fashion_mnist
from vca_patch.train.classifier import train_classifier

TINY_ARGS = {
    "img_size": 28,
    "patch_size": 4,
    "in_chans": 1,
    "num_classes": 10,
    "embed_dim": 32,
    "depth": 2,
    "num_heads": 2,
    "mlp_ratio": 2.0,
}
ARCH = "vit_tiny_patch16_224"

needs_fashion_mnist = pytest.mark.skipif(
    not DEFAULT_ROOT.is_dir(), reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)"
)


def tiny_vit() -> torch.nn.Module:
    return timm.create_model(ARCH, pretrained=False, **TINY_ARGS)


@functools.lru_cache(maxsize=1)
def _trained_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = tiny_vit()
    train_classifier(model, load_fashion_mnist("train", limit=4000), epochs=2, batch_size=64, lr=3e-3, warmup_steps=10)
    return copy.deepcopy(model.state_dict())


def trained_tiny_vit() -> torch.nn.Module:
    """A tiny ViT trained for a few seconds on 4000 Fashion-MNIST images (cached for the session)."""
    model = tiny_vit()
    model.load_state_dict(_trained_state())
    return model.eval()


def head_less_pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.utils.data.TensorDataset]:
    """(teacher, VCA student, 32 random 32 px images with unused labels): a head-less ViT for feature distillation."""
    import vca_patch

    torch.manual_seed(0)
    teacher = timm.create_model(ARCH, pretrained=False, num_classes=0, img_size=32, patch_size=8)
    model = copy.deepcopy(teacher)
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    return teacher, model, torch.utils.data.TensorDataset(torch.randn(32, 3, 32, 32), torch.zeros(32, dtype=torch.long))


def probe_images(n: int = 64, split: str = "test") -> torch.Tensor:
    return load_fashion_mnist(split, limit=n).tensors[0]


def write_recipe(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
