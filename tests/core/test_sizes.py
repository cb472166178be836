"""Sizes checked from shapes alone, before any work (vca_patch.core.sizes and where the commands use it)."""

from __future__ import annotations

import json

import pytest
import timm

from vca_patch.core import sizes
from vca_patch.core.sizes import (
    SizeError,
    activation_bytes,
    check_contrast_tokens,
    check_image_size,
    check_memory,
    config_size_problem,
)

# deit_tiny_patch16_224 at 224 px, batch 4, float32, worked out by hand (not with the code under test):
# tokens 1 + 14·14 = 197, width 192, depth 12, 3 heads
#   blocks:  4 tensors × 197 × 192 × 12 = 1,815,552 values
#   softmax: 3 heads × 197² = 116,427 values
#   (1,815,552 + 116,427) × 4 images × 4 bytes = 30,911,664 bytes
DEIT_TINY_224_BATCH_4 = 30_911_664


def test_the_activation_estimate_matches_a_hand_calculation():
    estimate = activation_bytes(197, 192, 12, 4, heads=3)
    assert estimate == pytest.approx(DEIT_TINY_224_BATCH_4, rel=0.01)  # an estimate 10% off fails here
    assert activation_bytes(197, 192, 12, 4) == 1_815_552 * 16  # attention that forms no N² matrix
    assert activation_bytes(197, 192, 12, 4, heads=3, dtype_bytes=2) == DEIT_TINY_224_BATCH_4 // 2


def test_the_commands_estimate_is_that_one(monkeypatch):
    """check_model_sizes refuses just below the hand-worked estimate and passes at it: the estimate the CLI uses
    is the one above, read from the built model's shapes."""
    from vca_patch.cli.common import check_model_sizes
    from vca_patch.targets.vca import VCAConfig

    model = timm.create_model("deit_tiny_patch16_224", pretrained=False)
    for available, refused in ((DEIT_TINY_224_BATCH_4 - 1, True), (DEIT_TINY_224_BATCH_4, False)):
        monkeypatch.setattr(sizes, "available_memory", lambda device="cpu", a=available: (a, "available memory"))
        if refused:
            with pytest.raises(SizeError, match=r"needs about 29\.5 MiB of activations, more than the 29\.5 MiB"):
                check_model_sizes(model, VCAConfig(), batch=4)
        else:
            check_model_sizes(model, VCAConfig(), batch=4)


def test_memory_is_read_from_psutil_or_proc_meminfo(tmp_path, monkeypatch):
    info = tmp_path / "meminfo"
    info.write_text("MemTotal:       1000 kB\nMemFree:         500 kB\nMemAvailable:    700 kB\n")
    assert sizes._meminfo_available(info) == 700 * 1024
    assert sizes._meminfo_available(tmp_path / "none") is None
    available, label = sizes.available_memory("cpu")
    assert available is None or available > 0
    assert label == "available memory"
    with pytest.raises(SizeError, match=r"needs about 2\.0 GiB of activations, more than the 1\.0 GiB"):
        check_memory(2 << 30, "this", available=1 << 30)
    check_memory(1 << 30, "this", available=1 << 30)


@pytest.mark.parametrize(
    ("size", "kwargs", "message"),
    [
        (8, {"patch": 16}, "at least one 16×16 patch"),
        (100, {"patch": 16}, "not a multiple of the patch size 16; use e.g. 96"),
        (448, {"patch": 16, "max_size": 224}, "more than the model's position table covers"),
        (100000, {}, "from 1 to 16384"),
        (0, {}, "from 1 to 16384"),
    ],
)
def test_image_sizes_out_of_bounds_are_refused(size, kwargs, message):
    with pytest.raises(SizeError, match=message):
        check_image_size(size, "--img-size", **kwargs)


def test_image_sizes_in_bounds_pass():
    check_image_size(224, "--img-size", patch=16, max_size=224)
    check_image_size(448, "--img-size", patch=16, max_size=224, dynamic=True)  # an interpolated position table


def test_contrast_tokens_fit_the_patch_grid():
    check_contrast_tokens(196, (14, 14))
    with pytest.raises(
        SizeError,
        match=r"contrast_tokens \(--contrast-tokens\) 197 is more than the 14×14 patch grid.s 196 patches; "
        r"use 196 \(14×14\) or fewer",
    ):
        check_contrast_tokens(197, (14, 14))
    with pytest.raises(SizeError, match=r"the 4×6 patch grid's 24 patches; use 16 \(4×4\)"):
        check_contrast_tokens(25, (4, 6))


def test_config_sizes_have_sane_bounds():
    assert config_size_problem("depth", 12) is None and config_size_problem("img_size", [224, 224]) is None
    assert config_size_problem("depth", 100000) == "expected an integer from 1 to 256"
    assert config_size_problem("img_size", [60000, 60000]) == "expected integers from 1 to 16384"
    assert config_size_problem("embed_dim", 16385) and config_size_problem("num_hidden_layers", 0)
    assert config_size_problem("qkv_bias", 10**9) is None  # not a size


def test_the_config_guards_refuse_sizes_before_building():
    from vca_patch.families.timm.guard import check_timm_model_args

    with pytest.raises(SizeError, match=r"model_args\.depth = 100000 is not allowed"):
        check_timm_model_args({"depth": 100000}, "config.json")
    check_timm_model_args({"depth": 12, "img_size": 224}, "config.json")
    pytest.importorskip("transformers")
    from vca_patch.families.transformers.guard import check_transformers_config

    with pytest.raises(SizeError, match=r"base\.config\.vision_config\.hidden_size"):
        check_transformers_config({"vision_config": {"hidden_size": 10**6}}, "config.json")


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("data", "train_limit", 0, "data.train_limit must be >= 1"),
        ("data", "eval_limit", -1, "data.eval_limit must be >= 1"),
        ("data", "img_size", 0, "data.img_size must be from 1 to 16384"),
        ("data", "img_size", 100000, "data.img_size must be from 1 to 16384"),
        ("data", "num_workers", -1, "data.num_workers must be >= 0"),
        ("train", "eval_images", 0, "train.eval_images must be >= 1"),
        ("stage", "warmup_steps", -1, r"stages\[0\]\.warmup_steps must be >= 0"),
        ("stage", "calibration_images", 0, r"stages\[0\]\.calibration_images must be >= 1"),
    ],
)
def test_recipe_sizes_that_make_no_sense_are_refused(section, key, value, message):
    from vca_patch.train.recipe import RecipeError, recipe_from_dict

    stage = {"name": "s", "kind": "distill", "steps": 10}
    data = {"name": "r", "stages": [stage], "data": {}, "train": {}}
    (stage if section == "stage" else data[section])[key] = value
    with pytest.raises(RecipeError, match=message):
        recipe_from_dict(data)
    (stage if section == "stage" else data[section])[key] = 1
    recipe_from_dict(data)


def _plan(path, config, model=None):
    body = {"format": "vca-patch-plan", "version": 1, "config": config.to_dict()}
    path.write_text(json.dumps(body | ({"model": model} if model else {})))
    return path


def test_plans_check_the_resolution_and_tokens_they_were_made_for(tmp_path):
    from vca_patch.planner import PlanError, check_plan_fits, load_plan
    from vca_patch.targets.merge import MergeConfig

    made = {"depth": 12, "dim": 192, "num_heads": 3, "resolution": 448, "tokens": 785, "patch_tokens": 784}
    at_448 = _plan(tmp_path / "448.json", MergeConfig(schedule=[8] * 4), made)
    config = load_plan(at_448)
    assert check_plan_fits(at_448, config, (448, 448), (28, 28)) is None
    with pytest.raises(PlanError, match="was made for 448 px, but the model takes 224×224 px; pass --img-size 448"):
        check_plan_fits(at_448, config, (224, 224), (14, 14))
    old = _plan(tmp_path / "old.json", MergeConfig(schedule=[8] * 4))  # an older plan: applied, with a warning
    assert "does not record the resolution" in check_plan_fits(old, load_plan(old), (224, 224), (14, 14))
    many = _plan(tmp_path / "many.json", MergeConfig(schedule=[100] * 12))
    with pytest.raises(PlanError, match="merges 1200 tokens in all; the model has 196 patches"):
        check_plan_fits(many, load_plan(many), (224, 224), (14, 14))
    vca = MergeConfig(schedule=[0, 8], vca_layers={0: 1_000_000})
    with pytest.raises(PlanError, match="pools 1000000 contrast tokens"):
        check_plan_fits(_plan(tmp_path / "n.json", vca), vca, (224, 224), (14, 14))
    with pytest.raises(PlanError, match="a VCA block pools 1000000 contrast tokens, more than its 784 patches"):
        load_plan(_plan(tmp_path / "n_recorded.json", vca, made))
