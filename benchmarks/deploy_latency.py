"""Deploy latency, side by side in one run: converted / original latency ratios of DINOv2-S shapes (timm
vit_small_patch14_dinov2, random weights, any image size) in eager mode and under torch.compile (both models compiled
the same way), and the local term's share of a VCA layer's time, eager and compiled.

    python benchmarks/deploy_latency.py --depth 2 --json benchmarks/results/deploy_latency_cpu.json

Ratios are measured interleaved (original, then each conversion, round after round; medians), so a machine's drift
hits every variant alike. `--depth` shortens the model (the ratio of whole models then weighs the patch embedding and
head a little more); the figures in docs/results/deploy.md say which depth they used.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import timm
import torch

from vca_patch import VCAConfig, patch_model
from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.macs import AttentionShape
from vca_patch.targets.vca.layer import VisualContrastAttention
from vca_patch.targets.vca.macs import vca_attention_macs

PATCH = 14  # DINOv2's patch: sizes are multiples of it
VARIANTS = {"vca": VCAConfig(), "vca_local11": VCAConfig(local_window=11)}


def dinov2_small(depth: int) -> torch.nn.Module:
    """DINOv2-S shapes (384 channels, 6 heads, 1 CLS token), random weights, any image size."""
    return timm.create_model(
        "vit_small_patch14_dinov2", pretrained=False, depth=depth, dynamic_img_size=True, num_classes=0
    ).eval()


def timed_rounds(calls: dict[str, Callable[[], Any]], rounds: int, min_time: float) -> dict[str, float]:
    """Median seconds per call of each entry, timed in interleaved rounds (each round runs every entry once, at
    least `min_time` seconds of calls each)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            runs, start = 0, time.perf_counter()
            while True:
                call()
                runs += 1
                elapsed = time.perf_counter() - start
                if elapsed >= min_time:
                    break
            samples[name].append(elapsed / runs)
    return {name: statistics.median(times) for name, times in samples.items()}


def prepared(module: torch.nn.Module, compiled: bool, *inputs: Any, warmup: int = 2, **kwargs: Any) -> Callable:
    """A call of `module` (compiled: `torch.compile(module, dynamic=False)`) on `inputs` under no_grad, run
    `warmup` times first (a compiled one compiles there)."""
    run = torch.compile(module, dynamic=False) if compiled else module

    def call() -> Any:
        with torch.no_grad():
            return run(*inputs, **kwargs)

    for _ in range(warmup + int(compiled)):
        call()
    return call


def model_ratios(args: argparse.Namespace) -> list[dict[str, Any]]:
    """For each size and mode: seconds of the original and each conversion, and their ratios."""
    original = dinov2_small(args.depth)
    models = {"original": original}
    for name, config in VARIANTS.items():
        models[name] = copy.deepcopy(original)
        patch_model(models[name], config)
    rows = []
    for size in args.sizes:
        x = torch.randn(1, 3, size, size)
        for mode in args.modes:
            run = {name: prepared(model, mode == "compiled", x) for name, model in models.items()}
            seconds = timed_rounds(run, args.rounds, args.min_time)
            ratios = {name: seconds[name] / seconds["original"] for name in VARIANTS}
            rows.append({"size": size, "tokens": 1 + (size // PATCH) ** 2, "mode": mode, "seconds": seconds,
                         "ratio": ratios})  # fmt: skip
            print(f"{size:5d} px {mode:9s} original {seconds['original'] * 1e3:8.1f} ms  "
                  + "  ".join(f"{n} {r:.2f}x" for n, r in ratios.items()), flush=True)  # fmt: skip
    return rows


def local_macs_share(side: int, kernel: int, channels: int = 384, contrast: int = 49, prefix: int = 1) -> float:
    """The local term's share of a VCA layer's multiply-adds: q/k/v/proj 4NC² plus VCA's registered count with and
    without the term (`vca_attention_macs`): what the term costs if every MAC ran equally fast."""
    shape = AttentionShape(prefix, (side, side), channels, 6)
    projections = 4 * shape.num_tokens * channels**2
    with_term = projections + vca_attention_macs(shape, contrast, local_window=kernel)
    return (with_term - projections - vca_attention_macs(shape, contrast)) / with_term


def local_share(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One VCA layer of DINOv2-S shapes without and with its local term (each of `args.kernels`): the term's share
    of the layer's time, (with - without) / with, per grid and mode, beside its share of the layer's MACs."""
    rows = []
    for side in args.grids:
        layout = TokenLayout(1, (side, side))
        x = torch.randn(1, 1 + side * side, 384)
        layers = {}
        for kernel in (0, *args.kernels):
            torch.manual_seed(0)
            layers[kernel] = VisualContrastAttention(384, 6, contrast_grid=(7, 7), layer_index=2, local_window=kernel)
            layers[kernel].eval()
        for mode in args.modes:
            run = {str(k): prepared(layer, mode == "compiled", x, layout=layout) for k, layer in layers.items()}
            seconds = timed_rounds(run, args.rounds, args.min_time)
            for kernel in args.kernels:
                share = (seconds[str(kernel)] - seconds["0"]) / seconds[str(kernel)]
                macs = local_macs_share(side, kernel)
                rows.append({"grid": [side, side], "kernel": kernel, "mode": mode, "seconds": seconds,
                             "local_share": share, "local_macs_share": macs})  # fmt: skip
                print(f"{side}x{side} grid k={kernel:<2d} {mode:9s} layer {seconds['0'] * 1e3:7.2f} ms, with the "
                      f"local term {seconds[str(kernel)] * 1e3:7.2f} ms: its share {share:.1%} (of the MACs "
                      f"{macs:.1%})", flush=True)  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[224, 518, 1036], help="square sizes in px")
    parser.add_argument("--grids", type=int, nargs="*", default=[16, 37], help="patch grids of the layer timing")
    parser.add_argument("--kernels", type=int, nargs="+", default=[7, 11], help="local windows of the layer timing")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--depth", type=int, default=12, help="blocks of the model (DINOv2-S has 12)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds of calls per variant and round")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if any(size % PATCH for size in args.sizes):
        parser.error(f"--sizes must be multiples of DINOv2's {PATCH} px patch")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    result = {
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "depth": args.depth,
        "models": model_ratios(args),
        "local_term": local_share(args),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
