"""The GPU check: one command that tells whether VCA is right and fast on a CUDA GPU (under 6 minutes in all).

    python benchmarks/gpu_check.py                  # a CUDA machine (H100/H200): benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --output $OUT/gpu_check.json --budget 330
    python benchmarks/gpu_check.py --dry-run-cpu    # every section tiny on the CPU: tests the code, not the GPU
    python benchmarks/gpu_check.py --table FILE     # the Markdown summary (docs/results/gpu.md) of a written JSON

Sections (each runs in its own process under a time cap, its share of the budget that is left; one that fails or
runs out of time is recorded as "failed" or "timeout" with its error and whatever it measured so far, and the next
one runs). By default: bf16_fidelity, profile, deploy (recipe and timing when named in --sections).

  bf16_fidelity  a patched deit_small at 224 px (random weights) in float32, under bf16 autocast and with bf16
                 weights, against a float64 copy: output relative error and per-layer (free-running) errors, next
                 to the same numbers for the original softmax model; passes when VCA's bf16 errors are < 2e-2.
  recipe         calibration, attention transfer, distillation (vca_patch.train's recipe engine, bf16 autocast), a
                 few dozen steps on random images: losses, fidelity before/after, images/s.
  profile        torch.profiler over one forward of a 2-block DeiT-S (VCA and the original) at 224 and 1024 px:
                 top kernels by CUDA time, and which of them are flash-attention kernels.
  timing         original (timm's fused SDPA) / VCA eager / VCA torch.compile(dynamic=False, one compile per size) at
                 224, 512, 1024, 2048 px, 2-block DeiT-S: the first GPU run's table (the deploy section supersedes it).
  deploy         DINOv2-S shapes (vit_small_patch14_dinov2, 2 blocks, random weights, any image size): the original
                 (timm's fused SDPA) vs VCA, VCA + local term (k = 11) and MANO; eager / torch.compile(dynamic=True)
                 / the same with CUDA graphs (mode="reduce-overhead"), every model compiled the same way, one compile
                 serving every size (its seconds reported apart); bf16 autocast; 224 / 518 / 1036 / 2048 px. Per
                 row: CUDA events after warm-up, median, peak memory. Then the converted/original ratios, the token
                 count where each converted model overtakes its original (interpolated in log tokens between the
                 measured sizes), graph breaks (torch._dynamo.explain), the SDPA backend each model runs (flash /
                 cudnn / efficient / math, from the aten op SDPA dispatches to; FlexAttention kernels), and the
                 ONNX export (dynamic batch/height/width) in onnxruntime's CUDA provider, "skipped" with the reason
                 where onnxruntime-gpu is not installed. Each step records its own error and the next one runs.

Models have random weights (the GPU machine has no network). The JSON holds `meta` (versions, GPU) and one entry
per section: status ("ok", "failed", "timeout", "skipped"), seconds, cap_s, error, and the section's numbers; the
Markdown summary is printed at the end. Exit status 0 when every section is ok, 1 otherwise; 2 without a CUDA GPU
(unless --dry-run-cpu).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import gc
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
SECTIONS = ("bf16_fidelity", "recipe", "profile", "timing", "deploy")
DEFAULT_SECTIONS = ("bf16_fidelity", "profile", "deploy")  # recipe and timing: measured in the first run, on request
# a section's cap: its share of the budget left, among the sections still to run (an early finish passes its time on)
SHARES = {"bf16_fidelity": 30, "recipe": 40, "profile": 25, "timing": 120, "deploy": 275}
DEFAULT_BUDGET_S = 330.0
BF16_TOLERANCE = 2e-2  # relative output error of bf16 VCA against float64 (docs/gpu.md §7)


@dataclass
class Plan:
    """Sizes of every section: the GPU plan, or a tiny one for --dry-run-cpu."""

    device: str
    model: str = "deit_small_patch16_224"
    model_args: dict[str, Any] = field(default_factory=dict)
    fidelity_px: int = 224
    fidelity_batch: int = 8
    recipe_model_args: dict[str, Any] = field(default_factory=dict)
    recipe_px: int = 224
    recipe_batch: int = 32
    recipe_steps: int = 30  # per stage
    recipe_images: int = 512
    recipe_eval_images: int = 64
    bench_depth: int = 2
    profile_px: dict[int, int] = field(default_factory=lambda: {224: 8, 1024: 2})  # px -> batch
    timing_px: dict[int, int] = field(default_factory=lambda: {224: 64, 512: 16, 1024: 8, 2048: 4})
    warmup: int = 5
    repeats: int = 20
    compile_mode: str | None = None  # torch.compile mode (None: inductor's default)
    compile_backend: str = "inductor"
    compile_reserve_s: float = 40.0  # skip a compile with less time than this left (then 1.5x the last compile)
    mixed_precision: str = "bf16"
    min_repeats: int = 5  # timed calls per row, at least (deploy)
    row_seconds: float = 2.0  # timed calls per row: as many as fit (up to `repeats`) (deploy)
    # deploy: DINOv2-S shapes (width 384, 6 heads, patch 14) at `deploy_depth` blocks, random weights
    deploy_model: str = "vit_small_patch14_dinov2"
    deploy_depth: int = 2
    deploy_px: dict[int, int] = field(default_factory=lambda: {224: 32, 518: 8, 1036: 2, 2048: 2})  # px -> batch
    deploy_modes: tuple[str, ...] = ("eager", "compile", "cudagraphs")
    deploy_compiled: tuple[str, ...] = ("original", "vca", "vca_local11", "mano")  # by priority: the first two first
    deploy_onnx: tuple[str, ...] = ("vca", "original", "vca_local11", "mano")  # by priority, as above
    onnx_provider: str = "CUDAExecutionProvider"
    onnx_checks: tuple[tuple[int, int, int], ...] = ((2, 224, 224), (3, 518, 364))  # (batch, height, width)
    onnx_latency: tuple[int, int] = (8, 518)  # (batch, px)
    onnx_reserve_s: float = 30.0  # export, session, checks


def dry_run_plan() -> Plan:
    """Every section at toy size on the CPU (seconds): exercises the code paths, measures nothing useful."""
    tiny = {"depth": 2, "img_size": 64}
    return Plan(
        device="cpu", model="deit_tiny_patch16_224", model_args=tiny, fidelity_px=64, fidelity_batch=2,
        recipe_model_args=tiny, recipe_px=64, recipe_batch=4, recipe_steps=2, recipe_images=16, recipe_eval_images=4,
        bench_depth=1, profile_px={64: 1}, timing_px={48: 1, 64: 1},
        warmup=1, repeats=3, compile_backend="eager", compile_reserve_s=5.0, mixed_precision="no",
        min_repeats=3, row_seconds=0.2, deploy_px={28: 2, 42: 2, 56: 2}, deploy_compiled=("original", "vca"),
        deploy_onnx=("vca",), onnx_provider="CPUExecutionProvider", onnx_checks=((2, 28, 28), (3, 42, 56)),
        onnx_latency=(2, 42), onnx_reserve_s=5.0,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------- the sections


class Recorder:
    """A section's results so far, rewritten to `path` after each step: a killed section keeps what it measured."""

    def __init__(self, path: Path, deadline: float) -> None:
        self.path, self.deadline = path, deadline
        self.data: dict[str, Any] = {}

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def _relative_error(candidate, reference) -> float:
    candidate, reference = candidate.double(), reference.double().to(candidate.device)
    return float((candidate - reference).norm() / reference.norm().clamp_min(1e-30))


def _images(batch: int, px: int, device, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, px, px, generator=generator, device="cpu").to(device)


def _autocast(device, enabled: bool):
    import torch

    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def section_bf16_fidelity(rec: Recorder, plan: Plan) -> None:
    """bf16 VCA and bf16 softmax against float64 copies of themselves: whole output and per layer."""
    import torch

    device = torch.device(plan.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 is true float32
    try:
        _bf16_fidelity(rec, plan, device)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


def _bf16_fidelity(rec: Recorder, plan: Plan, device) -> None:
    import timm
    import torch

    from vca_patch import VCAConfig, patch_model
    from vca_patch.recovery.capture import patched_modules

    torch.manual_seed(0)
    original = timm.create_model(plan.model, pretrained=False, **plan.model_args).eval()
    patched = copy.deepcopy(original)
    patch_model(patched, VCAConfig())
    paths = list(patched_modules(patched))
    x = _images(plan.fidelity_batch, plan.fidelity_px, device)
    rec.data.update(model=plan.model, px=plan.fidelity_px, batch=plan.fidelity_batch, layers=paths)

    def run(model, inputs, autocast: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        outs: dict[str, torch.Tensor] = {}
        handles = [
            model.get_submodule(p).register_forward_hook(lambda m, a, o, p=p: outs.__setitem__(p, o)) for p in paths
        ]
        try:
            with torch.inference_mode(), _autocast(device, autocast):
                y = model(inputs)
        finally:
            for h in handles:
                h.remove()
        return y, [outs[p] for p in paths]

    for name, model in (("vca", patched), ("softmax", original)):
        ref_y, ref_layers = run(copy.deepcopy(model).to(device, torch.float64), x.double(), False)
        rows = {}
        for mode in ("float32", "autocast_bf16", "bf16_weights"):
            cast = copy.deepcopy(model).to(device, torch.bfloat16 if mode == "bf16_weights" else torch.float32)
            y, layers = run(cast, x.to(torch.bfloat16) if mode == "bf16_weights" else x, mode == "autocast_bf16")
            per_layer = [_relative_error(a, b) for a, b in zip(layers, ref_layers, strict=True)]
            rows[mode] = {
                "output_relative_error": _relative_error(y, ref_y),
                "layer_relative_error": per_layer,
                "max_layer_relative_error": max(per_layer),
            }
            del cast
        rec.data[name] = rows
        rec.flush()
    vca, soft = rec.data["vca"], rec.data["softmax"]
    rec.data["vca_over_softmax_output_error"] = {
        mode: vca[mode]["output_relative_error"] / max(soft[mode]["output_relative_error"], 1e-30)
        for mode in ("autocast_bf16", "bf16_weights")
    }
    rec.data["tolerance"] = BF16_TOLERANCE
    errors = {m: vca[m]["output_relative_error"] for m in ("autocast_bf16", "bf16_weights")}
    rec.data["passed"] = all(e < BF16_TOLERANCE for e in errors.values())
    if not rec.data["passed"]:
        raise AssertionError(f"bf16 VCA output relative error above {BF16_TOLERANCE}: {errors}")


def section_recipe(rec: Recorder, plan: Plan) -> None:
    """Calibration, attention transfer and distillation through the project's recipe engine, under bf16 autocast."""
    import timm
    import torch
    from torch.utils.data import TensorDataset

    from vca_patch import VCAConfig, patch_model
    from vca_patch.train import make_accelerator, recipe_from_dict, run_recipe, teacher_from

    torch.manual_seed(0)
    student = timm.create_model(plan.model, pretrained=False, num_classes=10, **plan.recipe_model_args)
    patch_model(student, VCAConfig())
    teacher = teacher_from(student)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(plan.recipe_images, 3, plan.recipe_px, plan.recipe_px, generator=generator)
    labels = torch.randint(0, 10, (plan.recipe_images,), generator=generator)
    train_set = TensorDataset(images, labels)
    eval_set = TensorDataset(images[: plan.recipe_eval_images], labels[: plan.recipe_eval_images])
    every = max(1, plan.recipe_steps // 3) if plan.recipe_steps >= 6 else plan.recipe_steps  # evaluations cost
    recipe = recipe_from_dict(
        {
            "name": "gpu-check",
            "stages": [
                {"name": "calibrate", "kind": "calibrate", "calibration_images": plan.recipe_eval_images},
                {"name": "transfer", "kind": "attention_transfer", "steps": plan.recipe_steps, "lr": 1e-3},
                {"name": "distill", "kind": "distill", "steps": plan.recipe_steps, "lr": 1e-3},
            ],
            "train": {
                "batch_size": plan.recipe_batch,
                "mixed_precision": plan.mixed_precision,
                "eval_every": every,
                "eval_images": plan.recipe_eval_images,
                "checkpoint_every": 10**6,
                "log_every": every,
            },
        },
        "gpu-check recipe",
    )
    accelerator = make_accelerator(plan.mixed_precision, cpu=plan.device == "cpu")
    rec.data.update(model=plan.model, px=plan.recipe_px, batch=plan.recipe_batch, steps_per_stage=plan.recipe_steps)
    rec.data["mixed_precision"] = str(getattr(accelerator, "mixed_precision", plan.mixed_precision))
    rec.flush()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-recipe-") as out:
        result = run_recipe(
            student, teacher, recipe, out, train_set=train_set, eval_set=eval_set, accelerator=accelerator,
            num_classes=10,
        )  # fmt: skip
    seconds = time.monotonic() - start
    metrics = result.metrics
    evaluations = metrics.get("evaluations", [])
    losses = {
        stage: [e["loss"] for e in evaluations if e.get("stage") == stage and "loss" in e]
        for stage in ("transfer", "distill")
    }
    keep = ("mean_layer_error", "max_layer_error", "cls_cosine", "patch_cosine", "top1_agreement")
    rec.data.update(
        recipe_status=metrics.get("status"),
        run_seconds=seconds,
        images_per_s=2 * plan.recipe_steps * plan.recipe_batch / seconds,
        losses=losses,
        before={k: v for k, v in metrics.get("before", {}).items() if k in keep},
        after={k: v for k, v in metrics.get("final", {}).items() if k in keep},
        device=metrics.get("device"),
    )
    rec.data["transfer_loss_decreased"] = bool(losses["transfer"]) and losses["transfer"][-1] < losses["transfer"][0]
    finite = all(math.isfinite(v) for values in losses.values() for v in values) and all(losses.values())
    rec.data["losses_finite"] = finite
    if metrics.get("status") != "completed" or not finite:
        raise AssertionError(f"recipe status {metrics.get('status')!r}, losses {losses}")


def _bench_variants(plan: Plan):
    """(original with fused SDPA, VCA) 2-block DeiT-S with one set of weights and a dynamic image size."""
    from vca_patch import VCAConfig
    from vca_patch.bench import ORIGINAL, build_variants

    variants = build_variants(plan.model, [VCAConfig()], model_args={"depth": plan.bench_depth}, unfused=False)
    by_name = {v.name: v.model for v in variants}
    return by_name[ORIGINAL], by_name["vca"]


def _top_events(prof, device, top: int = 15) -> list[dict[str, Any]]:
    """The `top` kernels (CUDA) or ops (CPU) by self time: name, self time in µs, calls."""

    def self_time(event) -> float:
        if device.type == "cuda":
            return float(getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0))
        return float(event.self_cpu_time_total)

    events = [e for e in prof.key_averages() if self_time(e) > 0]
    events.sort(key=self_time, reverse=True)
    return [{"name": e.key, "self_time_us": self_time(e), "calls": int(e.count)} for e in events[:top]]


def section_profile(rec: Recorder, plan: Plan) -> None:
    """One profiled forward per model and resolution (after warm-up): top kernels, flash-attention kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(plan.device)
    original, vca = _bench_variants(plan)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for px, batch in plan.profile_px.items():
        x = _images(batch, px, device)
        for name, model in (("vca", vca), ("original", original)):
            if rec.time_left() < 5:
                rec.data.setdefault("skipped", []).append(f"{name}@{px}")
                continue
            model.to(device)
            with torch.inference_mode(), _autocast(device, device.type == "cuda"):
                for _ in range(2):
                    model(x)
                _synchronize(device)
                with profile(activities=activities) as prof:
                    model(x)
                    _synchronize(device)
            top = _top_events(prof, device)
            all_kernels = _top_events(prof, device, top=10**6)
            rec.data[f"{name}@{px}"] = {
                "batch": batch,
                "time_unit": "us of CUDA time" if device.type == "cuda" else "us of CPU time",
                "total_self_time_us": sum(e["self_time_us"] for e in all_kernels),
                "distinct_kernels": len(all_kernels),
                "kernel_launches": sum(e["calls"] for e in all_kernels),
                "flash_kernels": sorted({e["name"] for e in all_kernels if "flash" in e["name"].lower()}),
                "top": top,
            }
            rec.flush()


def _timer(device) -> Callable[[Callable[[], object]], float]:
    """Milliseconds of one call: CUDA events on a GPU, perf_counter on the CPU."""
    import torch

    if device.type == "cuda":

        def timed(fn: Callable[[], object]) -> float:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        return timed

    def timed_cpu(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return timed_cpu


def section_timing(rec: Recorder, plan: Plan) -> None:
    """Original SDPA / VCA eager / VCA compiled per resolution: median ms, images/s, peak memory, ratios."""
    import torch

    device = torch.device(plan.device)
    original, vca = _bench_variants(plan)
    original.to(device)
    vca.to(device)
    timed = _timer(device)
    rec.data.update(model=plan.model, depth=plan.bench_depth, compile_mode=plan.compile_mode or "default")
    rec.data["compile_backend"] = plan.compile_backend
    rec.data["results"], rec.data["skipped"] = [], []
    for px, batch in plan.timing_px.items():
        x = _images(batch, px, device)
        torch._dynamo.reset()  # static shapes: a fresh compile per resolution, no recompile limit
        compiled = torch.compile(vca, mode=plan.compile_mode, backend=plan.compile_backend, dynamic=False)
        row: dict[str, Any] = {"px": px, "batch": batch, "tokens": 1 + (px // 16) ** 2}
        for name, model in (("original_sdpa", original), ("vca_eager", vca), ("vca_compile", compiled)):
            need = plan.compile_reserve_s if name == "vca_compile" else 3.0
            if rec.time_left() < need:
                rec.data["skipped"].append(f"{name}@{px} ({rec.time_left():.0f} s left)")
                continue

            def call(model=model, x=x) -> object:
                with torch.inference_mode(), _autocast(device, device.type == "cuda"):
                    return model(x)

            first = time.monotonic()
            call()  # compilation, cuDNN/cuBLAS heuristics: not latency
            _synchronize(device)
            first_s = time.monotonic() - first
            for _ in range(plan.warmup):
                call()
            _synchronize(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times = [timed(call) for _ in range(plan.repeats)]
            median = statistics.median(times)
            row[name] = {
                "median_ms": median,
                "min_ms": min(times),
                "images_per_s": batch / (median / 1e3),
                "first_call_s": first_s,
                "peak_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
            }
        base = row.get("original_sdpa", {}).get("median_ms")
        for name in ("vca_eager", "vca_compile"):
            if base and name in row:
                row[f"{name}_over_original"] = row[name]["median_ms"] / base
        rec.data["results"].append(row)
        rec.flush()
        del compiled


# ----------------------------------------------------------------------------------------------- the deploy section

DEPLOY_CONFIGS = {"vca": {}, "vca_local11": {"local_window": 11}}  # + MANO with its defaults
SDPA_BACKENDS = {  # the aten op SDPA dispatches to -> the backend's name
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
FLASH_BACKENDS = ("flash", "flash (CPU)", "cudnn")  # cuDNN's SDPA is a flash-attention kernel too
ATTENTION_WORDS = ("flash", "fmha", "cudnn", "sdpa", "attention", "attn", "flex", "triton_tem")


def _deploy_variants(plan: Plan) -> tuple[list[tuple[str, Any]], dict[str, str]]:
    """([(name, model)], {name: error}): the original (timm's fused SDPA) and VCA, VCA + local term (k = 11) and
    MANO made from the same random weights; a conversion that fails is left out with its error. `dynamic_img_pad`
    pads the image to the next patch multiple inside the model: any size runs (2048 px too), and timm's
    divisibility assert, which pins the height under torch.compile (a recompile per size), is off."""
    import timm

    from vca_patch import MANOConfig, VCAConfig, patch_model

    base = timm.create_model(
        plan.deploy_model, pretrained=False, depth=plan.deploy_depth, dynamic_img_size=True, dynamic_img_pad=True,
        num_classes=0,
    ).eval()  # fmt: skip
    configs = {name: VCAConfig(**options) for name, options in DEPLOY_CONFIGS.items()} | {"mano": MANOConfig()}
    variants, errors = [("original", base)], {}
    for name, config in configs.items():
        model = copy.deepcopy(base)
        try:
            patch_model(model, config)
        except Exception as exc:  # recorded; the other variants still run
            errors[f"{name} conversion"] = f"{type(exc).__name__}: {exc}"[:1500]
            continue
        variants.append((name, model.eval()))
    return variants, errors


def _tokens(model, px: int) -> int:
    """Tokens per image at `px` (the patch grid after padding, plus CLS and register tokens)."""
    patch = model.patch_embed.patch_size[0]
    return math.ceil(px / patch) ** 2 + int(getattr(model, "num_prefix_tokens", 1))


def _attention_backends(runner, x, device) -> dict[str, Any]:
    """Which attention kernels one forward runs: SDPA calls per backend (flash / cudnn / efficient / math, from the
    aten op SDPA dispatched to), FlexAttention launches, and the attention-like kernel names."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode(), _autocast(device, device.type == "cuda"):
        runner(x)  # warm: a compiled runner's first call is not what we profile
        _synchronize(device)
        with profile(activities=activities) as prof:
            runner(x)
            _synchronize(device)
    events = {e.key: int(e.count) for e in prof.key_averages()}
    backends: dict[str, int] = {}
    for key, count in events.items():
        if key in SDPA_BACKENDS:
            backends[SDPA_BACKENDS[key]] = backends.get(SDPA_BACKENDS[key], 0) + count
    kernels = sorted(k[:160] for k in events if k not in SDPA_BACKENDS and any(w in k.lower() for w in ATTENTION_WORDS))
    flex = sum(count for key, count in events.items() if "flex" in key.lower())
    return {
        "backends": backends,
        "flex_events": flex,
        "flash": any(b in backends for b in FLASH_BACKENDS),
        "math_fallback": "math" in backends,
        "kernels": kernels[:16],
    }


def _graph_breaks(model, x, device) -> dict[str, Any]:
    """torch._dynamo.explain over one forward (bf16 autocast on CUDA): graph breaks, graphs and the first reasons."""
    import torch

    torch._dynamo.reset()
    with torch.no_grad(), _autocast(device, device.type == "cuda"):
        explained = torch._dynamo.explain(model)(x)
    torch._dynamo.reset()
    reasons = [str(getattr(r, "reason", r))[:300] for r in explained.break_reasons[:3]]
    return {"graph_breaks": explained.graph_break_count, "graphs": explained.graph_count, "reasons": reasons}


def _compiled(model, mode: str, plan: Plan):
    """`model` as the mode runs it: eager, torch.compile(dynamic=True) (one compile for every size), or the same
    with CUDA graphs (mode="reduce-overhead": one graph recorded per input shape)."""
    import torch

    if mode == "eager":
        return model
    torch_mode = "reduce-overhead" if mode == "cudagraphs" else plan.compile_mode
    return torch.compile(model, dynamic=True, mode=torch_mode, backend=plan.compile_backend)


def _counter(group: str, key: str) -> int:
    from torch._dynamo.utils import counters

    return int(counters[group].get(key, 0))


def _deploy_row(plan: Plan, name: str, mode: str, runner, size: tuple[int, int, int], device) -> dict[str, Any]:
    """One (variant, mode, size), bf16 autocast on CUDA: the first call's seconds (compiling, recording a CUDA graph)
    and the frames dynamo compiled for it, then warm-up and the median of the timed calls (CUDA events), and the
    peak memory allocated during them (and what was resident before)."""
    import torch

    px, batch, tokens = size
    timed = _timer(device)
    x = _images(batch, px, device)
    mark_step = getattr(torch.compiler, "cudagraph_mark_step_begin", None) if mode == "cudagraphs" else None

    def call() -> object:
        if mark_step is not None:
            mark_step()  # a new inference step: the previous outputs may be overwritten
        with torch.inference_mode(), _autocast(device, device.type == "cuda"):
            return runner(x)

    frames, skips = _counter("frames", "ok"), _counter("inductor", "cudagraph_skips")
    start = time.monotonic()
    call()
    _synchronize(device)
    first_s = time.monotonic() - start
    estimate_ms = max(timed(call), 1e-3)  # a CUDA-graph runner records here
    repeats = int(min(plan.repeats, max(plan.min_repeats, plan.row_seconds * 1e3 // estimate_ms)))
    for _ in range(max(2 if mode == "cudagraphs" else 1, min(plan.warmup, repeats // 4))):
        call()
    _synchronize(device)
    resident = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed(call) for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {"variant": name, "mode": mode, "px": px, "batch": batch, "tokens": tokens,
            "first_call_s": round(first_s, 3), "compiled_frames": _counter("frames", "ok") - frames,
            "cudagraph_skips": _counter("inductor", "cudagraph_skips") - skips, "median_ms": statistics.median(times),
            "min_ms": min(times), "repeats": repeats, "peak_mib": peak, "resident_mib": resident}  # fmt: skip


def _crossover(points: list[tuple[int, float]]) -> dict[str, Any]:
    """The token count where a converted/original latency ratio first falls to 1, interpolated in log(tokens)
    between the two measured sizes around it: {"tokens": N or None, "how": ...}."""
    points = sorted(points)
    if not points:
        return {"tokens": None, "how": "not measured"}
    if points[0][1] <= 1:
        return {"tokens": None, "how": f"faster already at the smallest size measured ({points[0][0]} tokens)"}
    for (n1, r1), (n2, r2) in itertools.pairwise(points):
        if r1 > 1 >= r2:
            share = (r1 - 1) / (r1 - r2)
            tokens = math.exp(math.log(n1) + share * (math.log(n2) - math.log(n1)))
            return {"tokens": round(tokens), "how": f"interpolated in log(tokens) between {n1} and {n2} tokens"}
    return {"tokens": None, "how": f"slower at every size measured (up to {points[-1][0]} tokens)"}


def _deploy_ratios(rows: list[dict]) -> tuple[list[dict], dict[str, dict]]:
    """converted/original median latency per (variant, mode, size), and each (variant, mode)'s crossover."""
    base = {(r["mode"], r["px"]): r["median_ms"] for r in rows if r["variant"] == "original"}
    ratios = [
        {"variant": r["variant"], "mode": r["mode"], "px": r["px"], "tokens": r["tokens"],
         "ratio": r["median_ms"] / base[r["mode"], r["px"]]}
        for r in rows if r["variant"] != "original" and (r["mode"], r["px"]) in base
    ]  # fmt: skip
    groups: dict[str, list[tuple[int, float]]] = {}
    for r in ratios:
        groups.setdefault(f"{r['variant']} {r['mode']}", []).append((r["tokens"], r["ratio"]))
    return ratios, {key: _crossover(points) for key, points in groups.items()}


def _sized_images(batch: int, height: int, width: int, seed: int = 0):
    import torch

    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))


def _onnx_program(model, plan: Plan, path: Path) -> None:
    """`model` (a float32 CPU copy) through torch.export with dynamic batch, height and width (multiples of the
    patch), then torch.onnx.export(dynamo=True), saved to `path`."""
    import torch

    patch = model.patch_embed.patch_size[0]
    batch = torch.export.Dim("batch", min=1, max=1024)
    rows, cols = torch.export.Dim("rows", min=2, max=512), torch.export.Dim("cols", min=2, max=512)
    b, h, w = plan.onnx_checks[0]
    example = _sized_images(b, h, w)
    with torch.no_grad():
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch, 2: patch * rows, 3: patch * cols},))
        onnx_program = torch.onnx.export(
            program, (example,), dynamo=True, input_names=["images"], output_names=["features"], verbose=False
        )
    onnx_program.save(str(path), external_data=False)


def _onnx_session(plan: Plan) -> tuple[Any, dict[str, Any] | None]:
    """(onnxruntime, None), or (None, a skipped entry with the reason) where the provider or exporter is missing."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None, {"status": "skipped", "reason": "onnxruntime-gpu not installed (no onnxruntime at all)"}
    if plan.onnx_provider == "CUDAExecutionProvider" and hasattr(ort, "preload_dlls"):
        with contextlib.suppress(Exception):  # CUDA/cuDNN from the nvidia wheels torch uses; absent: no harm
            ort.preload_dlls()
    available = ort.get_available_providers()
    if plan.onnx_provider not in available:
        reason = f"onnxruntime-gpu not installed (onnxruntime {ort.__version__} offers {available})"
        return None, {"status": "skipped", "reason": reason}
    try:
        import onnxscript  # noqa: F401  (torch's dynamo ONNX exporter needs it)
    except ImportError:
        return None, {"status": "skipped", "reason": "onnxscript not installed (torch.onnx.export(dynamo=True))"}
    return ort, None


def _onnx_check(model, plan: Plan, device) -> dict[str, Any]:
    """The model exported to ONNX (dynamic batch/height/width) in onnxruntime's `plan.onnx_provider`: relative and
    max error against eager float32 (TF32 off) at each size of `plan.onnx_checks`, and the latency of both at
    `plan.onnx_latency`, timed alike (host arrays in and out, copies included)."""
    import torch

    ort, skipped = _onnx_session(plan)
    if skipped:
        return skipped
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpu-check-onnx-") as tmp:
        path = Path(tmp) / "model.onnx"
        _onnx_program(copy.deepcopy(model).float().cpu().eval(), plan, path)
        export_s = time.monotonic() - start
        session = ort.InferenceSession(str(path), providers=[plan.onnx_provider])
    if plan.onnx_provider not in session.get_providers():
        reason = f"{plan.onnx_provider} did not load; onnxruntime fell back to {session.get_providers()}"
        return {"status": "skipped", "export_s": export_s, "reason": reason}

    def run_onnx(x):
        return torch.from_numpy(session.run(None, {"images": x.numpy()})[0])

    def run_eager(x):
        with torch.inference_mode():
            return model(x.to(device)).float().cpu()

    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        checks = []
        for seed, (b, h, w) in enumerate(plan.onnx_checks):
            x = _sized_images(b, h, w, seed)
            got, ref = run_onnx(x), run_eager(x)
            checks.append({"batch": b, "height": h, "width": w, "relative_error": _relative_error(got, ref),
                           "max_abs_error": float((got - ref).abs().max())})  # fmt: skip
        b, px = plan.onnx_latency
        x = _sized_images(b, px, px)
        latency = {name: _wall_ms(fn, x, plan) for name, fn in (("onnx", run_onnx), ("eager_fp32", run_eager))}
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    return {"status": "ok", "provider": plan.onnx_provider, "export_s": round(export_s, 2), "checks": checks,
            "max_relative_error": max(c["relative_error"] for c in checks), "latency_batch": b, "latency_px": px,
            "onnx_median_ms": latency["onnx"], "eager_fp32_median_ms": latency["eager_fp32"]}  # fmt: skip


def _wall_ms(fn, x, plan: Plan) -> float:
    """Median wall-clock ms of fn(x) after warm-up (host input and output: copies included)."""
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(max(plan.min_repeats, plan.repeats // 2)):
        start = time.perf_counter()
        fn(x)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


class _Deploy:
    """The deploy section's steps over one set of variants; each step records its error and the next one runs."""

    def __init__(self, rec: Recorder, plan: Plan, device) -> None:
        self.rec, self.plan, self.device = rec, plan, device
        variants, errors = _deploy_variants(plan)
        self.variants = {name: model.to(device) for name, model in variants}
        self.compile_reserve_s, self.longest_compile_s = plan.compile_reserve_s, 0.0
        first = next(iter(self.variants.values()))
        rec.data.update(
            model=plan.deploy_model, depth=plan.deploy_depth, variants=list(self.variants),
            modes=list(plan.deploy_modes),
            sizes={str(px): {"batch": b, "tokens": _tokens(first, px)} for px, b in plan.deploy_px.items()},
            compile_backend=plan.compile_backend, compile_mode=plan.compile_mode or "default", dynamic=True,
            rows=[], ratios=[], crossover={}, graph_breaks={}, attention={}, onnx={}, errors=errors, skipped=[],
        )  # fmt: skip

    def step(self, label: str, fn: Callable[[], None], reserve_s: float = 5.0) -> None:
        """Run fn unless fewer than `reserve_s` seconds are left (then record it as skipped); record its error."""
        import torch

        left = self.rec.time_left()
        if left < reserve_s:
            self.rec.data["skipped"].append(f"{label}: {left:.0f} s left, needs ~{reserve_s:.0f} s")
        else:
            start = time.monotonic()
            try:
                fn()
            except Exception as exc:  # recorded; the next step still runs
                self.rec.data["errors"][label] = f"{type(exc).__name__}: {exc}"[:1500]
                self.rec.data.setdefault("tracebacks", {})[label] = traceback.format_exc(limit=6)[-2500:]
                torch._dynamo.reset()
            self.rec.data.setdefault("step_seconds", {})[label] = round(time.monotonic() - start, 2)
        self.rec.flush()

    def add_row(self, row: dict[str, Any]) -> None:
        self.rec.data["rows"].append(row)
        self.rec.data["ratios"], self.rec.data["crossover"] = _deploy_ratios(self.rec.data["rows"])
        self.rec.flush()

    def measure(self, name: str, mode: str) -> None:
        """Every size for one (variant, mode): one compile (dynamic shapes) serves them all; after the compiled
        mode's rows, the attention kernels the compiled model runs."""
        import torch

        torch._dynamo.reset()
        runner = _compiled(self.variants[name], mode, self.plan)
        for px, batch in self.plan.deploy_px.items():
            if self.rec.time_left() < 5:
                self.rec.data["skipped"].append(f"{name} {mode} {px} px: out of time")
                break
            size = (px, batch, self.rec.data["sizes"][str(px)]["tokens"])
            row = _deploy_row(self.plan, name, mode, runner, size, self.device)
            self.add_row(row)
            if mode != "eager" and px == min(self.plan.deploy_px):  # the compile: the next one needs about as long
                self.longest_compile_s = max(self.longest_compile_s, row["first_call_s"])
                self.compile_reserve_s = max(self.plan.compile_reserve_s / 2, 1.5 * self.longest_compile_s)
        if mode == "compile":
            x = _images(2, min(self.plan.deploy_px), self.device)
            self.rec.data["attention"][f"{name} compile"] = _attention_backends(runner, x, self.device)
        del runner
        torch._dynamo.reset()
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def compiled(self, names: list[str]) -> None:
        for name in names:
            for mode in self.plan.deploy_modes:
                if mode == "eager":
                    continue
                if mode == "cudagraphs" and self.device.type != "cuda":
                    if "cudagraphs: CUDA graphs need a CUDA device" not in self.rec.data["skipped"]:
                        self.rec.data["skipped"].append("cudagraphs: CUDA graphs need a CUDA device")
                    continue
                run = functools.partial(self.measure, name, mode)
                self.step(f"{name} {mode}", run, self.compile_reserve_s)

    def onnx(self, names: list[str]) -> None:
        for name in names:

            def check(name: str = name) -> None:
                self.rec.data["onnx"][name] = _onnx_check(self.variants[name], self.plan, self.device)

            self.step(f"{name} onnx", check, self.plan.onnx_reserve_s)


def section_deploy(rec: Recorder, plan: Plan) -> None:
    """DINOv2-S shapes: original vs VCA, VCA + local term and MANO in eager, compiled and CUDA-graph form (both
    compiled the same way) at 224 to 2048 px; graph breaks, attention backends, crossovers, ONNX in onnxruntime.
    Order: what is cheap and sure first (eager, graph breaks, kernels), then the compiles by priority."""
    import torch

    device = torch.device(plan.device)
    deploy = _Deploy(rec, plan, device)
    small, large = min(plan.deploy_px), max(plan.deploy_px)
    for name in deploy.variants:
        deploy.step(f"{name} eager", lambda name=name: deploy.measure(name, "eager"))
    for name, model in deploy.variants.items():

        def explain(name: str = name, model=model) -> None:
            rec.data["graph_breaks"][name] = _graph_breaks(model, _images(2, small, device), device)

        deploy.step(f"{name} graph breaks", explain)
    for name, model in deploy.variants.items():

        def kernels(name: str = name, model=model) -> None:
            for px in (small, large):
                x = _images(plan.deploy_px[px], px, device)
                rec.data["attention"][f"{name} eager {px}px"] = _attention_backends(model, x, device)

        deploy.step(f"{name} attention", kernels)
    compiled = [name for name in plan.deploy_compiled if name in deploy.variants]
    exported = [name for name in plan.deploy_onnx if name in deploy.variants]
    deploy.compiled(compiled[:2])
    deploy.onnx(exported[:2])
    deploy.compiled(compiled[2:])
    deploy.onnx(exported[2:])
    if rec.data["errors"]:
        raise RuntimeError(f"{len(rec.data['errors'])} deploy step(s) failed: {', '.join(rec.data['errors'])}")


# ----------------------------------------------------------------------------------------------- the summary


def _backends_text(entry: dict[str, Any] | None) -> str:
    """'flash 2, efficient 2 + Flex 4' from an attention entry; '—' where not measured."""
    if not entry:
        return "—"
    text = ", ".join(f"{name} {count}" for name, count in sorted(entry["backends"].items())) or "no SDPA"
    return text + (f" + Flex {entry['flex_events']}" if entry.get("flex_events") else "")


def _latency_cell(row: dict[str, Any] | None, ratio: float | None) -> str:
    if row is None:
        return "—"
    return f"{row['median_ms']:.2f}" + (f" ({ratio:.2f}×)" if ratio else "")


def _crossover_text(cross: dict[str, Any] | None) -> str:
    if cross is None:
        return "—"
    return f"~{cross['tokens']} tokens" if cross["tokens"] else cross["how"]


def deploy_table(section: dict[str, Any]) -> str:
    """The deploy section's latency as Markdown: median ms per size (converted/original ratio in brackets, both
    run the same way), the crossover, the compile seconds and the peak memory at the largest size."""
    sizes = sorted(int(px) for px in section.get("sizes", {})) or sorted({r["px"] for r in section.get("rows", [])})
    info = section.get("sizes", {})
    rows = {(r["variant"], r["mode"], r["px"]): r for r in section.get("rows", [])}
    ratios = {(r["variant"], r["mode"], r["px"]): r["ratio"] for r in section.get("ratios", [])}
    head = " | ".join(f"{px} px, {info.get(str(px), {}).get('tokens', '?')} tok (ms)" for px in sizes)
    lines = [
        f"| model | mode | {head} | overtakes the original at | compile s | peak MiB at {max(sizes, default='?')} px |",
        "|---|---|" + "---|" * (len(sizes) + 3),
    ]
    for mode in section.get("modes", []):
        for variant in section.get("variants", []):
            measured = [rows.get((variant, mode, px)) for px in sizes]
            if not any(measured):
                continue
            cells = [
                _latency_cell(row, ratios.get((variant, mode, px))) for px, row in zip(sizes, measured, strict=True)
            ]
            first = next(r for r in measured if r)
            compile_s = f"{first['first_call_s']:.1f}" if mode != "eager" else "—"
            peak = measured[-1]["peak_mib"] if measured[-1] else None
            cells += [
                _crossover_text(section.get("crossover", {}).get(f"{variant} {mode}")),
                compile_s,
                "—" if peak is None else f"{peak:.0f}",
            ]
            lines.append(f"| {variant} | {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _onnx_text(onnx: dict[str, Any] | None) -> str:
    if onnx is None:
        return "—"
    if onnx["status"] != "ok":
        return f"skipped: {onnx['reason']}"
    return (
        f"rel. error {onnx['max_relative_error']:.1e}; {onnx['onnx_median_ms']:.1f} ms vs eager fp32 "
        f"{onnx['eager_fp32_median_ms']:.1f} ms (batch {onnx['latency_batch']}, {onnx['latency_px']} px)"
    )


def deploy_facts(section: dict[str, Any]) -> str:
    """Graph breaks, the attention backends each model runs (eager at the smallest and largest size, compiled) and
    the ONNX model in onnxruntime, as Markdown; then what was skipped or failed."""
    sizes = sorted(int(px) for px in section.get("sizes", {}))
    attention = section.get("attention", {})
    lines = [
        "| model | graph breaks | attention, eager (smallest / largest px) | attention, compiled | ONNX, onnxruntime |",
        "|---|---|---|---|---|",
    ]
    for variant in section.get("variants", []):
        breaks = section.get("graph_breaks", {}).get(variant, {}).get("graph_breaks", "—")
        eager = " / ".join(_backends_text(attention.get(f"{variant} eager {px}px")) for px in sizes[:1] + sizes[-1:])
        compiled = _backends_text(attention.get(f"{variant} compile"))
        lines.append(
            f"| {variant} | {breaks} | {eager} | {compiled} | {_onnx_text(section.get('onnx', {}).get(variant))} |"
        )
    notes = [f"- skipped: {s}" for s in section.get("skipped", [])]
    notes += [f"- failed: {label}: {error.splitlines()[0][:200]}" for label, error in section.get("errors", {}).items()]
    return "\n".join(lines + (["", *notes] if notes else []))


def _fidelity_line(fid: dict[str, Any]) -> str:
    vca, soft = fid["vca"], fid.get("softmax", {})
    cells = []
    for mode in ("float32", "autocast_bf16", "bf16_weights"):
        if mode in vca and mode in soft:
            cells.append(f"{mode} {vca[mode]['output_relative_error']:.2e} / {soft[mode]['output_relative_error']:.2e}")
    return "- bf16 fidelity (relative output error against float64, VCA / original): " + ", ".join(cells)


def _other_sections(sections: dict[str, Any]) -> list[str]:
    """One line for each of the other sections that measured something."""
    lines = []
    if sections.get("bf16_fidelity", {}).get("vca"):
        lines.append(_fidelity_line(sections["bf16_fidelity"]))
    recipe = sections.get("recipe", {})
    if recipe.get("after") and recipe.get("before"):
        before, after = (recipe[k].get("cls_cosine", math.nan) for k in ("before", "after"))
        lines.append(
            f"- recipe under bf16: {recipe.get('recipe_status')}, {recipe.get('images_per_s', 0):.0f} images/s, "
            f"CLS cosine to the original {before:.4f} -> {after:.4f}"
        )
    launches = [
        f"{k} {v['kernel_launches']}"
        for k, v in sections.get("profile", {}).items()
        if isinstance(v, dict) and "kernel_launches" in v
    ]
    if launches:
        lines.append("- profile (kernel launches per forward): " + ", ".join(launches))
    return lines


def summary_markdown(result: dict[str, Any]) -> str:
    """The run as docs/results/gpu.md shows it: the device and versions, each section's status, the deploy tables."""
    meta, sections = result.get("meta", {}), result.get("sections", {})
    device = meta.get("gpu") or ("CPU dry run" if meta.get("dry_run_cpu") else meta.get("device", "?"))
    versions = ", ".join(f"{k} {meta.get(k)}" for k in ("torch", "timm", "triton", "onnxruntime"))
    status = ", ".join(f"{name} {s['status']} ({s['seconds']:.0f} s)" for name, s in sections.items())
    lines = [
        f"**{device}**, {versions}; {str(meta.get('started', '?'))[:10]}, {meta.get('total_seconds', '?')} s in all.",
        "",
        f"Sections: {status}.",
    ]
    deploy = sections.get("deploy", {})
    if deploy.get("rows"):
        lines += ["", deploy_table(deploy), "", deploy_facts(deploy)]
    other = _other_sections(sections)
    return "\n".join(lines + (["", *other] if other else []))


SECTION_FUNCS: dict[str, Callable[[Recorder, Plan], None]] = {
    "bf16_fidelity": section_bf16_fidelity,
    "recipe": section_recipe,
    "profile": section_profile,
    "timing": section_timing,
    "deploy": section_deploy,
}


def make_plan(dry_run: bool, compile_mode: str | None) -> Plan:
    return dry_run_plan() if dry_run else Plan(device="cuda", compile_mode=compile_mode)


def run_child(name: str, result_path: Path, cap_s: float, dry_run: bool, compile_mode: str | None) -> int:
    """Run one section in this process; its numbers (and status/error) go to `result_path` as JSON."""
    import torch

    from vca_patch.targets.vca import fused_cpu

    plan = make_plan(dry_run, compile_mode)
    rec = Recorder(result_path, time.monotonic() + 0.85 * cap_s - 3.0)  # cooperative deadline, before the hard cap
    if dry_run:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    try:
        with fused_cpu.use_kernel(False):  # the composite path: no C++ kernel build (a CPU-only kernel) in a check
            SECTION_FUNCS[name](rec, plan)
        rec.data["status"] = "ok"
    except Exception as exc:  # recorded, not raised: the next section still runs
        rec.data["status"] = "failed"
        rec.data["error"] = f"{type(exc).__name__}: {exc}"
        rec.data["traceback"] = traceback.format_exc(limit=8)[-4000:]
    rec.flush()
    return 0


# ----------------------------------------------------------------------------------------------- the driver


def environment(device: str) -> dict[str, Any]:
    """Versions, the GPU, and the attention backends torch will pick."""
    import timm
    import torch

    import vca_patch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "timm": timm.__version__,
        "vca_patch": vca_patch.__version__,
        "device": device,
        "host_cpus": os.cpu_count(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    try:
        import onnxruntime

        env.update(onnxruntime=onnxruntime.__version__, onnxruntime_providers=onnxruntime.get_available_providers())
    except ImportError:
        env.update(onnxruntime=None, onnxruntime_providers=[])
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu=props.name,
            capability=f"{props.major}.{props.minor}",
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            bf16_supported=torch.cuda.is_bf16_supported(),
            flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
            mem_efficient_sdp_enabled=torch.backends.cuda.mem_efficient_sdp_enabled(),
            cudnn_sdp_enabled=torch.backends.cuda.cudnn_sdp_enabled(),
        )
    return env


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def run_section(
    name: str, cap_s: float, dry_run: bool, compile_mode: str | None, in_process: bool = False
) -> dict[str, Any]:
    """One section in a subprocess, killed at `cap_s` (in_process: here, with only the cooperative deadline):
    {status, seconds, cap_s, error?, ...its numbers}."""
    with tempfile.TemporaryDirectory(prefix=f"gpu-check-{name}-") as tmp:
        result_path = Path(tmp) / "result.json"
        if in_process:
            start = time.monotonic()
            run_child(name, result_path, cap_s, dry_run, compile_mode)
            data = json.loads(result_path.read_text())
            return {"status": data.pop("status"), "seconds": round(time.monotonic() - start, 2), "cap_s": cap_s,
                    "error": None, **data}  # fmt: skip
        cmd = [sys.executable, str(Path(__file__).resolve()), "--_section", name, "--_result", str(result_path)]
        cmd += ["--_cap", str(cap_s)] + (["--dry-run-cpu"] if dry_run else [])
        cmd += ["--compile-mode", compile_mode] if compile_mode else []
        start = time.monotonic()
        status, error = None, None
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cap_s)
            if proc.returncode != 0:
                status = "failed"
                error = f"section process exited with {proc.returncode}: {proc.stderr.strip()[-2000:]}"
        except subprocess.TimeoutExpired:
            status, error = "timeout", f"killed at its {cap_s:.0f} s cap; numbers below are what it finished"
        seconds = time.monotonic() - start
        data = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if status is not None:
        data["status"] = status
        data["error"] = f"{error}; {data['error']}" if data.get("error") else error
    data.setdefault("status", "failed")
    data.setdefault("error", None if data["status"] == "ok" else "the section wrote no result")
    return {"status": data.pop("status"), "seconds": round(seconds, 2), "cap_s": cap_s, **data}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, help="JSON file (default: benchmarks/results/gpu_check.json)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="total seconds for all sections")
    parser.add_argument(
        "--sections", default=",".join(DEFAULT_SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}"
    )
    parser.add_argument("--table", type=Path, help="print the Markdown summary of a JSON this script wrote, and exit")
    parser.add_argument(
        "--dry-run-cpu",
        action="store_true",
        help="every section at toy size on the CPU (tests the script; writes gpu_check_cpu_dry_run.json)",
    )
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode for VCA (default: inductor's)")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the sections in this process (faster start; caps are then only checked between steps)",
    )
    parser.add_argument("--_section", help=argparse.SUPPRESS)
    parser.add_argument("--_result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--_cap", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args._section:
        return run_child(args._section, args._result, args._cap, args.dry_run_cpu, args.compile_mode)
    if args.table:
        print(summary_markdown(json.loads(args.table.read_text())))
        return 0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown or not sections:
        parser.error(f"--sections: unknown {unknown}; choose from {', '.join(SECTIONS)}")

    import torch

    if not args.dry_run_cpu and not torch.cuda.is_available():
        build = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        print(
            f"gpu_check: needs a CUDA GPU; found none (torch {torch.__version__}, {build}). "
            "Run it on a CUDA machine, or pass --dry-run-cpu to exercise every section on the CPU.",
            file=sys.stderr,
        )
        return 2
    default_name = "gpu_check_cpu_dry_run.json" if args.dry_run_cpu else "gpu_check.json"
    output = args.output or RESULTS / default_name
    started = time.monotonic()
    result: dict[str, Any] = {
        "meta": {
            **environment("cpu" if args.dry_run_cpu else "cuda"),
            "dry_run_cpu": args.dry_run_cpu,
            "plan": asdict(make_plan(args.dry_run_cpu, args.compile_mode)),
            "budget_s": args.budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        },
        "sections": {},
    }
    _write_json(output, result)
    for index, name in enumerate(sections):
        left = args.budget - (time.monotonic() - started)
        cap = left * SHARES[name] / sum(SHARES[n] for n in sections[index:])
        if cap < 10:
            entry = {"status": "skipped", "seconds": 0.0, "cap_s": cap, "error": f"budget spent ({left:.0f} s left)"}
        else:
            print(f"gpu_check: {name} (cap {cap:.0f} s)...", file=sys.stderr, flush=True)
            entry = run_section(name, cap, args.dry_run_cpu, args.compile_mode, args.in_process)
        result["sections"][name] = entry
        result["meta"]["total_seconds"] = round(time.monotonic() - started, 2)
        _write_json(output, result)
        print(f"gpu_check: {name}: {entry['status']} in {entry['seconds']:.1f} s"
              + (f" ({entry['error'].splitlines()[0][:200]})" if entry.get("error") else ""),
              file=sys.stderr, flush=True)  # fmt: skip
    result["ok"] = all(s["status"] == "ok" for s in result["sections"].values())
    _write_json(output, result)
    print(summary_markdown(result))
    print(f"gpu_check: wrote {output} ({'all ok' if result['ok'] else 'NOT all ok'})", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
