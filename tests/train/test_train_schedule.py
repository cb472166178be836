"""A stage's optimizer groups and timm's warmup-cosine schedule, against the closed form."""

from __future__ import annotations

import io
import math

import pytest
import torch

import vca_patch
from tests.support.recovery import tiny_vit
from vca_patch.train.optim import StageScheduler, stage_optimizer
from vca_patch.train.recipe import StageSpec

STAGE = StageSpec(
    name="d", kind="distill", steps=12, lr=1e-3, carried_lr=2e-4, rest_lr=5e-5,
    warmup_steps=3, min_lr_ratio=0.1, weight_decay=0.05, options={"lambda_lr": 1e-4},
)  # fmt: skip


def reference_lr(base: float, t: int, stage: StageSpec) -> float:
    """Linear warmup from base/W to base over W updates, then cosine to min_lr_ratio × base."""
    W, S, r = stage.warmup_steps, stage.steps, stage.min_lr_ratio
    if t < W:
        return base / W + t * (base - base / W) / W
    progress = min(1.0, (t - W) / (S - W))
    return r * base + 0.5 * (base - r * base) * (1 + math.cos(math.pi * progress))


@pytest.fixture
def model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = tiny_vit()
    vca_patch.patch_model(m, vca_patch.VCAConfig(contrast_tokens=4))
    return m


def test_every_group_follows_its_own_warmup_cosine_schedule(model):
    optimizer = stage_optimizer(model, STAGE)
    base = {"new": STAGE.lr, "lambda": STAGE.options["lambda_lr"], "carried": STAGE.carried_lr, "rest": STAGE.rest_lr}
    assert [g["group"] for g in optimizer.param_groups] == ["new", "lambda", "carried", "rest"]
    scheduler = StageScheduler(optimizer, STAGE)
    for t in range(STAGE.steps + 2):
        for group in optimizer.param_groups:
            assert group["lr"] == pytest.approx(reference_lr(base[group["group"]], t, STAGE), rel=1e-12), (t, group)
        optimizer.step()
        scheduler.step()
    assert {g["group"]: g["weight_decay"] for g in optimizer.param_groups} == {
        "new": 0.0, "lambda": 0.0, "carried": 0.05, "rest": 0.05,
    }  # fmt: skip


def test_state_is_plain_numbers_and_restores_the_learning_rates(model):
    optimizer = stage_optimizer(model, STAGE)
    scheduler = StageScheduler(optimizer, STAGE)
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh_optimizer = stage_optimizer(model, STAGE)
    fresh = StageScheduler(fresh_optimizer, STAGE)
    fresh.load_state_dict(state)
    assert [g["lr"] for g in fresh_optimizer.param_groups] == [g["lr"] for g in optimizer.param_groups]
    optimizer.step()
    scheduler.step()
    fresh_optimizer.step()
    fresh.step()
    assert fresh.get_last_lr() == scheduler.get_last_lr()


def test_transfer_freezes_everything_outside_attention(model):
    optimizer = stage_optimizer(model, StageSpec(name="t", kind="attention_transfer", steps=2, rest_lr=1e-3))
    assert "rest" not in [g["group"] for g in optimizer.param_groups]
    assert not model.head.weight.requires_grad and not model.patch_embed.proj.weight.requires_grad
    with pytest.raises(ValueError, match="trains nothing"):
        stage_optimizer(model, StageSpec(name="z", kind="distill", steps=2, lr=0.0, options={"lambda_lr": 0.0}))


def test_norms_and_biases_train_only_those_bitfit():
    torch.manual_seed(0)
    model = tiny_vit()
    vca_patch.patch_model(model, vca_patch.MergeConfig(r=2))
    stage = StageSpec(name="b", kind="distill", steps=2, lr=1e-4, carried_lr=1e-4, rest_lr=1e-4,
                      train_only="norms_and_biases")  # fmt: skip
    optimizer = stage_optimizer(model, stage)
    trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
    names = {name for name, p in model.named_parameters() if id(p) in trained}
    norms = {f"{path}.{n}" for path, m in model.named_modules() if isinstance(m, torch.nn.LayerNorm)
             for n, _ in m.named_parameters(recurse=False)}  # fmt: skip
    biases = {name for name, _ in model.named_parameters() if name.endswith(".bias")}
    assert names == norms | biases and "blocks.0.attn.qkv.bias" in names and "norm.weight" in names
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {name for name, _ in model.named_parameters()} - names
    assert {"blocks.0.attn.qkv.weight", "pos_embed", "cls_token", "head.weight"} <= frozen
    everything = stage_optimizer(model, StageSpec(name="a", kind="distill", steps=2, lr=1e-4, carried_lr=1e-4,
                                                  rest_lr=1e-4))  # fmt: skip
    assert sum(len(g["params"]) for g in everything.param_groups) == len(list(model.parameters()))
    assert all(p.requires_grad for p in model.parameters())  # "all" unfreezes what BitFit froze


def test_train_only_is_checked_when_the_recipe_loads(tmp_path):
    from vca_patch.train.recipe import RecipeError, load_recipe

    path = tmp_path / "r.yaml"
    path.write_text("name: x\nstages:\n  - {name: d, kind: distill, steps: 1, train_only: biases}\n")
    with pytest.raises(RecipeError, match=r"train_only.*one of 'all', 'norms_and_biases'"):
        load_recipe(path)
