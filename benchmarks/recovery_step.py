"""One recovery step of DINOv2 ViT-S/14 with the local term, float32 against bf16 autocast, timed side by side.

    python benchmarks/recovery_step.py             # 8 crops at 224 px, k = 11 (the example's recovery step)
    python benchmarks/recovery_step.py --quick     # 2 crops at 112 px (tests)

A step is the forward + backward of `recipes/dinov2_small.yaml`'s distillation loss (student in train mode, the
frozen original as teacher), as the recipe engine runs it; float32 and bf16 autocast alternate round by round
(`bench.timing.time_interleaved`), so load drift hits both alike. The attention alone is timed too, at the layer's
shapes: PyTorch's SDPA in bf16 against the layers' `scaled_dot_product_attention` (float32 under CPU autocast).
Wall time and, on Linux, the share of CPU time the hypervisor stole during the run (a shared VM: ratios hold, seconds
do not). Random weights of the same architecture with --random (no download). Writes RESULTS/recovery_step[_quick].json.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import vca_patch
from vca_patch.attention.sdpa import scaled_dot_product_attention
from vca_patch.bench.timing import median, time_interleaved
from vca_patch.config import VCAConfig
from vca_patch.io.atomic import atomic_write_text
from vca_patch.train.engine import cpu_has_bf16_matrix_units
from vca_patch.train.objective import RecoveryObjective
from vca_patch.train.optim import stage_optimizer
from vca_patch.train.recipe import load_recipe

RESULTS = Path(__file__).parent / "results"
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "dinov2_small.yaml"
CPU = torch.device("cpu")


def cpu_ticks() -> tuple[int, int] | None:
    """(stolen, total) CPU ticks since boot from /proc/stat, None where there is none."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    return (fields[7] if len(fields) > 7 else 0), sum(fields)


def stolen_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    return (after[0] - before[0]) / (after[1] - before[1])


def models(size: int, local_window: int, random: bool) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(original, converted): DINOv2 ViT-S/14 at `size` px, real weights or (`random`) random ones."""
    if random:
        from transformers import Dinov2Config, Dinov2Model

        config = Dinov2Config(hidden_size=384, num_attention_heads=6, num_hidden_layers=12, image_size=size,
                              patch_size=14, layerscale_value=1.0)  # fmt: skip
        original = Dinov2Model(config).eval()
    else:
        from vca_patch.real_weights import load_dinov2_small

        original = load_dinov2_small("transformers")
    converted = copy.deepcopy(original)
    vca_patch.patch_model(converted, VCAConfig(local_window=local_window))
    return original, converted


def step_times(args: argparse.Namespace) -> dict[str, list[float]]:
    original, student = models(args.size, args.local_window, args.random)
    stage = load_recipe(RECIPE).stages[-1]
    stage_optimizer(student, stage)  # the stage's requires_grad flags, as the engine sets them
    objective = RecoveryObjective(student, original, stage)
    student.train()
    x = torch.randn(args.batch, 3, args.size, args.size, generator=torch.Generator().manual_seed(0))

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = objective(x)
        loss.backward()
        student.zero_grad(set_to_none=True)

    fns = {"float32": lambda: step(False), "bf16 autocast": lambda: step(True)}
    return time_interleaved(fns, CPU, repeats=args.repeats)


def attention_times(args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    """SDPA forward + backward at a VCA layer's shapes (B crops, 6 heads of 64): PyTorch's bf16 against ours."""
    grid, heads, d, n = args.size // 14, 6, 64, 49
    N = grid * grid + 1
    shapes = {"stage I (2n contrast queries)": (2 * n, N), "stage II (every token, 2n keys)": (N, 2 * n),
              "softmax (every token, every key)": (N, N)}  # fmt: skip
    out = {}
    for name, (L, S) in shapes.items():
        g = torch.Generator().manual_seed(L + S)
        q = torch.randn(args.batch, heads, L, d, generator=g).requires_grad_()
        k = torch.randn(args.batch, heads, S, d, generator=g).requires_grad_()
        v = torch.randn(args.batch, heads, S, d, generator=g).requires_grad_()

        def run(sdpa: Any, q=q, k=k, v=v) -> None:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                o = sdpa(q.bfloat16(), k.bfloat16(), v.bfloat16())
            o.float().sum().backward()

        fns = {"PyTorch SDPA in bf16": lambda run=run: run(F.scaled_dot_product_attention),
               "float32 SDPA (ours)": lambda run=run: run(scaled_dot_product_attention)}  # fmt: skip
        out[name] = time_interleaved(fns, CPU, repeats=max(5, args.repeats))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 crops at 112 px, 2 rounds")
    parser.add_argument("--random", action="store_true", help="random weights of the same architecture (offline)")
    parser.add_argument("--local-window", type=int, default=11)
    parser.add_argument("--repeats", type=int, help="timed rounds (5; quick 2)")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    args.size, args.batch = (112, 2) if args.quick else (224, 8)
    args.repeats = args.repeats or (2 if args.quick else 5)
    before = cpu_ticks()
    steps = step_times(args)
    attention = attention_times(args)
    stolen = stolen_share(before, cpu_ticks())
    step = {name: median(values) for name, values in steps.items()}
    result = {
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cpu": platform.processor() or platform.machine(),
        "bf16_matrix_units": cpu_has_bf16_matrix_units(),
        "threads": torch.get_num_threads(),
        "stolen_cpu_share": stolen,
        "step_seconds": step,
        "step_speedup_bf16": step["float32"] / step["bf16 autocast"],
        "attention_seconds": {name: {k: median(v) for k, v in t.items()} for name, t in attention.items()},
    }
    print(f"one recovery step, {args.batch} crops at {args.size} px, k = {args.local_window}, "
          f"{result['threads']} threads (AMX: {result['bf16_matrix_units']}):")  # fmt: skip
    for name, seconds in step.items():
        print(f"  {name:<16} {seconds:7.3f} s")
    print(f"  bf16 autocast runs a step {result['step_speedup_bf16']:.2f}x as fast as float32")
    print("attention forward + backward under bf16 autocast (median s; ratio):")
    for name, times in result["attention_seconds"].items():
        ours, theirs = times["float32 SDPA (ours)"], times["PyTorch SDPA in bf16"]
        print(f"  {name:<34} PyTorch bf16 {theirs:.4f}  ours {ours:.4f}  ({theirs / ours:.2f}x)")
    if stolen is not None:
        print(f"the hypervisor stole {100 * stolen:.0f}% of the CPU time during the run")
    args.results.mkdir(parents=True, exist_ok=True)
    name = "recovery_step_quick.json" if args.quick else "recovery_step.json"
    atomic_write_text(args.results / name, json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
