"""ImageFolder trees through the recipe data spec, with timm's transforms (real Fashion-MNIST images as PNGs)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from tests.support.recovery import needs_fashion_mnist
from vca_patch.data import DatasetError, build_dataset, load_fashion_mnist
from vca_patch.train.recipe import DataSpec

pytestmark = needs_fashion_mnist


@pytest.fixture
def image_folder(tmp_path):
    images, labels = load_fashion_mnist("test", limit=40).tensors
    for split, rows in (("train", range(0, 24)), ("val", range(24, 40))):
        for i in rows:
            folder = tmp_path / split / f"class_{int(labels[i])}"
            folder.mkdir(parents=True, exist_ok=True)
            pixels = (images[i, 0] * 255).clamp(0, 255).to(torch.uint8).numpy()
            Image.fromarray(pixels).convert("RGB").save(folder / f"{i}.png")
    return tmp_path


@pytest.mark.parametrize("augment", ["none", "timm"])
def test_imagefolder_split_with_timm_transforms(image_folder, augment):
    spec = DataSpec(kind="imagefolder", path=str(image_folder), eval_split="val", augment=augment, eval_limit=8)
    train = build_dataset(spec, "train", training=True, img_size=32)
    val = build_dataset(spec, "val", training=False, img_size=32)
    assert len(train) == 24 and len(val) == 8
    x, y = val[0]
    assert x.shape == (3, 32, 32) and torch.isfinite(x).all() and isinstance(y, int)


def test_missing_imagefolder_split_is_named(image_folder):
    spec = DataSpec(kind="imagefolder", path=str(image_folder), eval_split="holdout")
    with pytest.raises(DatasetError, match="holdout"):
        build_dataset(spec, "holdout", training=False, img_size=32)
