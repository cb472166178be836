"""Datasets for recovery recipes: Fashion-MNIST idx files, ImageFolder trees, Hugging Face `datasets`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, Subset

from vca_patch.core.hub_access import is_path_like
from vca_patch.data.errors import DatasetError
from vca_patch.data.fashion_mnist import DEFAULT_ROOT, FashionMNISTAsRGB, load_fashion_mnist
from vca_patch.data.imagefolder import load_imagefolder
from vca_patch.data.images import adapt_data_config, adapt_image


def _limit(dataset: Dataset, limit: int | None) -> Dataset:
    if limit is None or limit >= len(dataset):
        return dataset
    return Subset(dataset, range(limit))


def _timm_transform(model_cfg: dict[str, Any], training: bool, augment: str) -> Any:
    from timm.data import create_transform, resolve_data_config

    cfg = resolve_data_config({}, pretrained_cfg=model_cfg)
    if training and augment == "timm":
        return create_transform(**cfg, is_training=True, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    return create_transform(**cfg, is_training=False)


class HFImageDataset(Dataset):
    """A Hugging Face `datasets` split as (image tensor, label) pairs."""

    def __init__(self, split: Any, transform: Any, image_key: str, label_key: str, channels: int = 3) -> None:
        self.split, self.transform = split, transform
        self.image_key, self.label_key, self.channels = image_key, label_key, channels

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        row = self.split[int(i)]
        return self.transform(adapt_image(row[self.image_key], self.channels)), int(row[self.label_key])


def build_dataset(
    spec: Any, split: str, *, training: bool, img_size: int, model_cfg: dict[str, Any] | None = None
) -> Dataset:
    """The train or eval split described by a recipe's `data` section (a `DataSpec`).

    `model_cfg` is the model's timm data config (its `input_size`, mean, std, crop): ImageFolder and Hub images go
    through timm's transform for it; Fashion-MNIST's grey images too when the model takes RGB input (a model built
    for them, one channel, gets them as they are, resized to `img_size` or the recipe's data.img_size). Every kind
    is adapted to the model the same way (`data.images`: grey for a 1-channel model, RGB for a 3-channel one), in
    `fidelity`, `convert --calibration-data` and recipes alike; an unreadable image file is a DatasetError naming
    it, or skipped and counted when `spec.skip_bad_images`."""
    limit = spec.train_limit if training else spec.eval_limit
    name = spec.train_split if training else spec.eval_split
    cfg = dict(model_cfg or {})
    channels = int(cfg.get("input_size", (1,))[0])
    cfg.setdefault("input_size", (3, img_size, img_size))
    photo_channels = channels if "input_size" in (model_cfg or {}) else 3  # ImageFolder / Hub images: RGB unless told
    cfg = adapt_data_config(cfg, photo_channels)
    if spec.kind == "fashion_mnist":
        root = spec.path or DEFAULT_ROOT
        if channels == 3 and not spec.img_size:  # an RGB model: its own size and normalisation, as timm would
            return FashionMNISTAsRGB(name, root, limit=limit, transform=_timm_transform(cfg, False, "none"))
        return load_fashion_mnist(name, root, limit=limit, img_size=spec.img_size or img_size)
    transform = _timm_transform(cfg, training, spec.augment)
    if spec.kind == "imagefolder":
        if not spec.path:
            raise DatasetError("data.path must point at an ImageFolder root (train/ and val/ folders, or classes)")
        skip = bool(getattr(spec, "skip_bad_images", False))
        folder = load_imagefolder(
            spec.path, name, training=training, transform=transform, channels=photo_channels, skip_bad=skip
        )
        return _limit(folder, limit)
    if spec.kind == "hf":
        # a name that is no local folder either: say so first (a typo'd folder is likelier than a dataset id)
        local = f"no local folder {spec.path}, and as a Hugging Face dataset name: " if spec.path else ""
        try:
            import datasets
        except ImportError as exc:
            raise DatasetError(f"{local}data.kind 'hf' needs the `datasets` package: pip install datasets") from exc
        if not spec.path:
            raise DatasetError("data.path must name a Hugging Face dataset (e.g. 'imagenet-1k')")
        try:
            hf_split = datasets.load_dataset(spec.path, split=name)
        except Exception as exc:  # datasets raises many types (offline, missing, auth)
            raise DatasetError(f"{local}cannot load {spec.path!r} split {name!r}: {exc}") from exc
        return _limit(HFImageDataset(hf_split, transform, spec.image_key, spec.label_key, photo_channels), limit)
    raise DatasetError(f"unknown data.kind {spec.kind!r}")


def infer_kind(path: str | Path | None) -> str:
    """The data kind of a path given without one: "fashion_mnist" for none or a folder of idx files,
    "imagefolder" for another local folder, "hf" for a name that is no local path (a Hub dataset)."""
    if path is None:
        return "fashion_mnist"
    folder = Path(path)
    if folder.is_dir():
        idx = any("idx" in f.name and "ubyte" in f.name for f in folder.iterdir() if f.is_file())
        return "fashion_mnist" if idx else "imagefolder"
    if folder.is_absolute() or is_path_like(str(path)):
        raise DatasetError(f"data folder {path} does not exist")
    if folder.exists():
        raise DatasetError(f"{path} is a file; pass a folder (idx files or an ImageFolder) or a dataset name")
    return "hf"


def mixup_fn(spec: Any, num_classes: int) -> Any | None:
    """timm Mixup/CutMix for a recipe's data section, or None when both are off."""
    if spec.mixup <= 0 and spec.cutmix <= 0:
        return None
    from timm.data import Mixup

    # A head-less model (num_classes 0) distils features and ignores the labels: timm still needs a class count.
    return Mixup(mixup_alpha=spec.mixup, cutmix_alpha=spec.cutmix, num_classes=max(num_classes, 1), label_smoothing=0.0)
