"""The model card's Hub task follows the base model: classification for encoders, text-to-image for text-conditioned
diffusion transformers, none for class-conditional DiT (no Hub task fits it)."""

from __future__ import annotations

import pytest
import timm

import vca_patch
from vca_patch import VCAConfig

pytest.importorskip("diffusers")

from tests.support.diffusers_models import tiny_dit, tiny_pixart


def _front_matter(model, folder) -> str:
    vca_patch.patch_model(model, VCAConfig(contrast_tokens=4))
    vca_patch.save_pretrained(model, folder)
    card = (folder / "README.md").read_text()
    return card.split("---")[1]


@pytest.mark.parametrize(
    ("build", "task"),
    [(tiny_pixart, "pipeline_tag: text-to-image"), (lambda: timm.create_model("deit_tiny_patch16_224"),
                                                      "pipeline_tag: image-classification")],
)  # fmt: skip
def test_card_task_follows_the_base(build, task, tmp_path):
    front = _front_matter(build(), tmp_path / "ckpt")
    assert task in front
    assert front.count("pipeline_tag") == 1


def test_class_conditional_dit_gets_no_classification_task(tmp_path):
    front = _front_matter(tiny_dit(), tmp_path / "ckpt")
    assert "pipeline_tag" not in front and "image-classification" not in front
    assert "diffusers" in front
