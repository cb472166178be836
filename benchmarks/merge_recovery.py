"""Recovering a token-merging plan of a real DINOv2 ViT-S/14 with BitFit (`recipes/dinov2_small_merge.yaml`).

    python benchmarks/merge_recovery.py --size 518 --first 452 --r 46   # writes results/merge_recovery_518.json

The plan (by default the planner's choice at a 0.5x budget and 518 px: merge 452 after block 0, then r = 46, residual
unmerge) is trained on fresh crops of the training photos (the calibration photos and the Debian photo packages)
and measured on the 48 held-out images (the 10 evaluation photos and 38 crops of them) that no training image, no
choice of the recipe and no choice of the plan saw. Latency: the original, the plan and the recovered plan timed
interleaved in one process (BitFit changes no shape: the two plans should time alike).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from dinov2_weights import load_dinov2_small
from dinov2_weights.measure import fidelity, latency, tokens
from dinov2_weights.photos import evaluation_images
from front import recovered

from vca_patch.core.atomic import atomic_write_text
from vca_patch.surgery import patch_model
from vca_patch.targets.merge import MergeConfig

RESULTS = Path(__file__).parent / "results"
MERGE_RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "dinov2_small_merge.yaml"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=518)
    parser.add_argument("--first", type=int, default=452, help="tokens merged after block 0")
    parser.add_argument("--r", type=int, default=46, help="tokens merged after each later block")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-crops", type=int, default=38, help="held-out crops besides the 10 whole photos")
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
    with tempfile.TemporaryDirectory() as folder:
        trained, run = recovered(plan, original, args.steps, args.size, Path(folder), log, MERGE_RECIPE)
    after = fidelity(reference, tokens(trained, held, 4))
    log(f"recovered ({run['seconds']:.0f} s): CLS {after['cls_cosine']:.4f} patch {after['patch_token_cosine']:.4f}")
    load_before = os.getloadavg()[0]
    timed = latency({"original": original, "plan": plan, "recovered": trained}, (args.size,), 3, min_time=2.0)
    result = {
        "size": args.size, "schedule": schedule, "recipe": MERGE_RECIPE.name, "run": run,
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


if __name__ == "__main__":
    main()
