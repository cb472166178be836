"""A head-less distill stage's `cls_weight`: token 0's share of the feature-cosine loss."""

from __future__ import annotations

import copy

import pytest
import torch

import vca_patch
from tests.support.recovery import TINY_ARGS, tiny_vit
from vca_patch.train import recipe_from_dict, run_recipe
from vca_patch.train.objective import distill_loss
from vca_patch.train.recipe import RecipeError, StageSpec


class _Tokens(torch.nn.Module):
    """A head-less stand-in: `forward_features` gives its input [B, T, C] plus a fixed per-token offset."""

    def __init__(self, offset: torch.Tensor) -> None:
        super().__init__()
        self.offset = torch.nn.Parameter(offset)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x)


def _reference(student: torch.Tensor, teacher: torch.Tensor, weight: float | None) -> float:
    """The loss in float64, token by token: weight × (1 - cos of token 0) + (1 - weight) × mean over the others."""
    s, t = student.double(), teacher.double()
    cos = (s * t).sum(-1) / (s.norm(dim=-1) * t.norm(dim=-1))  # [B, T]
    if weight is None:
        return float((1 - cos).mean())
    return float(weight * (1 - cos[:, 0]).mean() + (1 - weight) * (1 - cos[:, 1:]).mean())


@pytest.mark.parametrize("weight", [None, 0.0, 0.3, 0.5, 1.0])
def test_loss_matches_a_float64_reference(weight):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, 8, generator=g)
    student = _Tokens(0.7 * torch.randn(6, 8, generator=g))
    stage = StageSpec(name="d", kind="distill", steps=1, cls_weight=weight)
    loss = distill_loss(student, _Tokens(torch.zeros(6, 8)), x, None, stage)
    expected = _reference(student.forward_features(x).detach(), x, weight)
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert loss.item() != pytest.approx(1.1 * expected, rel=1e-5)  # a 10% error would fail


def test_weight_moves_the_loss_between_token_0_and_the_rest():
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(1))
    off_cls, off_patch = torch.zeros(5, 4), torch.zeros(5, 4)
    off_cls[0], off_patch[1:] = 1.0, 1.0
    teacher = _Tokens(torch.zeros(5, 4))

    def loss(offset: torch.Tensor, weight: float | None) -> float:
        stage = StageSpec(name="d", kind="distill", steps=1, cls_weight=weight)
        return distill_loss(_Tokens(offset), teacher, x, None, stage).item()

    assert loss(off_patch, 1.0) == pytest.approx(0.0, abs=1e-6)  # only token 0 counts
    assert loss(off_cls, 0.0) == pytest.approx(0.0, abs=1e-6)  # only the others count
    assert loss(off_cls, None) > 0.01
    assert loss(off_cls, 0.5) == pytest.approx(2.5 * loss(off_cls, None), rel=1e-5)  # token 0: 1/2, not 1/5


def test_recipe_validates_and_round_trips_cls_weight():
    stage = {"name": "distill", "kind": "distill", "steps": 2}
    for bad in (-0.1, 1.5):
        with pytest.raises(RecipeError, match=r"stages\[0\].cls_weight must be in \[0, 1\]"):
            recipe_from_dict({"name": "r", "stages": [{**stage, "cls_weight": bad}]})
    with pytest.raises(RecipeError, match="cls_weight: expected"):
        recipe_from_dict({"name": "r", "stages": [{**stage, "cls_weight": "half"}]})
    recipe = recipe_from_dict({"name": "r", "stages": [{**stage, "cls_weight": 0.5}]})
    assert recipe.stages[0].cls_weight == 0.5
    assert recipe_from_dict(recipe.to_dict()).stages[0].cls_weight == 0.5
    assert recipe_from_dict({"name": "r", "stages": [stage]}).stages[0].cls_weight is None


@pytest.mark.parametrize("options", [{"cls_weight": 0.5}, {"feature_space": "standardized"}])
def test_head_less_options_on_a_model_with_a_head_are_refused(options):
    model = _Headed()
    stage = StageSpec(name="d", kind="distill", steps=1, **options)
    with pytest.raises(ValueError, match="has a classifier head, so distill compares its logits"):
        distill_loss(model, _Headed(), torch.randn(2, 5, 4), None, stage)
    assert distill_loss(model, _Headed(), torch.randn(2, 5, 4), None, StageSpec("d", "distill", 1)).item() >= 0


class _Headed(_Tokens):
    """`_Tokens` with a timm-style classifier head on its mean token."""

    num_classes = 3

    def __init__(self) -> None:
        super().__init__(torch.zeros(5, 4))
        self.head = torch.nn.Linear(4, 3)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features.mean(1))


def test_run_recipe_refuses_cls_weight_for_a_model_with_a_head_before_changing_it(tmp_path):
    torch.manual_seed(0)
    teacher = tiny_vit()
    model = copy.deepcopy(teacher)
    vca_patch.patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    before = copy.deepcopy(model.state_dict())
    size, chans = TINY_ARGS["img_size"], TINY_ARGS.get("in_chans", 3)
    train = torch.utils.data.TensorDataset(torch.randn(8, chans, size, size), torch.zeros(8, dtype=torch.long))
    spec = recipe_from_dict({
        "name": "headed", "data": {"kind": "imagefolder", "path": "unused"},
        "train": {"batch_size": 4, "eval_images": 4},
        "stages": [{"name": "distill", "kind": "distill", "steps": 2, "cls_weight": 0.5}],
    })  # fmt: skip
    with pytest.raises(ValueError, match="stage 'distill': feature_space and cls_weight"):
        run_recipe(model, teacher, spec, tmp_path / "out", train_set=train, num_classes=10)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not (tmp_path / "out" / "checkpoints").exists()
