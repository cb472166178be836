"""How long calibrating a real DINOv2 ViT-S/14 takes on this machine, per resolution and thread count.

    python benchmarks/calibration_time.py --sizes 518 1036 --threads 2     # the issue's 60 s / 4 min targets

For each size: the real weights built at that size, VCA's defaults patched in, then `vca_patch.calibrate` on the
16 calibration crops (`dinov2_weights.photos.calibration_images`), timed wall-clock with the machine's load average
before and after, and each layer's progress line. Nothing here is measured for fidelity (benchmarks/front.py does
that on held-out photos).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from dinov2_weights import load_dinov2_small
from dinov2_weights.photos import calibration_images

from vca_patch import VCAConfig, calibrate, patch_model


def time_calibration(size: int, images: int) -> dict:
    """Seconds to calibrate VCA's defaults on `images` crops at `size` px, with the load around it."""
    model = load_dinov2_small("timm", img_size=size)
    patch_model(model, VCAConfig())
    crops = calibration_images(images, size)
    load_before, started = os.getloadavg(), time.perf_counter()

    def progress(done: int, total: int, path: str) -> None:
        print(f"  {size} px: {done}/{total} {path} at {time.perf_counter() - started:.0f} s", file=sys.stderr)

    calibrate(model, [crops], progress=progress)
    seconds = time.perf_counter() - started
    return {"size": size, "images": images, "seconds": round(seconds, 1), "threads": torch.get_num_threads(),
            "load_before": load_before, "load_after": os.getloadavg()}  # fmt: skip


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[518, 1036])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [time_calibration(size, args.images) for size in args.sizes]
    print(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
