"""Real photos that ship with scikit-image and scikit-learn (and folders of images), as ImageNet-normalised model
inputs and crops.

Two disjoint sets of source photos: CALIBRATION_PHOTOS (for calibrating or training a conversion) and
EVALUATION_PHOTOS (for measuring it), so no measured image, nor any crop of it, was ever calibrated on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CALIBRATION_PHOTOS = (
    "coffee", "rocket", "coins", "hubble_deep_field", "brick", "grass", "moon", "page", "text",
    "motorcycle_left", "motorcycle_right",
)  # fmt: skip
EVALUATION_PHOTOS = (
    "astronaut", "chelsea", "camera", "china", "flower", "retina", "gravel", "cell", "clock", "immunohistochemistry",
)  # fmt: skip
_SKLEARN = ("china", "flower")


def _raw(name: str) -> np.ndarray:
    if name in _SKLEARN:
        try:
            from sklearn.datasets import load_sample_image
        except ImportError as exc:
            raise ImportError(f"photo {name!r} needs scikit-learn: pip install scikit-learn") from exc
        return load_sample_image(f"{name}.jpg")
    try:
        import skimage.data
    except ImportError as exc:
        raise ImportError(f"photo {name!r} needs scikit-image: pip install scikit-image") from exc
    if name in ("motorcycle_left", "motorcycle_right"):
        left, right, _ = skimage.data.stereo_motorcycle()
        return left if name == "motorcycle_left" else right
    loader = getattr(skimage.data, name, None)
    if loader is None:
        raise ValueError(f"unknown photo {name!r}; known: {sorted(CALIBRATION_PHOTOS + EVALUATION_PHOTOS)}")
    try:
        return loader()
    except Exception as exc:  # e.g. a dataset file scikit-image would have to download
        raise ValueError(f"cannot read photo {name!r} from skimage.data: {exc}") from exc


def load_photos(names: Sequence[str]) -> dict[str, torch.Tensor]:
    """{name: float [3, H, W] in [0, 1]} (grey photos repeated to RGB, alpha dropped)."""
    photos = {}
    for name in names:
        array = np.asarray(_raw(name))
        if array.ndim == 2:
            array = np.repeat(array[..., None], 3, axis=-1)
        if array.ndim != 3 or array.shape[-1] not in (3, 4):
            raise ValueError(f"photo {name!r} has shape {array.shape}, not an RGB image")
        image = torch.from_numpy(np.array(array[..., :3])).permute(2, 0, 1).float()
        photos[name] = image / 255.0 if array.dtype == np.uint8 else image.clamp(0, 1)
    return photos


def normalize(images: torch.Tensor) -> torch.Tensor:
    """ImageNet mean/std normalisation of images in [0, 1] ([3, H, W] or [B, 3, H, W])."""
    mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(3, 1, 1)
    return (images - mean) / std


def _resize(image: torch.Tensor, size: int) -> torch.Tensor:
    return F.interpolate(image[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


def to_model_input(photo: torch.Tensor, size: int) -> torch.Tensor:
    """The central square of `photo`, resized to size × size and normalised: [3, size, size]."""
    _, h, w = photo.shape
    side = min(h, w)
    top, left = (h - side) // 2, (w - side) // 2
    return normalize(_resize(photo[:, top : top + side, left : left + side], size))


def _random_crop(
    image: torch.Tensor, size: int, scale: tuple[float, float], generator: torch.Generator
) -> torch.Tensor:
    """One random-resized crop of `image` (area fraction in `scale`, aspect 3/4..4/3), in [0, 1]: [3, size, size]."""
    _, h, w = image.shape
    area = h * w * float(torch.empty(()).uniform_(*scale, generator=generator))
    aspect = math.exp(float(torch.empty(()).uniform_(math.log(3 / 4), math.log(4 / 3), generator=generator)))
    ch = max(1, min(h, round(math.sqrt(area / aspect))))
    cw = max(1, min(w, round(math.sqrt(area * aspect))))
    top = int(torch.randint(0, h - ch + 1, (), generator=generator))
    left = int(torch.randint(0, w - cw + 1, (), generator=generator))
    return _resize(image[:, top : top + ch, left : left + cw], size)


def random_crops(
    photos: dict[str, torch.Tensor], count: int, size: int, *, seed: int = 0, scale: tuple[float, float] = (0.15, 1.0)
) -> torch.Tensor:
    """`count` random-resized crops (area fraction in `scale`, aspect 3/4..4/3), cycling over the photos in name
    order, resized to size × size and normalised: [count, 3, size, size]. Deterministic for a seed."""
    if not photos:
        raise ValueError("no photos to crop")
    generator = torch.Generator().manual_seed(seed)
    names = sorted(photos)
    return normalize(
        torch.stack([_random_crop(photos[names[i % len(names)]], size, scale, generator) for i in range(count)])
    )


class PhotoCrops(Dataset):
    """A fresh random-resized crop (randomly flipped) of a randomly drawn photo for every index: `(crop, 0)`.

    Unlike `random_crops`, which cycles over the photos in name order, every crop draws its photo at random, so a
    batch of 8 crops from 100 photos is 8 different photos, not the first 8. Item i is the same for the same seed;
    `length` is how many crops an epoch has (training steps × batch for one pass of fresh crops). `augment` (e.g.
    `PhotometricAugment()`) recolours, greys or blurs each crop before it is normalised. `weights` {name: w > 0}
    draws photo `name` with probability w / sum(w) instead of uniformly (e.g. to give 300 small downstream images
    the same share of the crops as 100 photos, not three times theirs).
    """

    def __init__(
        self,
        photos: dict[str, torch.Tensor],
        size: int,
        length: int,
        *,
        seed: int = 0,
        scale: tuple[float, float] = (0.15, 1.0),
        flip: bool = True,
        augment: Callable[[torch.Tensor, torch.Generator], torch.Tensor] | None = None,
        weights: Mapping[str, float] | None = None,
    ) -> None:
        if not photos:
            raise ValueError("no photos to crop")
        if length < 1:
            raise ValueError(f"length must be >= 1, got {length}")
        names = sorted(photos)
        self.photos = [photos[name] for name in names]
        self.size, self.length, self.seed, self.scale, self.flip = size, length, seed, scale, flip
        self.augment = augment
        self.weights = None if weights is None else _photo_weights(names, weights)  # [len(photos)] or None

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        if self.weights is None:
            image = self.photos[int(torch.randint(0, len(self.photos), (), generator=generator))]
        else:
            image = self.photos[int(torch.multinomial(self.weights, 1, generator=generator))]
        crop = _random_crop(image, self.size, self.scale, generator)
        if self.flip and bool(torch.rand((), generator=generator) < 0.5):
            crop = crop.flip(-1)
        if self.augment is not None:
            crop = self.augment(crop, generator)
        return normalize(crop), 0


def _photo_weights(names: Sequence[str], weights: Mapping[str, float]) -> torch.Tensor:
    """`weights` in the order of `names` as float64 [len(names)]; ValueError unless it has exactly those names, each
    with a finite positive weight."""
    missing, extra = set(names) - set(weights), set(weights) - set(names)
    if missing or extra:
        raise ValueError(
            f"weights must name exactly the photos: missing {sorted(missing)[:3]}, unknown {sorted(extra)[:3]}"
        )
    bad = {name: w for name, w in weights.items() if not (math.isfinite(w) and w > 0)}
    if bad:
        raise ValueError(f"photo weights must be finite and > 0, got {dict(list(bad.items())[:3])}")
    return torch.tensor([float(weights[name]) for name in names], dtype=torch.float64)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp")


def image_files(folder: Path) -> list[Path]:
    """The image files (by suffix, IMAGE_SUFFIXES) under `folder`, recursively, sorted."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def load_image_folder(folder: str | Path, *, max_side: int = 1024, prefix: str = "") -> dict[str, torch.Tensor]:
    """{prefix + relative path: float [3, H, W] in [0, 1]} for every image under `folder` (recursively), each
    downscaled to at most `max_side` pixels on its longer side (grey and RGBA images become RGB).

    Raises ValueError naming the folder when it holds no image, and the file when one cannot be read.
    """
    from PIL import Image, UnidentifiedImageError

    root = Path(folder).expanduser()
    if not root.is_dir():
        raise ValueError(f"{root} is not a folder of images")
    files = image_files(root)
    if not files:
        raise ValueError(f"{root} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    photos = {}
    for path in files:
        try:
            with Image.open(path) as opened:
                image = opened.convert("RGB")
        except (OSError, UnidentifiedImageError) as exc:
            raise ValueError(f"cannot read image {path}: {exc}") from None
        image.thumbnail((max_side, max_side), Image.Resampling.BICUBIC)
        tensor = torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255.0
        photos[prefix + path.relative_to(root).with_suffix("").as_posix()] = tensor
    return photos


def evaluation_images(
    size: int, crops: int, *, seed: int = 0, names: Sequence[str] = EVALUATION_PHOTOS
) -> torch.Tensor:
    """Each evaluation photo whole (central square) plus `crops` random crops of them: [len(names) + crops, 3, s, s]."""
    photos = load_photos(names)
    whole = torch.stack([to_model_input(p, size) for p in photos.values()])
    return torch.cat([whole, random_crops(photos, crops, size, seed=seed)]) if crops else whole


def calibration_images(
    count: int, size: int, *, seed: int = 1, names: Sequence[str] = CALIBRATION_PHOTOS
) -> torch.Tensor:
    """`count` random crops of the calibration photos (disjoint from the evaluation photos)."""
    overlap = set(names) & set(EVALUATION_PHOTOS)
    if overlap:
        raise ValueError(
            f"calibration photos must be kept apart from the evaluation photos; both have {sorted(overlap)}"
        )
    return random_crops(load_photos(names), count, size, seed=seed)
