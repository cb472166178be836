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
from tests.support.models import tiny
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


def test_the_default_contrast_tokens_shrink_to_a_small_grid_with_a_note():
    result = runner.invoke(app, ["inspect", "deit_tiny_patch16_224", "--img-size", "64"])  # 4×4 grid, default n = 49
    assert result.exit_code == 0, result.output
    assert "note: the default 49 contrast tokens do not fit the 4×4 patch grid; using 16" in result.output
    assert "contrast_tokens=16" in result.output.replace(" ", "") and "contrast_tokens=49" not in result.output


def test_chosen_contrast_tokens_past_the_grid_are_refused_before_any_work(tmp_path):
    out = tmp_path / "out"
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32", "--contrast-tokens", "9"]
    result = runner.invoke(app, [*args, "--device", "cpu", "--probe-size", "1", "-o", str(out)])
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert "(--contrast-tokens) 9 is more than the 2×2 patch grid's 4 patches; use 4 (2×2) or fewer" in line
    assert not out.exists()
    fits = runner.invoke(app, ["inspect", "deit_tiny_patch16_224", "--img-size", "64", "--contrast-tokens", "16"])
    assert fits.exit_code == 0 and "note:" not in fits.output, fits.output


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

    fidelity_module = importlib.import_module("vca_patch.eval.fidelity")
    recovery = importlib.import_module("vca_patch.recovery")
    seen: dict[str, set[bytes]] = {}

    def record(name):
        def run(*args, **kwargs):
            seen[name] = {x.numpy().tobytes() for images, _ in args[-1] for x in images}
            return SimpleNamespace(summary=dict, grown={})

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


# --- --split / --eval-split on convert ------------------------------------------------------------------------


def test_convert_calibrates_on_the_named_split_and_measures_on_the_other(tmp_path, monkeypatch):
    from vca_patch.cli.fidelity import calibrate_for_convert

    fidelity_module = importlib.import_module("vca_patch.eval.fidelity")
    recovery = importlib.import_module("vca_patch.recovery")
    seen: dict[str, int] = {}

    def calibrate(net, loader, **options):
        seen.update(calibrated=len(loader.dataset))
        return SimpleNamespace(grown={})

    monkeypatch.setattr(recovery, "calibrate", calibrate)
    monkeypatch.setattr(
        fidelity_module, "fidelity", lambda a, b, loader: seen.update(measured=len(loader.dataset)) or SimpleNamespace(
            summary=dict)
    )  # fmt: skip
    model, _ = tiny(img_size=32, depth=1)
    patch_model(model, vca_patch.VCAConfig(contrast_tokens=4))
    _images(tmp_path / "calib", 2, 3)
    _images(tmp_path / "holdout", 2, 1, seed=1)
    _, where = calibrate_for_convert(model, tmp_path, None, 256, None, split="calib", eval_split="holdout")
    assert seen == {"calibrated": 6, "measured": 2} and where.startswith("2 held-out images")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--split", "calib"], "--split choose splits of --calibration-data; pass it too"),
        (["--probe-size", "0"], "--probe-size must be at least 1 image, got 0"),
        (["--calibration-images", "0"], "--calibration-images must be at least 1 image, got 0"),
        (["--to", "mano", "--eval-split", "val"], "--eval-split is for --to vca or --to merge, not --to mano"),
    ],
)
def test_convert_refuses_split_and_size_options_that_cannot_apply(tmp_path, extra, message):
    result = runner.invoke(app, ["convert", "deit_tiny_patch16_224", "--no-pretrained", "-o", str(tmp_path / "o"),
                                 *extra])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines()[-1] == f"error: {message}" or message in result.output
    assert not (tmp_path / "o").exists()


def test_convert_refuses_to_measure_calibration_on_its_own_images(tmp_path):
    _images(tmp_path / "data" / "train", 2, 2)
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32", "--contrast-tokens", "4",
            "--device", "cpu", "--probe-size", "1", "--calibration-data", str(tmp_path / "data"), "--split", "train",
            "--eval-split", "training", "-o", str(tmp_path / "o")]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error: --split train and --eval-split training are both") and "held-out split" in line
    assert not (tmp_path / "o").exists()


# --- Fashion-MNIST for an RGB model (timm's data config) ------------------------------------------------------

FASHION = Path("/usr/share/datasets/fashion-mnist")


@pytest.mark.skipif(not FASHION.is_dir(), reason="needs Debian's dataset-fashion-mnist")
def test_fashion_mnist_meets_an_rgb_model_at_its_size_and_normalisation():
    from vca_patch.data.fashion_mnist import load_fashion_mnist

    spec = DataSpec(kind="fashion_mnist", path=str(FASHION), eval_limit=3)
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    cfg = {"input_size": (3, 28, 28), "mean": mean, "std": std, "crop_pct": 1.0, "interpolation": "bilinear"}
    rgb = build_dataset(spec, "test", training=False, img_size=28, model_cfg=cfg)
    raw = load_fashion_mnist("test", FASHION, limit=3, normalize=False)  # [0, 1] grey, the reference
    assert len(rgb) == 3
    for (image, label), (grey, grey_label) in zip(rgb, raw, strict=True):
        assert image.shape == (3, 28, 28) and label == int(grey_label)
        pixels = image * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)  # undo the model's norm
        assert (pixels - grey).abs().max() < 1e-6  # each channel is the grey image
    big = build_dataset(spec, "test", training=False, img_size=56, model_cfg={**cfg, "input_size": (3, 56, 56)})
    assert big[0][0].shape == (3, 56, 56)
    one_channel = build_dataset(spec, "test", training=False, img_size=28, model_cfg={"input_size": (1, 28, 28)})
    assert one_channel[0][0].shape == (1, 28, 28)  # a model built for Fashion-MNIST gets it as before


# --- messages and cards that must be true ---------------------------------------------------------------------


def test_every_command_a_help_text_names_exists(monkeypatch, capsys):
    """`vca-patch X`, `python -m vca_patch X` and `accelerate launch -m vca_patch X` in any help name a command."""
    import re
    import runpy
    import sys

    import typer.main

    commands = set(typer.main.get_command(app).commands)
    named: set[str] = set()
    for name in [None, *commands]:
        result = runner.invoke(app, [*([name] if name else []), "--help"], env={"COLUMNS": "200"})
        assert ("Usage:" in result.output and result.exception is None) or isinstance(result.exception, SystemExit)
        named |= set(re.findall(r"(?:vca-patch|-m vca_patch)\s+([a-z][a-z-]+)", result.output))
    assert {"finetune", "convert"} <= named and named <= commands, named - commands
    monkeypatch.setattr(sys, "argv", ["vca_patch", "finetune", "--help"])  # what `python -m vca_patch` runs
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("vca_patch", run_name="__main__")
    assert exit_info.value.code == 0 and "Recover CONVERTED with RECIPE" in capsys.readouterr().out


def test_the_card_of_random_weights_says_so_and_names_its_target(tmp_path):
    from vca_patch.targets.didb import DIDBConfig

    cards = {}
    for name, config in {"vca": vca_patch.VCAConfig(contrast_tokens=4), "mano": vca_patch.MANOConfig(),
                         "didb": DIDBConfig()}.items():  # fmt: skip
        model, args = tiny(img_size=32, depth=1)
        report = patch_model(model, config)
        assert str(report).startswith({"vca": "VCA", "mano": "MANO", "didb": "DIDB"}[name] + " patch (timm-vit)")
        ckpt = vca_patch.save_pretrained(
            model, tmp_path / name, model_args=args, metadata={"base_weights": "random", "model_name": "x"}
        )
        cards[name] = (ckpt / "README.md").read_text()
    title = {card.split("\n# ", 1)[1].split("\n", 1)[0] for card in cards.values()}
    assert title == {
        "deit_tiny_patch16_224 (random weights) with Visual-Contrast Attention (VCA)",
        "deit_tiny_patch16_224 (random weights) with Multipole Attention (MANO)",
        "deit_tiny_patch16_224 (random weights) with DIDB",
    }  # no pretrained tag (.fb_in1k) on weights that are not those
    for card in cards.values():
        assert "> **Random weights.**" in card and "classifies at chance" in card
        assert f"# needs vca-patch >= {vca_patch.__version__}: in its source tree, pip install '.'" in card
        assert "pypi.org/project/vca-patch" not in card  # not published there
    assert "visual-contrast-attention" not in cards["didb"] and "linear-attention" not in cards["didb"]


def test_a_transformers_card_installs_the_hf_extra_and_pretrained_weights_keep_their_tag():
    from vca_patch.checkpoint.model_card import render_model_card

    meta = {
        "base": {"library": "transformers", "architecture": "google/vit-base-patch16-224", "license": None},
        "config": vca_patch.VCAConfig().to_dict(), "layers": {}, "params": {"before": 1, "after": 2},
        "vca_patch_version": "0.1.0", "metadata": {"base_weights": "pretrained"},
    }  # fmt: skip
    card = render_model_card(meta)
    assert "pip install '.[hf]'" in card and "Random weights" not in card
    assert "\n# google/vit-base-patch16-224 with Visual-Contrast Attention (VCA)\n" in card
