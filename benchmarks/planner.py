"""The conversion planner against token merging alone, on the real DINOv2 ViT-S/14, side by side in one run.

    python benchmarks/planner.py                     # 224 + 518 px, 8 calibration crops, 16 held-out images
    python benchmarks/planner.py --sizes 224 518 1036
    python benchmarks/planner.py --local-window 7    # the planner's VCA blocks with the local term
    python benchmarks/planner.py --quick             # seconds: a tiny random-weight ViT (tests)

For each size: token merging alone at several r (r per block from block 0), as ToMe has it (merged tokens copied
back to their patches, "merge r=...") and with the residual unmerge ("residual r=...": each patch also gets back
what merging took from it), and the planner's choice at each budget (`vca_patch.planner`: measured per-layer
sensitivity + latency, VCA in the blocks before the first merge, calibrated on the calibration crops; its merging
returns tokens by `--unmerge`, default auto: the residual unmerge unless `--objective cls`; `--local-window K`
gives its VCA blocks the K×K local term, timed and measured with it) are measured
on held-out photos (never calibrated on): CLS cosine, per-patch-token cosine and mean-patch cosine to the original,
and the batch-1 CPU latency ratio, all models timed interleaved. Writes RESULTS/planner[_quick].json, .png and
.md (also printed); with --local-window K, planner[_quick]_localK.*.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from dinov2_weights.measure import fidelity, latency, tokens
from torch import nn

import vca_patch
from vca_patch.core.atomic import atomic_write_text
from vca_patch.planner import (
    PLAN_UNMERGE_MODES,
    candidates,
    choose_measured,
    model_info,
    pareto,
    plan_config,
    planned_unmerge,
)
from vca_patch.planner.costs import measure_latency_table
from vca_patch.planner.model_info import PlanError
from vca_patch.planner.planner import apply_plan
from vca_patch.planner.search import OBJECTIVES
from vca_patch.planner.sensitivity import measure_sensitivity, merge_rates
from vca_patch.targets.merge import MergeConfig
from vca_patch.targets.vca.neighbourhood import is_local_window

RESULTS = Path(__file__).parent / "results"
FULL = {"calibration": 8, "eval_crops": 6, "budgets": [0.4, 0.5, 0.6, 0.7, 0.8], "ns": [16, 49], "repeats": 3,
        "mano_windows": [7], "min_time": 2.0}  # fmt: skip
QUICK = {"calibration": 2, "eval_crops": 0, "budgets": [0.9, 1.5], "ns": [4], "repeats": 1, "mano_windows": [2],
         "min_time": 0.0}  # fmt: skip
MERGE_FRACTIONS = (0.3, 0.5, 0.7, 0.85, 0.95)
ROW_KINDS = {"merge": "merging", "residual": "residual", "plan": "planner"}  # by a row name's first word
PLOT_LABELS = {"merging": "merging alone (ToMe)", "residual": "merging, residual unmerge", "planner": "planner"}


def _real(size: int, calibration: int, eval_crops: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    from dinov2_weights import load_dinov2_small
    from dinov2_weights.photos import calibration_images, evaluation_images

    model = load_dinov2_small("timm", img_size=size)
    return model, calibration_images(calibration, size), evaluation_images(size, eval_crops)


def _tiny(size: int, calibration: int) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    import timm

    torch.manual_seed(0)
    model = timm.create_model(
        "vit_small_patch14_dinov2", pretrained=False, img_size=size, depth=4, embed_dim=64, num_heads=4,
        init_values=0.5, num_classes=0,
    ).eval()  # fmt: skip
    return model, torch.randn(calibration, 3, size, size), torch.randn(3, 3, size, size)


def run_size(model, calib, held, size: int, settings: dict, log) -> dict:
    """Merging alone at several r and the planner at each budget, measured side by side at `size` px."""
    info = model_info(model)
    started = time.perf_counter()
    mano_windows, repeats = settings["mano_windows"], settings["repeats"]
    objective = settings["objective"]
    unmerge = planned_unmerge(objective, settings["unmerge"])
    table = measure_latency_table(
        model, info, size, settings["ns"], mano_windows=mano_windows, repeats=repeats, unmerge=unmerge,
        min_time=settings["min_time"] / 4, local_window=settings["local_window"],
    )  # fmt: skip
    windows = table.faster_mano_windows()  # as `plan_model`: a MANO block slower than softmax could never be chosen
    log(f"  MANO windows faster than a softmax block here: {windows} of {mano_windows}")
    starts = sorted(set(range(0, info.depth, max(1, info.depth // 4))))
    sens = measure_sensitivity(
        model, info, calib, size, contrast_tokens=settings["ns"], merge_starts=starts, merge_fractions=MERGE_FRACTIONS,
        mano_windows=windows, unmerge=unmerge, local_window=settings["local_window"], log=log,
    )  # fmt: skip
    cands = candidates(info, size, table, sens, objective)
    plan_seconds = time.perf_counter() - started
    configs: dict[str, MergeConfig] = {}
    for r in merge_rates(info, size, 0, MERGE_FRACTIONS):
        configs[f"merge r={r}"] = MergeConfig(r=r)  # the peer: merging alone, merged tokens copied back
        configs[f"residual r={r}"] = MergeConfig(r=r, unmerge="residual")
    chosen, measured = {}, {}
    for budget in settings["budgets"]:
        try:
            cand, _ = choose_measured(
                model, info, cands, budget, objective, calib, unmerge=unmerge, log=log, measured=measured,
                repeats=repeats, min_time=settings["min_time"] / 4,
            )  # fmt: skip
        except PlanError as error:
            log(f"  budget {budget}: {error}")
            continue
        chosen[budget] = cand
        configs.setdefault(f"plan {cand.describe()}", plan_config(cand, info, unmerge=unmerge))
    log(f"  measuring {len(configs)} conversions on {len(held)} held-out images")
    reference = tokens(model, held, 4)
    models = {"original": model}
    rows = {}
    for name, config in configs.items():
        twin = apply_plan(_copy(model), config, calib if config.vca_layers else None)
        models[name] = twin
        rows[name] = {"config": config.to_dict(), **fidelity(reference, tokens(twin, held, 4))}
    timed = latency(models, (size,), settings["repeats"], log=log, min_time=settings["min_time"])
    for name in rows:
        rows[name]["latency_ratio"] = timed[name][size]["ratio"]
        rows[name]["latency_ms"] = timed[name][size]["ms"]
        rows[name]["kind"] = ROW_KINDS[name.split(" ")[0]]
    budgets = {b: f"plan {c.describe()}" for b, c in chosen.items()}
    return {
        "tokens": info.tokens(size),
        "planner_unmerge": unmerge,
        "rows": rows,
        "original_ms": timed["original"][size]["ms"],
        "budgets": {str(b): name for b, name in budgets.items()},
        "planner_seconds": plan_seconds,
        "objective": objective,
        "predicted_front": [c.to_dict() for c in pareto(cands, objective)],
        "sensitivity": sens.to_dict(),
        "latency_table": table.to_dict(),
    }


def _copy(model: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(model)


def markdown(results: dict) -> str:
    lines = []
    for size, result in results["sizes"].items():
        lines += [
            f"\n**{size} px** ({result['tokens']} tokens; original {result['original_ms']:.0f} ms at batch 1)\n",
            "| conversion | latency ratio | CLS cosine | patch-token cosine | mean-patch cosine |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, row in sorted(result["rows"].items(), key=lambda kv: kv[1]["latency_ratio"]):
            lines.append(
                f"| {name} | {row['latency_ratio']:.2f} | {row['cls_cosine']:.4f} | {row['patch_token_cosine']:.4f} "
                f"| {row['mean_patch_cosine']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["sizes"])
    figure, axes = plt.subplots(2, len(sizes), figsize=(5 * len(sizes), 7.5), dpi=110, squeeze=False)
    try:
        for col, size in enumerate(sizes):
            rows = results["sizes"][size]["rows"]
            for row_index, (metric, label) in enumerate((("cls_cosine", "CLS"), ("patch_token_cosine", "patch token"))):
                ax = axes[row_index][col]
                for kind, marker in (("merging", "o-"), ("residual", "^--"), ("planner", "s-")):
                    points = sorted((r["latency_ratio"], r[metric]) for r in rows.values() if r["kind"] == kind)
                    if points:
                        ax.plot(*zip(*points, strict=True), marker, label=PLOT_LABELS[kind])
                ax.set_title(f"{size} px: {label} cosine")
                ax.set_xlabel("latency ratio (batch 1, CPU)")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(path)
    finally:
        plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random-weight ViT, few images (tests)")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="resolutions (default 224 518)")
    parser.add_argument("--budgets", type=float, nargs="+", default=None, help="latency budgets for the planner")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--calibration", type=int, default=None, help="calibration crops (default 8)")
    parser.add_argument("--eval-crops", type=int, default=None, help="held-out crops besides the 10 whole photos")
    parser.add_argument("--ns", type=int, nargs="*", default=None, help="VCA contrast-token counts (default 16 49)")
    parser.add_argument("--mano-windows", type=int, nargs="*", default=None, help="MANO windows k (default 7)")
    parser.add_argument("--unmerge", choices=PLAN_UNMERGE_MODES, default="auto", help="the planner's unmerge")
    parser.add_argument("--objective", choices=OBJECTIVES, default="both", help="what the planner keeps")
    parser.add_argument("--local-window", type=int, default=0, help="the planner's VCA local term k (0: none)")
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for the JSON / PNG / MD")
    args = parser.parse_args(argv)
    if not is_local_window(args.local_window):
        parser.error(f"--local-window must be 0 or odd, got {args.local_window}")
    settings = dict(QUICK if args.quick else FULL, unmerge=args.unmerge, objective=args.objective)
    settings["local_window"] = args.local_window
    if args.budgets:
        settings["budgets"] = args.budgets
    for key in ("calibration", "eval_crops", "ns", "mano_windows"):
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    sizes = args.sizes or ([56] if args.quick else [224, 518])
    torch.set_num_threads(args.threads)
    args.results.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    results = {
        "vca_patch": vca_patch.__version__,
        "torch": torch.__version__,
        "platform": platform.platform(),
        "threads": args.threads,
        "settings": settings,
        "sizes": {},
    }
    for size in sizes:
        log(f"{size} px")
        if args.quick:
            model, calib, held = _tiny(size, settings["calibration"])
        else:
            model, calib, held = _real(size, settings["calibration"], settings["eval_crops"])
        results["sizes"][str(size)] = run_size(model, calib, held, size, settings, log)
    stem = ("planner_quick" if args.quick else "planner") + (f"_local{args.local_window}" if args.local_window else "")
    atomic_write_text(args.results / f"{stem}.json", json.dumps(results, indent=2) + "\n")
    plot(results, args.results / f"{stem}.png")
    table = markdown(results)
    atomic_write_text(args.results / f"{stem}.md", table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
