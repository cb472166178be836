"""ImageFolder trees in any split layout: `root/<split>/<class>/*` (split names aliased), or a flat `root/<class>/*`
held out deterministically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset, Subset

from vca_patch.data.errors import DatasetError
from vca_patch.data.images import SkippedImages, read_image

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's
ALIASES = (("train", "training"), ("val", "validation", "valid", "test", "testing", "eval"))
HOLDOUT_EVERY = 5  # flat folder: every 5th image (sorted by class, then path) is held out for evaluation


def _subfolders(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def is_flat(root: Path) -> bool:
    """`root/<class>/<image>`: some class folder directly holds an image file."""
    return any(f.suffix.lower() in IMAGE_SUFFIXES for sub in _subfolders(root) for f in sub.iterdir() if f.is_file())


def split_folder(root: Path, name: str) -> Path | None:
    """`root/name`, else the one existing alias of it (val/validation/test..., train/training); None for a flat
    folder; a DatasetError naming the sub-folders otherwise."""
    if not root.is_dir():
        raise DatasetError(f"ImageFolder root {root} does not exist")
    if (root / name).is_dir():
        return root / name
    group = next((g for g in ALIASES if name in g), ())
    found = [root / alias for alias in group if (root / alias).is_dir()]
    if len(found) == 1:
        return found[0]
    if not found and is_flat(root):
        return None
    present = ", ".join(p.name for p in _subfolders(root)) or "none"
    raise DatasetError(
        f"ImageFolder {root} has no split {name!r} (its sub-folders: {present}); name the split to use "
        "(--split, data.train_split / data.eval_split), or pass a folder of class sub-folders"
    )


def check_no_link_loop(folder: Path, root: Path) -> None:
    """A DatasetError naming the link when a symbolic link under `folder` leads back to a folder above it (a
    loop that a walk following links, as torchvision's does, would follow until paths grow too long, and
    forever with two such links); links to anywhere else are followed as before."""
    if not folder.is_dir():
        return
    real_top = Path(os.path.realpath(folder))
    chains = {str(folder): (str(real_top), *map(str, real_top.parents))}  # a link to any folder above loops too
    for parent, subfolders, _ in os.walk(folder, followlinks=True):
        chain = chains.pop(parent)
        for name in sorted(subfolders):
            path = os.path.join(parent, name)
            real = os.path.realpath(path)
            if real in chain:
                raise DatasetError(
                    f"ImageFolder {root} has a symbolic link loop: {path} leads back to {real}, a folder above "
                    "it; remove the link"
                )
            chains[path] = (*chain, real)


def _checked_folder(folder: Path, transform: Any, *, channels: int, skip_bad: bool) -> Dataset:
    """torchvision's ImageFolder whose images are read by `read_image` (an unreadable one named, or skipped and
    counted with `skip_bad`: the next readable image stands in for it) and adapted to `channels`."""
    from torchvision.datasets import ImageFolder

    class CheckedImageFolder(ImageFolder):
        @staticmethod
        def make_dataset(directory: Any, class_to_idx: dict[str, int], *args: Any, **kwargs: Any) -> list:
            for name in class_to_idx:  # a link loop is named before torchvision's walk would follow it
                check_no_link_loop(Path(directory) / name, Path(directory))
            return ImageFolder.make_dataset(directory, class_to_idx, *args, **kwargs)

        def __getitem__(self, index: int) -> tuple[Any, int]:
            for attempt in range(len(self.samples)):
                path, target = self.samples[(index + attempt) % len(self.samples)]
                try:
                    image = read_image(path, channels)
                except DatasetError as exc:
                    if not skip_bad:
                        raise
                    self.skipped.add(path, exc)
                    continue
                return (self.transform(image) if self.transform is not None else image), target
            raise DatasetError(f"ImageFolder {self.root} holds no readable image ({len(self.skipped)} skipped)")

    try:
        dataset = CheckedImageFolder(str(folder), transform=transform)
    except (FileNotFoundError, OSError) as exc:
        raise DatasetError(f"cannot read ImageFolder {folder}: {exc}") from exc
    dataset.skipped = SkippedImages()
    return dataset


def load_imagefolder(
    root: str | Path, name: str, *, training: bool, transform: Any, channels: int = 3, skip_bad: bool = False
) -> Dataset:
    """Split `name` of an ImageFolder tree; in a flat folder, the training part (4 in 5 images) or the held-out
    part (every 5th), so calibration or training never sees the images it is measured on. Images are adapted to a
    model of `channels` input channels; an unreadable one is a DatasetError naming it, or skipped with `skip_bad`."""
    root = Path(root)
    folder = split_folder(root, name)
    dataset = _checked_folder(folder or root, transform, channels=channels, skip_bad=skip_bad)
    if folder is not None:
        return dataset
    indices = [i for i in range(len(dataset)) if (i % HOLDOUT_EVERY == 0) != training]
    return Subset(dataset, indices)
