"""The GPU check: one command that tells whether VCA is right and fast on a CUDA GPU (each section under 6 minutes).

    python benchmarks/gpu_check.py                  # a CUDA machine (H100/H200): benchmarks/results/gpu_check.json
    python benchmarks/gpu_check.py --output $OUT/gpu_check.json --budget 330
    python benchmarks/gpu_check.py --dry-run-cpu    # every section tiny on the CPU: tests the code, not the GPU

Sections (each runs in its own process under a time cap; one that fails or runs out of time is recorded as
"failed" or "timeout" with its error and whatever it measured so far, and the next one runs):

  bf16_fidelity  a patched deit_small at 224 px (random weights) in float32, under bf16 autocast and with bf16
                 weights, against a float64 copy: output relative error and per-layer (free-running) errors, next
                 to the same numbers for the original softmax model; passes when VCA's bf16 errors are < 2e-2.
  recipe         calibration, attention transfer, distillation (vca_patch.train's recipe engine, bf16 autocast), a
                 few dozen steps on random images: losses, fidelity before/after, images/s.
  profile        torch.profiler over one forward of a 2-block DeiT-S (VCA and the original) at 224 and 1024 px:
                 top kernels by CUDA time, and which of them are flash-attention kernels.
  timing         original (timm's fused SDPA) / VCA eager / VCA torch.compile at 224, 512, 1024, 2048 px, 2-block
                 DeiT-S, batch 64 to 4, bf16 autocast: CUDA events, warm-up, median of >= 20 runs, peak memory.

  deploy         DINOv2-S shapes (2 blocks, random weights): the original (timm's fused SDPA) vs VCA, VCA + local
                 term (k = 11) and MANO, eager / torch.compile(dynamic=True) / the same with CUDA graphs
                 ("reduce-overhead"), bf16 autocast, 224 / 518 / 1036 / 2044 px: median ms, peak memory, the
                 converted/original ratios (both compiled the same way) and the token count where each converted
                 model overtakes the original; graph breaks (torch._dynamo.explain), the attention kernels each
                 launches, and the exported ONNX model in onnxruntime's CUDA provider when installed.
                 `--sections deploy` runs it alone in about 5 minutes.

Models have random weights (the GPU machine has no network). The JSON holds `meta` (versions, GPU) and one entry
per section: status ("ok", "failed", "timeout", "skipped"), seconds, cap_s, error, and the section's numbers.
Exit status 0 when every section is ok, 1 otherwise; 2 without a CUDA GPU (unless --dry-run-cpu).
"""

from __future__ import annotations

import argparse
import copy
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
# caps sum to 600 s for every section; `--sections deploy --budget 300` is the 5-minute deployment check
CAPS_S = {"bf16_fidelity": 45, "recipe": 90, "profile": 45, "timing": 120, "deploy": 300}
DEFAULT_BUDGET_S = 600.0
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
    compile_reserve_s: float = 40.0  # skip a compile with less time than this left
    mixed_precision: str = "bf16"
    # deploy: DINOv2-S shapes (width 384, 6 heads, patch 14) at `deploy_depth` blocks, random weights
    deploy_model: str = "vit_small_patch14_dinov2"
    deploy_depth: int = 2
    deploy_px: dict[int, int] = field(default_factory=lambda: {224: 32, 518: 8, 1036: 2, 2044: 2})  # px (x14) -> batch
    deploy_modes: tuple[str, ...] = ("eager", "compile", "cudagraphs")
    deploy_compiled: tuple[str, ...] = ("original", "vca", "vca_local11")  # MANO: eager only (compile time)


def dry_run_plan() -> Plan:
    """Every section at toy size on the CPU (seconds): exercises the code paths, measures nothing useful."""
    tiny = {"depth": 2, "img_size": 64}
    return Plan(
        device="cpu", model="deit_tiny_patch16_224", model_args=tiny, fidelity_px=64, fidelity_batch=2,
        recipe_model_args=tiny, recipe_px=64, recipe_batch=4, recipe_steps=2, recipe_images=16, recipe_eval_images=4,
        bench_depth=1, profile_px={64: 1}, timing_px={48: 1, 64: 1},
        warmup=1, repeats=3, compile_backend="eager", compile_reserve_s=5.0, mixed_precision="no",
        deploy_px={28: 2, 42: 2}, deploy_compiled=("original", "vca"),
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


DEPLOY_CONFIGS = {"vca": {}, "vca_local11": {"local_window": 11}}


def _deploy_variants(plan: Plan) -> list[tuple[str, Any]]:
    """[(name, model)]: the original (timm's fused SDPA) and VCA, VCA + local term (k = 11) and MANO made from the
    same random weights, every one taking any image size."""
    import copy

    import timm

    from vca_patch import MANOConfig, VCAConfig, patch_model

    base = timm.create_model(
        plan.deploy_model, pretrained=False, depth=plan.deploy_depth, dynamic_img_size=True, num_classes=0
    ).eval()
    variants = [("original", base)]
    configs = {name: VCAConfig(**options) for name, options in DEPLOY_CONFIGS.items()} | {"mano": MANOConfig()}
    for name, config in configs.items():
        model = copy.deepcopy(base)
        patch_model(model, config)
        variants.append((name, model.eval()))
    return variants


def _attention_kernels(model, x, device) -> list[str]:
    """Names of the attention kernels one forward launches (flash / cuDNN / memory-efficient / math SDPA, Flex)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.inference_mode(), _autocast(device, device.type == "cuda"), profile(activities=activities) as prof:
        model(x)
        _synchronize(device)
    words = ("flash", "fmha", "cudnn", "attention", "efficient", "flex")
    return sorted({e.key for e in prof.key_averages() if any(w in e.key.lower() for w in words)})


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
            return {"tokens": round(tokens), "how": f"interpolated between {n1} and {n2} tokens"}
    return {"tokens": None, "how": f"slower at every size measured (up to {points[-1][0]} tokens)"}


def _onnx_gpu(model, plan: Plan, device) -> dict[str, Any]:
    """The converted model exported to ONNX (dynamic batch and size) and run by onnxruntime's CUDA provider:
    error against eager float32 and latency; skipped, with the reason, where that provider is not installed."""
    try:
        import onnxruntime as ort
    except ImportError:
        return {"status": "skipped", "reason": "onnxruntime is not installed"}
    providers = ort.get_available_providers()
    if device.type != "cuda" or "CUDAExecutionProvider" not in providers:
        return {"status": "skipped", "reason": f"onnxruntime {ort.__version__} has no CUDA provider ({providers})"}
    import tempfile

    import torch

    from vca_patch.export.api import export_model

    px = min(plan.deploy_px)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export_model(model.float().cpu(), path, format="onnx", dynamic=True, img_size=px)
        session = ort.InferenceSession(str(path), providers=["CUDAExecutionProvider"])
        x = _images(2, px, torch.device("cpu"))
        with torch.inference_mode():
            expected = model(x)
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
        times = []
        for _ in range(plan.repeats):
            start = time.perf_counter()
            session.run(None, {session.get_inputs()[0].name: x.numpy()})
            times.append((time.perf_counter() - start) * 1e3)
    return {"status": "ok", "px": px, "batch": 2, "max_abs_error": float((got - expected).abs().max()),
            "median_ms": statistics.median(times), "providers": session.get_providers()}  # fmt: skip


def _compiled(model, mode: str, plan: Plan):
    """`model` as the mode runs it: eager, torch.compile(dynamic=True), or the same with CUDA graphs."""
    import torch

    if mode == "eager":
        return model
    torch_mode = "reduce-overhead" if mode == "cudagraphs" else plan.compile_mode
    return torch.compile(model, dynamic=True, mode=torch_mode, backend=plan.compile_backend)


def _deploy_row(rec: Recorder, plan: Plan, name: str, mode: str, runner, px: int, batch: int, device) -> dict:
    """One (variant, mode, size): first-call seconds (compiling), median ms over the repeats, peak memory."""
    import torch

    timed = _timer(device)
    x = _images(batch, px, device)

    def call() -> object:
        with torch.inference_mode(), _autocast(device, device.type == "cuda"):
            return runner(x)

    start = time.monotonic()
    call()
    _synchronize(device)
    first_s = time.monotonic() - start
    for _ in range(plan.warmup):
        call()
    _synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = [timed(call) for _ in range(plan.repeats)]
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    tokens = (px // 14) ** 2 + 1
    return {"variant": name, "mode": mode, "px": px, "batch": batch, "tokens": tokens, "first_call_s": first_s,
            "median_ms": statistics.median(times), "min_ms": min(times), "peak_mib": peak}  # fmt: skip


def section_deploy(rec: Recorder, plan: Plan) -> None:
    """DINOv2-S shapes: original vs VCA, VCA + local term and MANO in eager, compiled and CUDA-graph form (both
    compiled the same way) at 224 to 2044 px; graph breaks, the attention kernels, crossovers, ONNX on the GPU."""
    import torch

    device = torch.device(plan.device)
    variants = [(name, model.to(device)) for name, model in _deploy_variants(plan)]
    rec.data.update(model=plan.deploy_model, depth=plan.deploy_depth, modes=list(plan.deploy_modes), rows=[])
    x = _images(1, min(plan.deploy_px), device)
    rec.data["graph_breaks"] = {}
    for name, model in variants:
        with torch.no_grad(), _autocast(device, device.type == "cuda"):
            rec.data["graph_breaks"][name] = torch._dynamo.explain(model)(x).graph_break_count
        torch._dynamo.reset()
    rec.data["attention_kernels"] = {name: _attention_kernels(model, x, device) for name, model in variants[:2]}
    rec.flush()
    for mode in plan.deploy_modes:
        if mode == "cudagraphs" and device.type != "cuda":
            rec.data.setdefault("skipped", []).append("cudagraphs: CUDA graphs need a CUDA device")
            continue
        for name, model in variants:
            if mode != "eager" and name not in plan.deploy_compiled:
                continue
            if mode != "eager" and rec.time_left() < plan.compile_reserve_s:
                rec.data.setdefault("skipped", []).append(f"{name} {mode}: {rec.time_left():.0f} s left")
                continue
            torch._dynamo.reset()
            runner = _compiled(model, mode, plan)
            for px, batch in plan.deploy_px.items():
                if rec.time_left() < 5:
                    rec.data.setdefault("skipped", []).append(f"{name} {mode} {px} px: out of time")
                    break
                rec.data["rows"].append(_deploy_row(rec, plan, name, mode, runner, px, batch, device))
                rec.flush()
    rec.data["ratios"], rec.data["crossover"] = _deploy_ratios(rec.data["rows"])
    rec.flush()
    if rec.time_left() > 20:
        rec.data["onnx_gpu"] = _onnx_gpu(copy.deepcopy(variants[1][1]), plan, device)
    rec.flush()


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


def deploy_table(section: dict[str, Any]) -> str:
    """The deploy section as a Markdown table: converted/original latency per size, one row per variant and mode."""
    sizes = sorted({r["px"] for r in section.get("ratios", [])})
    lines = ["| model | mode | " + " | ".join(f"{px} px" for px in sizes) + " | crossover (tokens) |",
             "|---|---|" + "---|" * (len(sizes) + 1)]  # fmt: skip
    for key, cross in section.get("crossover", {}).items():
        variant, mode = key.split(" ")
        cells = {
            r["px"]: f"{r['ratio']:.2f}×" for r in section["ratios"] if r["variant"] == variant and r["mode"] == mode
        }
        tokens = cross["tokens"] if cross["tokens"] is not None else cross["how"]
        lines.append(f"| {variant} | {mode} | " + " | ".join(cells.get(px, "—") for px in sizes) + f" | {tokens} |")
    return "\n".join(lines)


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

    plan = make_plan(dry_run, compile_mode)
    rec = Recorder(result_path, time.monotonic() + 0.85 * cap_s - 3.0)  # cooperative deadline, before the hard cap
    if dry_run:
        from vca_patch.targets.vca import fused_cpu

        torch.set_num_threads(min(2, torch.get_num_threads()))
        context = fused_cpu.use_kernel(False)  # the composite path: no kernel build inside a dry run
    else:
        import contextlib

        context = contextlib.nullcontext()
    try:
        with context:
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
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
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
    for name in sections:
        left = args.budget - (time.monotonic() - started)
        cap = min(CAPS_S[name] * args.budget / DEFAULT_BUDGET_S, left)
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
    if "deploy" in result["sections"] and result["sections"]["deploy"].get("ratios"):
        print(deploy_table(result["sections"]["deploy"]))
    print(f"gpu_check: wrote {output} ({'all ok' if result['ok'] else 'NOT all ok'})", file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
