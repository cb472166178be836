"""Fashion-MNIST from its idx files (Debian `dataset-fashion-mnist`: /usr/share/datasets/fashion-mnist)."""

from __future__ import annotations

import gzip
import struct
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset, TensorDataset

from vca_patch.data.errors import DatasetError

DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
# Per-pixel statistics of the Fashion-MNIST training images (in [0, 1]).
MEAN, STD = 0.2860, 0.3530


def _find(root: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz", stem.replace("-idx", ".idx")):
        if (root / name).is_file():
            return root / name
    raise DatasetError(
        f"Fashion-MNIST file {stem}[.gz] not found in {root}; install it with "
        "`apt-get install dataset-fashion-mnist` or pass the folder holding the idx files"
    )


def read_idx(path: str | Path) -> torch.Tensor:
    """An idx file (optionally gzip-compressed) as a uint8 tensor of its stored shape."""
    path = Path(path)
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise DatasetError(f"cannot read idx file {path}: {exc}") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DatasetError(f"{path} is not an unsigned-byte idx file")
    ndim = raw[3]
    shape = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    data = torch.frombuffer(bytearray(raw[4 + 4 * ndim :]), dtype=torch.uint8)
    if data.numel() != torch.Size(shape).numel():
        raise DatasetError(f"{path} is truncated: expected {torch.Size(shape).numel()} values, got {data.numel()}")
    return data.view(*shape)


def _read_split(split: str, root: str | Path | None, limit: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The split's uint8 images [N, 28, 28] and uint8 labels [N] (the first `limit`)."""
    if split not in _FILES:
        raise DatasetError(f"Fashion-MNIST split must be one of {sorted(_FILES)}, got {split!r}")
    root = Path(root) if root is not None else DEFAULT_ROOT
    if not root.is_dir():
        raise DatasetError(
            f"Fashion-MNIST folder {root} does not exist; install `dataset-fashion-mnist` (apt) or pass its folder"
        )
    images = read_idx(_find(root, _FILES[split][0]))
    labels = read_idx(_find(root, _FILES[split][1]))
    if limit is not None:
        images, labels = images[:limit], labels[:limit]
    return images, labels


class FashionMNISTAsRGB(Dataset):
    """Fashion-MNIST for a model built for RGB photos: each 28×28 grey image becomes an RGB PIL image and goes
    through `transform` (timm's eval transform from the model's data config: its size, crop and normalisation),
    one image at a time, so no full-size copy of the split is held in memory."""

    def __init__(self, split: str, root: str | Path | None, *, limit: int | None, transform: Callable) -> None:
        self.images, self.labels = _read_split(split, root, limit)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = Image.fromarray(self.images[int(i)].numpy(), mode="L").convert("RGB")
        return self.transform(image), int(self.labels[int(i)])


def load_fashion_mnist(
    split: str = "train",
    root: str | Path | None = None,
    *,
    limit: int | None = None,
    img_size: int = 28,
    normalize: bool = True,
) -> TensorDataset:
    """Images as float [N, 1, img_size, img_size] (normalised) and int64 labels, as a TensorDataset.

    `limit` keeps the first `limit` examples (a stratified-enough subset: the files are shuffled).
    """
    images, labels = _read_split(split, root, limit)
    x = images.float().div_(255.0).unsqueeze(1)
    if img_size != x.shape[-1]:
        x = torch.nn.functional.interpolate(x, size=(img_size, img_size), mode="bilinear", align_corners=False)
    if normalize:
        x = (x - MEAN) / STD
    return TensorDataset(x, labels.long())
