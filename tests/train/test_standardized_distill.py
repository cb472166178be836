"""Head-less distillation in standardised feature space: the running statistics and the loss they give."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.recovery import head_less_pair
from vca_patch.train import recipe_from_dict, run_recipe
from vca_patch.train.objective import RecoveryObjective, RunningStandardizer, distill_loss
from vca_patch.train.recipe import RecipeError, StageSpec


def _tokens(batch: int, seed: int) -> torch.Tensor:
    """[batch, 5, 3] tokens whose channels have very different means and spreads, as a ViT's final tokens do."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 5, 3, generator=g) * torch.tensor([0.1, 1.0, 5.0]) + torch.tensor([40.0, -2.0, 0.5])


def test_running_statistics_match_numpy_over_all_batches_seen():
    standardizer = RunningStandardizer()
    batches = [_tokens(4, 0), _tokens(1, 1), _tokens(7, 2)]
    for batch in batches:
        standardizer.update(batch)
    pooled = torch.cat(batches).double().numpy()  # an independent float64 reference: numpy over the concatenation
    for group, values in enumerate((pooled[:, 0], pooled[:, 1:].reshape(-1, 3))):
        np.testing.assert_allclose(standardizer.mean[group].numpy(), values.mean(0), rtol=1e-12, atol=1e-12)
        std = np.sqrt(standardizer.m2[group].numpy() / (standardizer.count[group].item() - 1))
        np.testing.assert_allclose(std, values.std(0, ddof=1), rtol=1e-10)
    x = _tokens(2, 3)
    expected = np.empty(x.shape)
    for group, (mean, std) in enumerate(
        [(v.mean(0), v.std(0, ddof=1)) for v in (pooled[:, 0], pooled[:, 1:].reshape(-1, 3))]
    ):
        tokens = slice(0, 1) if group == 0 else slice(1, None)
        expected[:, tokens] = (x[:, tokens].double().numpy() - mean) / std
    np.testing.assert_allclose(standardizer(x).numpy(), expected, rtol=1e-6, atol=1e-6)


def test_standardizer_refuses_what_it_cannot_standardise():
    with pytest.raises(RuntimeError, match="update it"):
        RunningStandardizer()(_tokens(2, 0))
    with pytest.raises(ValueError, match="tokens >= 2"):
        RunningStandardizer().update(torch.zeros(2, 1, 3))


class _Tokens(torch.nn.Module):
    """A head-less stand-in: `forward_features` gives [B, 5, 3] tokens, a fixed affine map of its input."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor) -> None:
        super().__init__()
        self.scale, self.shift = torch.nn.Parameter(scale), torch.nn.Parameter(shift)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_features(x)


def test_standardized_loss_weighs_every_channel_where_the_raw_cosine_sees_the_large_one():
    teacher = _Tokens(torch.ones(3), torch.zeros(3))
    x = _tokens(6, 4)
    # the student is off by 10% of its spread in the small channels only: the large shared channel hides it
    student = _Tokens(torch.ones(3), x.std(dim=(0, 1)) * torch.tensor([1.0, 0.1, 0.1]))
    stage = StageSpec(name="d", kind="distill", steps=1)
    raw = distill_loss(student, teacher, x, None, stage)
    standardizer = RunningStandardizer()
    standardized = distill_loss(student, teacher, x, None, stage, standardizer)
    s, t = student.forward_features(x).double(), x.double()
    z_s, z_t = standardizer(s.float()).double(), standardizer(t.float()).double()
    assert standardized.item() == pytest.approx((1 - F.cosine_similarity(z_s, z_t, dim=-1)).mean().item(), rel=1e-5)
    assert raw.item() == pytest.approx((1 - F.cosine_similarity(s, t, dim=-1)).mean().item(), rel=1e-3)  # float32
    assert standardized > 10 * raw  # the offsets cost far more once every channel counts alike


def test_stage_field_validates_and_the_objective_uses_it(tmp_path):
    stage = {"name": "d", "kind": "distill", "steps": 1}
    with pytest.raises(RecipeError, match="feature_space: expected one of 'raw', 'standardized'"):
        recipe_from_dict({"name": "r", "stages": [{**stage, "feature_space": "whitened"}]})
    recipe = recipe_from_dict({"name": "r", "stages": [{**stage, "feature_space": "standardized"}]})
    assert recipe.stages[0].feature_space == "standardized"
    assert recipe_from_dict(recipe.to_dict()).stages[0].feature_space == "standardized"  # round-trips
    objective = RecoveryObjective(_Tokens(torch.ones(3), torch.zeros(3)), _Tokens(torch.ones(3), torch.zeros(3)),
                                  recipe.stages[0])  # fmt: skip
    assert isinstance(objective.standardizer, RunningStandardizer)
    assert RecoveryObjective(objective.student, objective.teacher, StageSpec("d", "distill")).standardizer is None


def test_head_less_standardized_distill_trains(tmp_path):
    teacher, model, train = head_less_pair()
    spec = recipe_from_dict({
        "name": "headless", "data": {"kind": "imagefolder", "path": "unused"},
        "train": {"batch_size": 8, "eval_every": 2, "checkpoint_every": 100, "eval_images": 8},
        "stages": [{"name": "distill", "kind": "distill", "steps": 8, "lr": 3e-3, "feature_space": "standardized"}],
    })  # fmt: skip
    run_recipe(model, teacher, spec, tmp_path, train_set=train)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    losses = [record["loss"] for record in metrics["evaluations"]]  # mean loss of every 2 steps
    assert metrics["status"] == "completed" and len(losses) == 4 and losses[-1] < losses[0]
