"""`vca-patch convert --budget`: plan, convert, calibrate, measure and save in one command, and its one-line
refusals (--budget with --plan or another --to, VCA where it cannot pay, options that go with --budget only)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from PIL import Image
from typer.testing import CliRunner

import vca_patch
from tests.integration.attention_cost import quadratic_softmax
from tests.support.paths import RECIPES
from vca_patch.cli import app
from vca_patch.planner.images import image_files, load_images

MODEL = "test_vit"  # timm's 6-block test ViT, width 64, patch 16
RES = 128  # 8x8 patches + CLS
runner = CliRunner()


def photos(folder, count: int, seed: int) -> None:
    """`count` random RGB images of another size than RES (the loader resizes and crops them)."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        Image.fromarray(rng.integers(0, 255, (140, 150, 3), dtype=np.uint8)).save(folder / f"{i}.png")


@pytest.fixture
def steady_timing(monkeypatch):
    with quadratic_softmax(monkeypatch):  # softmax attention costs what a large model's does: merging pays
        yield


def image_folders(tmp_path) -> None:
    """calibration/ and evaluation/ (2 images each) and a recipe's train/photos/ (5 images), none shared."""
    for name, count, seed in (("calibration", 2, 0), ("evaluation", 2, 1), ("train/photos", 5, 2)):
        photos(tmp_path / name, count, seed=seed)


def one_error_line(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), output
    return lines[0]


def test_convert_budget_saves_a_checkpoint_that_reloads_with_the_measured_outputs(tmp_path, steady_timing):
    image_folders(tmp_path)
    out = tmp_path / "fast"
    result = runner.invoke(app, [
        "convert", MODEL, "--no-pretrained", "--resolution", str(RES), "--budget", "0.9", "--calibration-data",
        str(tmp_path / "calibration"), "--eval-data", str(tmp_path / "evaluation"), "--contrast-tokens", "0",
        "--merge-fractions", "0.5", "--mano-windows", "none", "--repeats", "3", "--min-time", "0",
        "--recipe", small_recipe(tmp_path, tmp_path / "train"), "-o", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"Measured at {RES} px on 2 images of --eval-data {tmp_path / 'evaluation'}" in text
    recovered = f"recovered with {tmp_path / 'recipe.yaml'}: 2 steps on 4 images of {tmp_path / 'train'}"
    assert recovered in text and "calibration images" in text  # a merge plan recovers too, kept only if closer
    saved = json.loads((out / "config.json").read_text())
    speedup = saved["metadata"]["speedup"]
    assert speedup["plan"] in text and f"{speedup['latency_ratio']:.2f}x the original's latency" in text
    assert saved["config"]["target"] == "merge" and any(saved["config"]["schedule"])  # merging alone: no VCA tried
    assert not saved["config"]["vca_layers"] and speedup["plan"].startswith("merge ")
    assert speedup["recovery"].startswith(recovered)

    torch.manual_seed(0)  # the CLI's --seed 0 random weights, rebuilt
    original = timm.create_model(MODEL, pretrained=False, img_size=RES).eval()
    reloaded = vca_patch.from_pretrained(out)
    norm = {key: original.pretrained_cfg[key] for key in ("mean", "std")}  # the CLI normalises as the model's
    images = load_images(image_files(tmp_path / "evaluation"), RES, **norm)  # the CLI's held-out images
    with torch.no_grad():
        reference, converted = original.forward_features(images), reloaded.forward_features(images)
    cls = F.cosine_similarity(reference[:, 0].double(), converted[:, 0].double(), dim=-1).mean()
    patch = F.cosine_similarity(reference[:, 1:].double(), converted[:, 1:].double(), dim=-1).mean()
    assert float(cls) == pytest.approx(speedup["cls_cosine"], abs=1e-6)  # the saved model is the one measured
    assert float(patch) == pytest.approx(speedup["patch_token_cosine"], abs=1e-6)
    assert not torch.allclose(reference, converted)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--budget", "0.6", "--plan", "plan.json"], "--budget plans the conversion itself; --plan does not apply"),
        (["--budget", "0.6", "--to", "mano"], "--to mano does not apply to it: drop --to"),
        (["--budget", "0.6"], "--budget needs --calibration-data DIR"),
        (["--budget", "0.6", "--grow-tokens", "0.4", "--calibration-data", "{images}"], "--grow-tokens does not apply"),
        (["--budget", "0.6", "--softmax", "separate", "--calibration-data", "{images}"], "--softmax does not apply"),
        (["--budget", "0", "--calibration-data", "{images}"], "--budget must be a positive latency ratio"),
        (["--eval-data", "{images}"], "--eval-data goes with --budget"),
        (
            ["--budget", "0.6", "--calibration-data", "{images}", "--eval-data", "{images}/none"],
            "--eval-data {images}/none is not a folder",
        ),
        (
            ["--budget", "0.6", "--calibration-data", "{images}", "--eval-data", "{images}"],
            "--eval-data {images} shares 2 images with --calibration-data",
        ),
        (["--min-time", "1"], "--min-time goes with --budget"),
    ],
)
def test_options_that_cannot_go_with_budget_are_refused_in_one_line(tmp_path, extra, expected):
    photos(tmp_path / "images", 2, seed=0)
    extra = [value.replace("{images}", str(tmp_path / "images")) for value in extra]
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", "vit_tiny_patch16_224", "--no-pretrained", *extra, "-o", str(out)])
    expected = expected.replace("{images}", str(tmp_path / "images"))
    assert result.exit_code == 2 and expected in " ".join(one_error_line(result.output).split())
    assert not out.exists()


def test_vca_where_it_cannot_pay_is_refused_in_one_line_naming_what_pays(tmp_path):
    photos(tmp_path / "images", 2, seed=0)
    out = tmp_path / "out"
    result = runner.invoke(app, [
        "convert", MODEL, "--no-pretrained", "--to", "vca", "--budget", "0.6", "--resolution", "224",
        "--calibration-data", str(tmp_path / "images"), "-o", str(out),
    ])  # fmt: skip
    line = one_error_line(result.output)
    assert result.exit_code == 2 and "VCA cannot pay at 224 px: 197 tokens" in line
    assert "token merging pays here (drop --to vca and --budget plans it), or convert at a larger --resolution" in line
    assert not out.exists()


def test_plain_vca_conversion_where_it_cannot_pay_says_so_and_converts(tmp_path):
    out = tmp_path / "out"
    result = runner.invoke(app, ["convert", MODEL, "--no-pretrained", "--img-size", "64", "-o",
                                 str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "note: 17 tokens: VCA is slower than softmax attention here (it pays from ~250); token merging pays" in text
    assert (out / "model.safetensors").is_file()


def test_a_budget_no_plan_meets_is_refused_in_one_line_and_nothing_is_written(tmp_path, steady_timing):
    photos(tmp_path / "images", 3, seed=0)
    out = tmp_path / "out"
    result = runner.invoke(app, [
        "convert", MODEL, "--no-pretrained", "--resolution", str(RES), "--budget", "0.01", "--calibration-data",
        str(tmp_path / "images"), "--contrast-tokens", "0", "--merge-fractions", "0.5", "--mano-windows", "none",
        "--repeats", "3", "--min-time", "0", "-o", str(out),
    ])  # fmt: skip
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and result.output.strip().splitlines()[-1] == errors[0]
    assert "no plan meets the latency budget 0.01x" in errors[0] and "merge" in errors[0]
    assert not out.exists()


def small_recipe(tmp_path, photos_folder, stage: dict | None = None, **data) -> str:
    """The DINOv2 recovery recipe, 2 steps of batch 2 on `photos_folder`, for a model with a head (no cls_weight:
    distill compares logits), its data and stage updated by `data` and `stage`."""
    import yaml

    spec = yaml.safe_load((RECIPES / "dinov2_small.yaml").read_text())
    spec["data"] = {key: value for key, value in spec["data"].items() if key != "img_size"} | {
        "path": str(photos_folder), "mixup": 0.0, "cutmix": 0.0, **data}  # fmt: skip
    spec["train"] |= {"batch_size": 2, "log_every": 1}
    spec["stages"][0] = {k: v for k, v in spec["stages"][0].items() if k != "cls_weight"} | {
        "steps": 2, "warmup_steps": 0, **(stage or {})}  # fmt: skip
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


VCA_RES = 256  # 257 tokens: where VCA may pay


def test_convert_budget_with_a_recipe_recovers_a_plan_with_vca_blocks(tmp_path, steady_timing):
    image_folders(tmp_path)
    out = tmp_path / "fast"
    result = runner.invoke(app, [
        "convert", MODEL, "--no-pretrained", "--resolution", str(VCA_RES), "--budget", "0.95", "--to", "vca",
        "--contrast-tokens", "4", "--calibration-data", str(tmp_path / "calibration"), "--eval-data",
        str(tmp_path / "evaluation"), "--repeats", "3", "--min-time", "0",
        "--recipe", small_recipe(tmp_path, tmp_path / "train"), "-o", str(out),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    line = f"recovered with {tmp_path / 'recipe.yaml'}: 2 steps on 4 images of {tmp_path / 'train'}"
    assert line in text  # class folders without splits: 4 in 5 images train
    saved = json.loads((out / "config.json").read_text())
    assert saved["config"]["vca_layers"] and saved["metadata"]["speedup"]["recovery"].startswith(line)


def test_the_recovery_hook_trains_the_new_parameters_and_leaves_the_rest(tmp_path):
    from types import SimpleNamespace

    from vca_patch.cli.convert_budget import recovery_hook
    from vca_patch.recovery import calibrate
    from vca_patch.surgery import patch_model
    from vca_patch.targets.vca.config import VCAConfig

    photos(tmp_path / "train" / "photos", 5, seed=2)
    torch.manual_seed(0)
    original = timm.create_model(MODEL, pretrained=False, img_size=VCA_RES).eval()
    model = timm.create_model(MODEL, pretrained=False, img_size=VCA_RES).eval()
    model.load_state_dict(original.state_dict())
    patch_model(model, VCAConfig(contrast_tokens=4))
    calibrate(model, [torch.randn(2, 3, VCA_RES, VCA_RES)])
    before = {name: value.clone() for name, value in model.state_dict().items()}
    args = SimpleNamespace(recipe=Path(small_recipe(tmp_path, tmp_path / "train")))
    line = recovery_hook(args, model, VCA_RES)(model, original)
    assert line.endswith(f"2 steps on 4 images of {tmp_path / 'train'}")
    after = model.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(".attn." in name for name in changed), sorted(changed)  # rest_lr 0: only attention
    assert not model.training


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"img_size": 224}, f"trains at data.img_size 224, the model runs at {VCA_RES} px"),
        ({"stage": {"cls_weight": 0.5}}, "this model has a classifier head, so distill compares its logits"),
    ],
)
def test_a_recipe_that_cannot_recover_this_model_is_refused_before_the_planning(tmp_path, change, expected):
    photos(tmp_path / "calibration", 2, seed=0)
    photos(tmp_path / "train" / "photos", 5, seed=2)
    recipe = small_recipe(tmp_path, tmp_path / "train", **change)
    out = tmp_path / "out"
    result = runner.invoke(app, [
        "convert", MODEL, "--no-pretrained", "--resolution", str(VCA_RES), "--budget", "0.6", "--calibration-data",
        str(tmp_path / "calibration"), "--recipe", recipe, "-o", str(out),
    ])  # fmt: skip
    line = " ".join(one_error_line(result.output).split())
    assert result.exit_code == 2 and expected in line
    assert "Planning" not in result.output and not out.exists()
