"""Token-merging schedules of a real DINOv2 ViT-S/14 at equal cost: which shape keeps the features closest.

    python benchmarks/merge_schedules.py --size 518        # writes results/merge_schedules_518.json

Every schedule merges from block 0 with the multiply-adds (the planner's FLOP model) of ToMe's constant r = N/12,
residual unmerge: constant r, a front-loaded first block (a share of the patch tokens, then a smaller constant r
fitted to the same cost), two heavy blocks, and r falling linearly. Fidelity is measured on the calibration crops
only, because this is where the planner's front-loaded schedules (`--merge-leads`) were chosen; the held-out images
judge the planner's choices in benchmarks/front.py.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import torch
from dinov2_weights import load_dinov2_small
from dinov2_weights.measure import fidelity, tokens
from dinov2_weights.photos import calibration_images

from vca_patch.planner import model_info
from vca_patch.planner.costs import plan_macs
from vca_patch.surgery import patch_model
from vca_patch.targets.merge import MergeConfig

RESULTS = Path(__file__).parent / "results"


def schedules(depth: int, patches: int, cost) -> dict[str, list[int]]:
    """{label: r per block}, each the cheapest of its shape at no more than `cost` of constant r = patches / 12."""
    base = [round(patches / 12)] * depth
    target = cost(base)

    def fitted(head: list[int]) -> list[int]:  # head, then the smallest constant r within the target cost
        return next(s for r in range(patches) if cost(s := head + [r] * (depth - len(head))) <= target + 1e-9)

    out = {f"{base[0]} in every block": base}
    for share in (1 / 6, 1 / 4, 1 / 3, 5 / 12, 1 / 2):
        schedule = fitted([round(share * patches)])
        out[f"{schedule[0]}, then {schedule[1]}"] = schedule
    out[f"{round(patches / 4)} in blocks 0 and 1"] = fitted([round(patches / 4)] * 2)
    for peak in range(patches // 12, patches):
        falling = [round(peak * (1 - i / (depth - 1))) for i in range(depth)]
        if cost(falling) <= target + 1e-9:
            out[f"{peak} falling linearly to 0"] = falling
            break
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=518)
    parser.add_argument("--images", type=int, default=16, help="calibration crops")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for merge_schedules_<size>.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_dinov2_small("timm", img_size=args.size)
    info = model_info(model)
    full = plan_macs(info, args.size, [], {})

    def cost(schedule: list[int]) -> float:
        return plan_macs(info, args.size, schedule, {}) / full

    crops = calibration_images(args.images, args.size)
    reference = tokens(model, crops, 4)
    rows = {}
    for label, schedule in schedules(info.depth, info.tokens(args.size) - info.num_prefix_tokens, cost).items():
        twin = copy.deepcopy(model)
        patch_model(twin, MergeConfig(schedule=schedule, unmerge="residual"))
        scores = fidelity(reference, tokens(twin, crops, 4))
        rows[label] = {"schedule": schedule, "macs_ratio": cost(schedule), "cls_cosine": scores["cls_cosine"],
                       "patch_token_cosine": scores["patch_token_cosine"]}  # fmt: skip
        print(f"{label:28s} MACs {cost(schedule):.3f}  CLS {scores['cls_cosine']:.4f}  "
              f"patch {scores['patch_token_cosine']:.4f}", flush=True)  # fmt: skip
    result = {"size": args.size, "calibration_crops": args.images, "unmerge": "residual", "rows": rows}
    (args.results / f"merge_schedules_{args.size}.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
