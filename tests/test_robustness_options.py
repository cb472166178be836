"""Options that used to mislead: contrast tokens larger than the patch grid, ImageFolder trees in any split layout
(and the data kind inferred from the path), YAML numbers in exponent notation."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from PIL import Image
from typer.testing import CliRunner

import vca_patch
from tests.models import tiny
from vca_patch import patch_model
from vca_patch.cli import app
from vca_patch.data import DatasetError, build_dataset, infer_kind
from vca_patch.train import RecipeError, load_recipe
from vca_patch.train.recipe import DataSpec

runner = CliRunner()


def _images(folder: Path, classes: int, per_class: int, seed: int = 0) -> list[Path]:
    """`folder/<class>/<i>.png` of random 8×8 RGB images (each distinct); the paths, sorted like ImageFolder."""
    g = torch.Generator().manual_seed(seed)
    paths = []
    for c in range(classes):
        (folder / f"class_{c}").mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            pixels = torch.randint(0, 256, (8, 8, 3), generator=g, dtype=torch.uint8).numpy()
            path = folder / f"class_{c}" / f"{i}.png"
            Image.fromarray(pixels).save(path)
            paths.append(path)
    return sorted(paths)


def _spec(root: Path, **kwargs) -> DataSpec:
    return DataSpec(kind="imagefolder", path=str(root), eval_limit=None, **kwargs)


# --- contrast tokens vs the patch grid ------------------------------------------------------------------------


def _warning(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("warning:") and "contrast tokens" in line]


def test_inspect_warns_when_the_contrast_tokens_exceed_the_grid():
    result = runner.invoke(app, ["inspect", "deit_tiny_patch16_224", "--img-size", "64"])  # 4×4 grid, n = 49
    assert result.exit_code == 0, result.output
    (line,) = _warning(result.output)
    assert "49 (7×7) contrast tokens do not fit deit_tiny_patch16_224's 4×4 patch grid" in line
    assert "--contrast-tokens 16 (4×4) or fewer" in line
    fits = runner.invoke(app, ["inspect", "deit_tiny_patch16_224", "--img-size", "64", "--contrast-tokens", "16"])
    assert fits.exit_code == 0 and not _warning(fits.output), fits.output


def test_convert_warns_with_the_grid_and_still_converts(tmp_path):
    out = tmp_path / "out"
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32", "--contrast-tokens", "9"]
    result = runner.invoke(app, [*args, "--device", "cpu", "--probe-size", "1", "-o", str(out)])
    assert result.exit_code == 0, result.output
    (line,) = _warning(result.output)
    assert "2×2 patch grid" in line and "--contrast-tokens 4 (2×2)" in line
    assert (out / "model.safetensors").is_file()


# --- ImageFolder layouts --------------------------------------------------------------------------------------


def test_split_names_are_aliased(tmp_path):
    _images(tmp_path / "training", 2, 3)
    _images(tmp_path / "validation", 2, 2, seed=1)
    spec = _spec(tmp_path)  # train_split "train", eval_split "test"
    assert len(build_dataset(spec, "train", training=True, img_size=16)) == 6
    val = build_dataset(spec, "test", training=False, img_size=16)
    assert len(val) == 4 and val[0][0].shape == (3, 16, 16)


def test_flat_folder_holds_out_every_fifth_image_disjointly(tmp_path):
    paths = _images(tmp_path, 3, 5)  # 15 images, sorted by class then name
    spec = _spec(tmp_path)
    train = build_dataset(spec, "train", training=True, img_size=16)
    held_out = build_dataset(spec, "test", training=False, img_size=16)
    train_paths = {train.dataset.samples[i][0] for i in train.indices}
    held_paths = {held_out.dataset.samples[i][0] for i in held_out.indices}
    assert held_paths == {str(p) for p in paths[::5]} and len(train_paths) == 12
    assert not train_paths & held_paths and len(train_paths | held_paths) == 15
    assert {held_out[i][1] for i in range(len(held_out))} == {0, 1, 2}  # every class is held out


def test_a_missing_split_names_the_sub_folders(tmp_path):
    _images(tmp_path / "train", 2, 1)
    _images(tmp_path / "holdout", 2, 1)
    with pytest.raises(DatasetError, match=r"no split 'test' \(its sub-folders: holdout, train\).*--split"):
        build_dataset(_spec(tmp_path), "test", training=False, img_size=16)
    assert len(build_dataset(_spec(tmp_path, eval_split="holdout"), "holdout", training=False, img_size=16)) == 2


def test_data_kind_is_inferred_from_the_path(tmp_path):
    (tmp_path / "idx").mkdir()
    (tmp_path / "idx" / "t10k-images-idx3-ubyte.gz").write_bytes(b"")
    _images(tmp_path / "imgs", 1, 1)
    assert infer_kind(None) == "fashion_mnist"
    assert infer_kind(tmp_path / "idx") == "fashion_mnist"
    assert infer_kind(tmp_path / "imgs") == "imagefolder"
    assert infer_kind("ylecun/mnist") == "hf"
    with pytest.raises(DatasetError, match="does not exist"):
        infer_kind(tmp_path / "missing")


def test_fidelity_measures_a_flat_image_folder_without_a_data_kind(tmp_path):
    model, args = tiny(img_size=32, depth=1)
    patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    ckpt = vca_patch.save_pretrained(model, tmp_path / "ckpt", model_args=args)
    _images(tmp_path / "flat", 2, 5)
    result = runner.invoke(app, ["fidelity", str(ckpt), "--data", str(tmp_path / "flat"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert any(line.split()[:2] == ["│", "images"] and line.split()[3] == "2" for line in result.output.splitlines())


def test_convert_calibrates_on_images_it_does_not_measure_on(tmp_path, monkeypatch):
    """The calibration set and the held-out set are disjoint (both used to be the eval split)."""
    from vca_patch.cli.fidelity import calibrate_for_convert

    fidelity_module = importlib.import_module("vca_patch.fidelity")  # the module (the package re-exports a function)
    recovery = importlib.import_module("vca_patch.recovery")
    seen: dict[str, set[bytes]] = {}

    def record(name):
        def run(*args):
            seen[name] = {x.numpy().tobytes() for images, _ in args[-1] for x in images}
            return SimpleNamespace(summary=dict)

        return run

    monkeypatch.setattr(recovery, "calibrate", record("calibrated"))
    monkeypatch.setattr(fidelity_module, "fidelity", record("measured"))
    model, _ = tiny(img_size=32, depth=1)
    patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    _images(tmp_path, 2, 5)
    _, where = calibrate_for_convert(model, tmp_path, None, 256, None)
    assert len(seen["calibrated"]) == 8 and len(seen["measured"]) == 2 and not seen["calibrated"] & seen["measured"]
    assert where.startswith("2 held-out images")


# --- YAML numbers ---------------------------------------------------------------------------------------------


def _recipe(tmp_path: Path, stage: str) -> Path:
    path = tmp_path / "r.yaml"
    path.write_text(f"name: r\nstages:\n  - {{name: a, kind: distill, {stage}}}\n")
    return path


def test_exponent_numbers_are_numbers(tmp_path):
    stage = load_recipe(_recipe(tmp_path, "steps: 1e2, lr: 3e-3, lambda_lr: -0.0e0, weight_decay: 5E-2")).stages[0]
    assert (stage.steps, stage.lr, stage.weight_decay) == (100, 0.003, 0.05)
    assert isinstance(stage.steps, int) and isinstance(stage.lr, float)


@pytest.mark.parametrize(
    ("stage", "message"),
    [
        ("steps: 2, lr: fast", "r.yaml.stages[0].lr: expected a number, got 'fast'"),
        ("steps: 2.5e0", "r.yaml.stages[0].steps: expected an integer, got '2.5e0'"),
        ("steps: 2.0", "r.yaml.stages[0].steps: expected an integer, got 2.0"),
        ("steps: 2, lr: '3'", "r.yaml.stages[0].lr: expected a number, got '3'"),
    ],
)
def test_values_that_are_not_numbers_name_their_key(tmp_path, stage, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(_recipe(tmp_path, stage))
    assert message in str(info.value)
