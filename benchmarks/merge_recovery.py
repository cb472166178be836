"""Recovering a token-merging plan of a real DINOv2 ViT-S/14 with BitFit (`recipes/dinov2_small_merge.yaml`).

    python benchmarks/merge_recovery.py --size 518 --first 452 --r 46   # writes results/merge_recovery_518.json

The plan (by default the planner's choice at a 0.5x budget and 518 px: merge 452 after block 0, then r = 46, residual
unmerge) is trained on fresh crops of the training photos (the calibration photos and the Debian photo packages)
and measured on the 48 held-out images (the 10 evaluation photos and 38 crops of them) that no training image, no
choice of the recipe and no choice of the plan saw. Latency: the original, the plan and the recovered plan timed
interleaved in one process (BitFit changes no shape: the two plans should time alike).

With `--validation-photos K --select-every S`, K of the training photos are kept out of training and a checkpoint
is kept every S steps: the one closest to the original on crops of those K photos is the recovered plan, so the
number of steps is chosen on images that are neither trained on nor held out.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import tempfile
import time
from pathlib import Path

import torch
from dinov2_weights import load_dinov2_small
from dinov2_weights.measure import fidelity, latency, tokens
from dinov2_weights.photo_packages import package_photos
from dinov2_weights.photos import CALIBRATION_PHOTOS, evaluation_images, load_photos, random_crops
from front import recovered
from safetensors.torch import load_file

from vca_patch.core.atomic import atomic_write_text
from vca_patch.planner.planner import measured_score
from vca_patch.surgery import patch_model
from vca_patch.targets.merge import MergeConfig
from vca_patch.train.checkpoints import list_checkpoints

RESULTS = Path(__file__).parent / "results"
MERGE_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "dinov2_small_merge.yaml"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=518)
    parser.add_argument("--first", type=int, default=452, help="tokens merged after block 0")
    parser.add_argument("--r", type=int, default=46, help="tokens merged after each later block")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-crops", type=int, default=38, help="held-out crops besides the 10 whole photos")
    parser.add_argument("--validation-photos", type=int, default=0, help="training photos kept to pick the step")
    parser.add_argument("--validation-crops", type=int, default=16, help="crops of the validation photos")
    parser.add_argument("--select-every", type=int, default=0, help="steps between the checkpoints compared")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    def log(message: str) -> None:
        print(message, flush=True)

    original = load_dinov2_small("timm", img_size=args.size)
    plan = copy.deepcopy(original)
    schedule = [args.first] + [args.r] * (len(original.blocks) - 1)
    patch_model(plan, MergeConfig(schedule=schedule, unmerge="residual"))
    held = evaluation_images(args.size, args.eval_crops)
    reference = tokens(original, held, 4)
    before = fidelity(reference, tokens(plan, held, 4))
    log(f"plan: CLS {before['cls_cosine']:.4f} patch {before['patch_token_cosine']:.4f} on {len(held)} images")
    photos = load_photos(CALIBRATION_PHOTOS) | package_photos()
    kept = sorted(random.Random(0).sample(sorted(photos), args.validation_photos))
    validation = {name: photos.pop(name) for name in kept}
    every = args.select_every or None
    with tempfile.TemporaryDirectory() as folder:
        trained, run = recovered(plan, original, args.steps, args.size, Path(folder), log, MERGE_RECIPE, photos, every)
        if validation and every:
            trained, run["selection"] = _selected(original, plan, Path(folder), validation, args, log)
    after = fidelity(reference, tokens(trained, held, 4))
    log(f"recovered ({run['seconds']:.0f} s): CLS {after['cls_cosine']:.4f} patch {after['patch_token_cosine']:.4f}")
    load_before = os.getloadavg()[0]
    timed = latency({"original": original, "plan": plan, "recovered": trained}, (args.size,), 3, min_time=2.0)
    result = {
        "size": args.size, "schedule": schedule, "recipe": MERGE_RECIPE.name, "run": run,
        "validation_photos": kept,
        "held_out_images": len(held), "threads": args.threads,
        "load_average": [load_before, os.getloadavg()[0]],
        "fidelity": {"plan": before, "recovered": after},
        "latency": {name: by_size[args.size] for name, by_size in timed.items()},
        "when": time.strftime("%Y-%m-%d"),
    }  # fmt: skip
    log(json.dumps(result["latency"]))
    args.results.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.results / f"merge_recovery_{args.size}.json", json.dumps(result, indent=2) + "\n")
    return result


def _selected(original, plan, folder: Path, validation: dict, args, log) -> tuple[torch.nn.Module, dict]:
    """The checkpoint under `folder` closest to `original` on crops of the `validation` photos (mean of CLS and
    patch-token cosine), and every checkpoint's score."""
    crops = random_crops(validation, args.validation_crops, args.size, seed=3)
    reference, scores, best = tokens(original, crops, 4), {}, None
    for path in [None, *list_checkpoints(folder)]:  # None: the plan before training
        model = copy.deepcopy(plan)
        if path is not None:
            state = load_file(str(path / "model.safetensors"))  # the engine's stage module: "student." + keys
            model.load_state_dict({key.removeprefix("student."): value for key, value in state.items()})
        step = 0 if path is None else int(path.name.split("_")[1])
        found = fidelity(reference, tokens(model, crops, 4))
        scores[step] = measured_score(found, "both")  # mean of CLS and patch-token cosine
        log(f"  step {step}: validation CLS {found['cls_cosine']:.4f} patch {found['patch_token_cosine']:.4f}")
        if best is None or scores[step] > scores[best[0]]:
            best = (step, model.eval())
    return best[1], {"chosen_step": best[0], "validation_scores": scores, "validation_crops": len(crops)}


if __name__ == "__main__":
    main()
