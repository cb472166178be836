"""Reading images for a model: one unreadable or corrupt file is named (DatasetError) or, when the user asks
(`--skip-bad-images`, a recipe's data.skip_bad_images), skipped and counted; and every image is adapted to the
model's input the same way in `fidelity`, `convert --calibration-data` and recipes (`adapt_image`,
`adapt_data_config`): grey for a 1-channel model, RGB for a 3-channel one, the normalisation cut to match."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from vca_patch.core.bounded import not_regular
from vca_patch.data.errors import DatasetError

MAX_IMAGE_PIXELS = 89_478_485  # PIL's own warning threshold (a 9459×9459 image; ~256 MiB as RGB)
SKIP_HINT = "remove or replace it, or pass --skip-bad-images (recipe: data.skip_bad_images: true) to skip such files"


def image_mode(channels: int) -> str:
    """The PIL mode of a model's input: "L" for one channel, "RGB" otherwise."""
    return "L" if channels == 1 else "RGB"


def adapt_image(image: Any, channels: int) -> Any:
    """A PIL image converted to what a model with `channels` input channels takes (grey or RGB)."""
    mode = image_mode(channels)
    return image if image.mode == mode else image.convert(mode)


def adapt_data_config(cfg: dict[str, Any], channels: int) -> dict[str, Any]:
    """A timm data config whose mean and std have one value per input channel (a 1-channel model measured on RGB
    images: their average; a 3-channel one given one value: repeated)."""
    cfg = dict(cfg)
    for key in ("mean", "std"):
        value = cfg.get(key)
        if value is None or isinstance(value, (int, float)):
            continue
        value = tuple(float(v) for v in value)
        if len(value) != channels and value:
            cfg[key] = (sum(value) / len(value),) * channels if channels == 1 else (value[0],) * channels
    return cfg


def read_image(path: str | Path, channels: int = 3) -> Any:
    """The image at `path`, fully decoded and adapted to `channels`; a DatasetError naming the file if it cannot be
    read (missing, not an image, truncated), is no regular file (a FIFO would block the read forever) or has more
    than MAX_IMAGE_PIXELS pixels (a decompression bomb: a small file that decodes to gigabytes), checked from its
    header before it is decoded."""
    from PIL import Image

    kind = not_regular(path)
    if kind is not None:
        raise DatasetError(f"cannot read image {path}: it is {kind}, not a regular file; {SKIP_HINT}")
    try:
        with Image.open(path) as image:
            _check_pixels(path, image.size)
            image.load()
            return adapt_image(image, channels)
    except DatasetError:  # too many pixels: already one line
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:  # PIL: "image file is truncated"
        raise DatasetError(f"cannot read image {path}: {str(exc).strip() or type(exc).__name__}; {SKIP_HINT}") from exc


def _check_pixels(path: str | Path, size: tuple[int, int]) -> None:
    """At most MAX_IMAGE_PIXELS pixels, from the image's header (before anything is decoded)."""
    width, height = size
    if width * height > MAX_IMAGE_PIXELS:
        raise DatasetError(
            f"cannot read image {path}: it is {width}×{height} = {width * height} pixels, more than the "
            f"{MAX_IMAGE_PIXELS} an image may have (a decompression bomb?); {SKIP_HINT}"
        )


class SkippedImages:
    """The unreadable images a dataset skipped (each named once on stderr as it is skipped)."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    def add(self, path: str, exc: BaseException) -> None:
        if path not in self.paths:
            self.paths.append(path)
            print(f"warning: skipped unreadable image {path} ({exc.__cause__ or exc})", file=sys.stderr)

    def __len__(self) -> int:
        return len(self.paths)

    def summary(self) -> str | None:
        """One line for the end of a run ("skipped N unreadable images ..."), or None when none was skipped."""
        if not self.paths:
            return None
        more = f" and {len(self.paths) - 1} more" if len(self.paths) > 1 else ""
        return f"skipped {len(self.paths)} unreadable image(s): {self.paths[0]}{more}"


def skipped_images(dataset: Any) -> SkippedImages | None:
    """The SkippedImages of `dataset` (looking through Subset), or None for a dataset that reads no image files."""
    while dataset is not None:
        skipped = getattr(dataset, "skipped", None)
        if isinstance(skipped, SkippedImages):
            return skipped
        dataset = getattr(dataset, "dataset", None)
    return None
