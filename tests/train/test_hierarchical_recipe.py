"""The hierarchical recipe (recipes/swin_fashion_mnist.yaml): a short `finetune` run of a tiny random Swin
converted to global VCA lowers its distillation loss to the original."""

from __future__ import annotations

import timm
import torch
import torch.nn.functional as F

import vca_patch
from tests.support.paths import RECIPES
from tests.support.recovery import needs_fashion_mnist
from vca_patch import VCAConfig
from vca_patch.data.fashion_mnist import load_fashion_mnist
from vca_patch.train import finetune, load_recipe, recipe_from_dict

RECIPE = RECIPES / "swin_fashion_mnist.yaml"
# Stage grids 14x14 (global VCA) and 7x7 (the last stage: window attention kept), window 7.
SWIN_ARGS = {"img_size": 28, "patch_size": 2, "in_chans": 1, "num_classes": 10, "embed_dim": 16, "depths": [2, 2],
             "num_heads": [1, 2], "window_size": 7}  # fmt: skip


def _kl(student: torch.nn.Module, teacher: torch.nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float(F.kl_div(student(x).log_softmax(-1), teacher(x).log_softmax(-1), log_target=True,
                              reduction="batchmean"))  # fmt: skip


def test_recipe_file_validates():
    recipe = load_recipe(RECIPE)
    assert recipe.name == "swin_fashion_mnist" and [s.kind for s in recipe.stages] == ["distill"]
    assert recipe.data.kind == "fashion_mnist" and recipe.total_steps == 400


@needs_fashion_mnist
def test_short_run_on_a_tiny_swin_lowers_the_distillation_loss(tmp_path):
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **SWIN_ARGS).eval()
    with torch.no_grad():  # a random head gives near-uniform logits: sharpen them, so the KL has something to see
        model.head.fc.weight.mul_(50)
    teacher = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, **SWIN_ARGS).eval()
    teacher.load_state_dict(model.state_dict())
    report = vca_patch.patch_model(model, VCAConfig(swin_mode="global"))
    assert [s.settings["stage"] for s in report.patched] == [0, 0] and all(s.notes for s in report.patched)
    vca_patch.save_pretrained(model, tmp_path / "converted", model_args=SWIN_ARGS)

    data = load_recipe(RECIPE).to_dict()
    data["data"].update(train_limit=256, eval_limit=16)
    data["train"].update(batch_size=16, eval_every=12, checkpoint_every=12, eval_images=16, log_every=4)
    data["stages"][0].update(steps=12, warmup_steps=1, label_weight=0.0)  # distillation alone: the KL must fall
    result = finetune(tmp_path / "converted", recipe_from_dict(data), tmp_path / "out", device="cpu")
    assert result.completed

    x = load_fashion_mnist("test", limit=64).tensors[0]
    before, after = _kl(model, teacher, x), _kl(result.model.eval(), teacher, x)
    assert before > 1e-3  # global mode is approximate: there is a loss to lower
    assert after < 0.5 * before, (before, after)
    again = vca_patch.from_pretrained(tmp_path / "out")  # the published checkpoint is the trained student
    with torch.no_grad():
        torch.testing.assert_close(again(x[:8]), result.model(x[:8]))
