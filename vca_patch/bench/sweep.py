"""A resolution sweep: interleaved latency, peak memory and analytic MACs of every variant."""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from vca_patch.bench.crossover import crossover
from vca_patch.bench.errors import BenchError
from vca_patch.bench.flops import ModelShape, model_macs, model_shape
from vca_patch.bench.kernels import cpu_kernel_status, use_cpu_kernels
from vca_patch.bench.memory import peak_mib
from vca_patch.bench.timing import median, time_interleaved
from vca_patch.bench.variants import ORIGINAL, UNFUSED, Variant

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class BenchSettings:
    resolutions: list[int]
    batch: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    warmup: int = 1
    repeats: int = 5  # timed rounds, at least
    min_time: float = 0.0  # more rounds until each variant has this many seconds timed (see time_interleaved)
    memory: bool = True  # peak memory of inference and of one training step
    unfused_max_tokens: int = 4200  # skip the explicit-softmax original above this (N² memory)
    # Skip the explicit-softmax original where its softmax tensors would pass this: one layer's logits and weights
    # (inference), or the weights every layer keeps for backward (a training step).
    unfused_max_mib: float = 4096
    threads: int | None = None
    compile: bool = False  # time torch.compile'd models (inductor, static shapes; memory stays eager)
    cpu_kernel: bool = True  # VCA's fused CPU kernel for float32 inference (False: its composite path)

    def __post_init__(self) -> None:
        checks = [
            (bool(self.resolutions) and min(self.resolutions) >= 1, "resolutions must be positive pixel sizes"),
            (self.batch >= 1, f"batch must be at least 1 image, got {self.batch}"),
            (self.repeats >= 1, f"repeats must be at least 1, got {self.repeats}"),
            (self.warmup >= 0, f"warmup must be 0 or more, got {self.warmup}"),
            (self.min_time >= 0, f"min_time must be 0 or more seconds, got {self.min_time}"),
            (self.threads is None or self.threads >= 1, f"threads must be at least 1, got {self.threads}"),
            (self.dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise BenchError(message)


def check_resolutions(shape: ModelShape, resolutions: list[int]) -> None:
    """Every resolution a whole number of patches (timm refuses others), with at least one patch."""
    ph, pw = shape.patch_size
    bad = [px for px in resolutions if px < max(ph, pw) or px % ph or px % pw]
    if bad:
        step = math.lcm(ph, pw)
        nearest = sorted({max(step, round(px / step) * step) for px in bad})
        raise BenchError(
            f"resolution(s) {', '.join(map(str, bad))} px are not a multiple of the patch size {ph}×{pw}; "
            f"use e.g. {', '.join(map(str, nearest))}"
        )


@dataclass
class Measurement:
    """One variant at one resolution. Times in ms, memory in MiB over the idle model, MACs per image."""

    variant: str
    resolution: int
    tokens: int
    gmacs: float
    latency_ms: float | None = None
    latency_ms_runs: list[float] = field(default_factory=list)
    throughput: float | None = None  # images / s
    memory_infer_mib: float | None = None
    memory_train_mib: float | None = None
    weight_grads_mib: float | None = None  # the gradients a training step leaves: a floor under memory_train_mib


@dataclass
class Ratio:
    """A target over the original (fused) at one resolution; `*_unfused` over the explicit-softmax original."""

    target: str
    resolution: int
    tokens: int
    flop_ratio: float
    latency_ratio: float | None
    latency_over_flop: float | None
    latency_ratio_unfused: float | None
    memory_infer_ratio: float | None
    memory_train_ratio: float | None
    # The least memory_train_ratio can be: the target's weight gradients alone over the original's whole step peak
    # (above 1 at small inputs, where the step's peak is mostly gradients and the target has more parameters).
    memory_train_floor_ratio: float | None
    memory_train_ratio_unfused: float | None  # what users of stacks without fused attention save in training


def _autocast(device: torch.device, dtype: str):
    if dtype == "float32":
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=DTYPES[dtype])


def _forward(model: torch.nn.Module, x: torch.Tensor, device: torch.device, dtype: str) -> Callable[[], object]:
    def run() -> object:
        with torch.inference_mode(), _autocast(device, dtype):
            return model(x)

    return run


def _train_step(model: torch.nn.Module, x: torch.Tensor, device: torch.device, dtype: str) -> Callable[[], object]:
    def run() -> object:
        model.zero_grad(set_to_none=True)
        with _autocast(device, dtype):
            loss = model(x).float().square().mean()
        loss.backward()
        return None

    return run


def _softmax_mib(shape, batch: int, tokens: int, count: int) -> float:
    """MiB of `count` float32 [batch, heads, N, N] tensors: what explicit softmax attention materialises."""
    return count * batch * shape.num_heads * tokens**2 * 4 / 2**20


def _gradient_mib(model: torch.nn.Module) -> float:
    """MiB of the parameter gradients a training step left (each storage once)."""
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()
                if p.grad is not None}  # fmt: skip
    return sum(storages.values()) / 2**20


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b <= 0 else a / b


def _divide_safely(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def run_sweep(variants: list[Variant], settings: BenchSettings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every variant at every resolution; return a JSON-safe result (meta, results, ratios, crossover)."""
    with use_cpu_kernels(settings.cpu_kernel):
        return _sweep(variants, settings, log)


def _sweep(variants: list[Variant], settings: BenchSettings, log: Callable[[str], None]) -> dict[str, Any]:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    shape = model_shape(variants[0].model)
    check_resolutions(shape, settings.resolutions)
    for v in variants:
        v.model.to(device)
    measurements: dict[tuple[str, int], Measurement] = {}

    def unfused_inference_mib(tokens: int) -> float:  # one layer's softmax logits and weights
        return _softmax_mib(shape, settings.batch, tokens, 2)

    def active(v: Variant, tokens: int) -> bool:
        if v.name != UNFUSED:
            return True
        return tokens <= settings.unfused_max_tokens and unfused_inference_mib(tokens) <= settings.unfused_max_mib

    inputs: dict[int, torch.Tensor] = {}
    for px in settings.resolutions:
        grid = shape.grid((px, px))
        tokens = shape.num_prefix_tokens + grid[0] * grid[1]
        gen = torch.Generator().manual_seed(px)
        x = torch.randn(settings.batch, shape.in_chans, px, px, generator=gen, device="cpu").to(device)
        inputs[px] = x
        for v in variants:
            gmacs = model_macs(shape, (px, px), v.target, v.config) / 1e9
            measurements[v.name, px] = Measurement(v.name, px, tokens, gmacs)
        if settings.compile:
            torch._dynamo.reset()  # static shapes: each resolution compiles anew, no recompile limit over a sweep
        models = {v.name: torch.compile(v.model, dynamic=False) if settings.compile else v.model for v in variants}
        runs = {v.name: _forward(models[v.name], x, device, settings.dtype) for v in variants if active(v, tokens)}
        log(f"timing {px}px ({tokens} tokens): {', '.join(runs)}")
        if any(v.name == UNFUSED for v in variants) and UNFUSED not in runs:
            softmax = unfused_inference_mib(tokens)
            log(f"  {UNFUSED} skipped at {px}px: {tokens} tokens, {softmax:,.0f} MiB of softmax logits and weights")
        warmup = max(settings.warmup, 1) if settings.compile else settings.warmup  # compilation is not latency
        timed = time_interleaved(runs, device, warmup=warmup, repeats=settings.repeats, min_time=settings.min_time)
        for name, times in timed.items():
            m = measurements[name, px]
            m.latency_ms_runs = [t * 1e3 for t in times]
            m.latency_ms = median(times) * 1e3
            m.throughput = settings.batch / median(times)

    if settings.memory:  # after all timing: the CPU tracker sees every op, so it must not run inside a timed call
        for px in settings.resolutions:
            x = inputs[px]
            for v in variants:
                m = measurements[v.name, px]
                if not active(v, m.tokens):
                    continue
                log(f"memory {px}px: {v.name}")
                infer = _forward(v.model, x, device, settings.dtype)
                infer()  # first-call allocations (kernel caches) are not per-call memory
                m.memory_infer_mib = peak_mib(infer, device)
                weights_mib = _softmax_mib(shape, settings.batch, m.tokens, shape.depth) if v.name == UNFUSED else 0.0
                if weights_mib > settings.unfused_max_mib:
                    log(f"memory {px}px: {v.name} training skipped (it would keep {weights_mib:,.0f} MiB of softmax)")
                    continue
                step = _train_step(v.model, x, device, settings.dtype)
                step()
                m.memory_train_mib = peak_mib(step, device)
                m.weight_grads_mib = _gradient_mib(v.model)
                v.model.zero_grad(set_to_none=True)
    return _assemble(variants, settings, measurements, shape)


def _assemble(variants, settings, measurements, shape) -> dict[str, Any]:
    ratios: list[Ratio] = []
    crossovers: dict[str, dict[str, float | None]] = {}
    for v in variants:
        if v.name in (ORIGINAL, UNFUSED):
            continue
        rows = []
        for px in settings.resolutions:
            t, o = measurements[v.name, px], measurements[ORIGINAL, px]
            u = measurements.get((UNFUSED, px))
            flop = t.gmacs / o.gmacs
            lat = _ratio(t.latency_ms, o.latency_ms)
            rows.append(
                Ratio(
                    v.name,
                    px,
                    t.tokens,
                    flop,
                    lat,
                    _divide_safely(lat, flop),
                    _ratio(t.latency_ms, u.latency_ms if u else None),
                    _ratio(t.memory_infer_mib, o.memory_infer_mib),
                    _ratio(t.memory_train_mib, o.memory_train_mib),
                    _ratio(t.weight_grads_mib, o.memory_train_mib),
                    _ratio(t.memory_train_mib, u.memory_train_mib if u else None),
                )
            )
        ratios += rows
        tokens = [r.tokens for r in rows]
        pixels = [r.resolution for r in rows]
        lat_tokens = crossover(tokens, [r.latency_ratio for r in rows])
        crossovers[v.name] = {
            "latency_tokens": lat_tokens,
            "latency_px": _tokens_to_px(lat_tokens, shape),
            "flops_tokens": crossover(tokens, [r.flop_ratio for r in rows]),
            "latency_px_interpolated": crossover(pixels, [r.latency_ratio for r in rows]),
        }
    return {
        "meta": _meta(variants, settings, shape),
        "results": [asdict(m) for m in measurements.values()],
        "ratios": [asdict(r) for r in ratios],
        "crossover": crossovers,
    }


def _tokens_to_px(tokens: float | None, shape) -> float | None:
    if tokens is None:
        return None
    return math.sqrt(max(tokens - shape.num_prefix_tokens, 0.0)) * shape.patch_size[0]


def malloc_setting() -> str:
    """How glibc backs large CPU tensors: "hugepages" (GLIBC_TUNABLES=glibc.malloc.hugetlb=1) or "default".

    Every tensor over 32 MiB is a fresh mmap that faults in 4 KiB pages on first touch; at 16k tokens the
    faults are a large, noisy share of the layers both models share. Transparent huge pages cut them ~3x.
    """
    return "hugepages" if "glibc.malloc.hugetlb=1" in os.environ.get("GLIBC_TUNABLES", "") else "default"


def _meta(variants, settings, shape) -> dict[str, Any]:
    import timm

    return {
        "settings": asdict(settings),
        "threads": torch.get_num_threads(),
        "model_shape": asdict(shape),
        "variants": {v.name: {"target": v.target, "config": v.config and v.config.to_dict()} for v in variants},
        "torch": torch.__version__,
        "timm": timm.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "loadavg_1_5_15": list(os.getloadavg()),  # other processes skew absolute times: check before quoting
        "malloc": malloc_setting(),
        **cpu_kernel_status(),  # "vca_cpu_kernel": "fused", or why VCA ran its composite path
        "units": {
            "latency": "ms (median)",
            "memory": "MiB of tensors allocated during the call, peak (CPU: live-tensor tracker; CUDA: allocator)",
            "gmacs": "1e9 MACs per image",
        },
    }
