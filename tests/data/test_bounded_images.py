"""Image inputs are bounded before they are decoded: a data folder's FIFO named like an image, an image with more
pixels than MAX_IMAGE_PIXELS (a decompression bomb) and a symbolic link loop in a data folder are each one
DatasetError naming the file or link, never a hang or an out-of-memory kill."""

from __future__ import annotations

import os

import pytest
from PIL import Image

from tests.support.cli import one_error_line, runner
from vca_patch.cli.app import app
from vca_patch.data import images
from vca_patch.data.errors import DatasetError
from vca_patch.data.imagefolder import load_imagefolder
from vca_patch.data.images import read_image


def _folder(root, *, classes=("a", "b"), per_class=2, side=8):
    for cls in classes:
        (root / "train" / cls).mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (side, side), (i * 40, 0, 0)).save(root / "train" / cls / f"{i}.png")
    return root


def test_a_fifo_named_like_an_image_is_one_error_not_a_hang(tmp_path):
    root = _folder(tmp_path / "data")
    fifo = root / "train" / "a" / "x.png"
    os.mkfifo(fifo)
    with pytest.raises(DatasetError, match=r"x\.png: it is a FIFO \(named pipe\), not a regular file"):
        read_image(fifo)
    dataset = load_imagefolder(root, "train", training=True, transform=None)
    index = next(i for i, (path, _) in enumerate(dataset.samples) if path.endswith("x.png"))
    with pytest.raises(DatasetError, match=r"cannot read image .*x\.png: it is a FIFO"):
        dataset[index]
    skipping = load_imagefolder(root, "train", training=True, transform=None, skip_bad=True)
    assert skipping[index][0].size == (8, 8) and len(skipping.skipped) == 1  # skipped and counted with skip_bad


def test_an_image_with_too_many_pixels_is_refused_from_its_header(tmp_path, monkeypatch):
    path = tmp_path / "bomb.png"
    Image.new("RGB", (40, 30)).save(path)
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 1000)  # a real bomb is 10^9 pixels in a few KiB of PNG
    with pytest.raises(DatasetError, match=r"bomb\.png: it is 40×30 = 1200 pixels, more than the 1000"):
        read_image(path)
    monkeypatch.setattr(images, "MAX_IMAGE_PIXELS", 1200)
    assert read_image(path).size == (40, 30)


def test_pils_own_decompression_bomb_error_is_a_dataset_error(tmp_path, monkeypatch):
    path = tmp_path / "bomb.png"
    Image.new("RGB", (40, 30)).save(path)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)  # PIL raises past twice its limit
    with pytest.raises(DatasetError, match=r"cannot read image .*bomb\.png: .*decompression bomb"):
        read_image(path)


@pytest.mark.parametrize("links", [1, 2], ids=["one-link", "two-links"])
def test_a_symbolic_link_loop_in_a_data_folder_is_named(tmp_path, links):
    root = _folder(tmp_path / "data")
    for i in range(links):  # two links to a parent: a walk that follows them never ends
        (root / "train" / "a" / f"loop{i}").symlink_to("..", target_is_directory=True)
    with pytest.raises(DatasetError, match=r"has a symbolic link loop: .*loop0 leads back to"):
        load_imagefolder(root, "train", training=True, transform=None)


def test_links_to_other_folders_are_still_followed(tmp_path):
    root = _folder(tmp_path / "data")
    _folder(tmp_path / "more", classes=("a",), per_class=3)
    (root / "train" / "a" / "more").symlink_to(tmp_path / "more" / "train" / "a", target_is_directory=True)
    dataset = load_imagefolder(root, "train", training=True, transform=None)
    assert len(dataset) == 7


def test_a_link_loop_is_one_line_through_the_cli(tmp_path):
    root = _folder(tmp_path / "data")
    (root / "train" / "a" / "loop").symlink_to("..", target_is_directory=True)
    args = [
        "convert",
        "deit_tiny_patch16_224",
        "--no-pretrained",
        "--img-size",
        "32",
        "--calibration-data",
        str(root / "train"),
        "--calibration-images",
        "2",
        "-o",
        str(tmp_path / "out"),
    ]  # fmt: skip (flat folder)
    one_error_line(runner.invoke(app, args), 2, "has a symbolic link loop", "loop leads back to")
    assert not (tmp_path / "out").exists()
