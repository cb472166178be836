"""Benchmark of a diffusion transformer (diffusers DiT shapes, random weights): original SDPA vs converted attention.

Sizes are image pixels: the latent is px/8 (the SD VAE), the tokens (px/8/p)² for patch size p, so DiT-XL/2 at 256,
512, 1024 and 2048 px runs 256, 1024, 4096 and 16384 tokens. One call is one denoising step (the transformer's
forward at one timestep, class-conditional). Times are interleaved medians (`bench.timing`); MACs are analytic:
per block 12·N·C² of token-wise linear layers (q/k/v/out and a 4× MLP) plus the attention (`bench.flops`).
"""

from __future__ import annotations

import copy
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from vca_patch.bench.crossover import crossover
from vca_patch.bench.errors import BenchError
from vca_patch.bench.flops import AttentionShape, attention_macs
from vca_patch.bench.kernels import cpu_kernel_status, use_cpu_kernels
from vca_patch.bench.memory import peak_mib
from vca_patch.bench.sweep import DTYPES
from vca_patch.bench.timing import median, time_interleaved
from vca_patch.core.install import install_hint
from vca_patch.surgery import patch_model
from vca_patch.targets.base import TargetConfig

VAE_FACTOR = 8
ORIGINAL = "original"


@dataclass(frozen=True)
class DiTShape:
    """A diffusers `DiTTransformer2DModel` configuration (random weights)."""

    heads: int
    head_dim: int
    patch_size: int
    depth: int
    in_channels: int = 4
    num_classes: int = 1000

    @property
    def dim(self) -> int:
        return self.heads * self.head_dim

    def tokens(self, px: int) -> int:
        side = px // VAE_FACTOR // self.patch_size
        return side * side


# Model names `vca-patch bench` accepts for diffusion transformers (DiT paper, Table 1 shapes).
DIFFUSION_MODELS = {
    "dit-xl-2": DiTShape(heads=16, head_dim=72, patch_size=2, depth=28),
    "dit-l-2": DiTShape(heads=16, head_dim=64, patch_size=2, depth=24),
    "dit-b-2": DiTShape(heads=12, head_dim=64, patch_size=2, depth=12),
    "dit-s-2": DiTShape(heads=6, head_dim=64, patch_size=2, depth=12),
}
DEFAULT_RESOLUTIONS = (256, 512, 1024, 2048)


def build_dit(shape: DiTShape, depth: int | None = None, seed: int = 0) -> nn.Module:
    """A random-weight diffusers DiT of `shape` (`depth` blocks), in eval mode."""
    try:
        import diffusers
    except ImportError as exc:
        raise BenchError(f"diffusion benchmarks need diffusers: {install_hint('diffusers')}") from exc
    torch.manual_seed(seed)
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=shape.heads, attention_head_dim=shape.head_dim, in_channels=shape.in_channels,
        out_channels=2 * shape.in_channels, num_layers=depth or shape.depth, sample_size=32,
        patch_size=shape.patch_size, num_embeds_ada_norm=shape.num_classes,
    ).eval()  # fmt: skip


def dit_macs(shape: DiTShape, px: int, depth: int, target: str = "softmax", config: Any = None) -> float:
    """Analytic MACs of one forward at `px` pixels: blocks' linear layers and attention (embedding, adaLN and the
    final layer are O(N·C) or O(C²) and left out)."""
    side = px // VAE_FACTOR // shape.patch_size
    layer = AttentionShape(0, (side, side), shape.dim, shape.heads)
    layers = getattr(config, "layers", None)
    total = 0.0
    for i in range(depth):
        patched = target != "softmax" and (layers is None or i in layers)
        total += 12.0 * layer.num_tokens * shape.dim**2
        total += attention_macs(target if patched else "softmax", layer, config)
    return total


@dataclass
class DiffusionBenchSettings:
    resolutions: list[int] = field(default_factory=lambda: list(DEFAULT_RESOLUTIONS))
    batch: int = 1
    device: str = "cpu"
    dtype: str = "float32"  # or bfloat16 / float16 autocast
    warmup: int = 1
    repeats: int = 3
    min_time: float = 0.0
    memory: bool = False  # peak inference memory (CPU: a live-tensor tracker, slow at large sizes)
    threads: int | None = None
    cpu_kernel: bool = True


def check_dit_resolutions(shape: DiTShape, resolutions: list[int]) -> None:
    """Every size a whole number of latent patches (multiples of 8·p pixels)."""
    step = VAE_FACTOR * shape.patch_size
    bad = [px for px in resolutions if px < step or px % step]
    if bad:
        raise BenchError(
            f"resolution(s) {', '.join(map(str, bad))} px are not a multiple of {step} (latent /{VAE_FACTOR}, patch "
            f"{shape.patch_size}); use e.g. {', '.join(str(max(step, round(px / step) * step)) for px in bad)}"
        )


def check_diffusion_bench(name: str, settings: DiffusionBenchSettings, depth: int | None) -> DiTShape:
    """The shape of `name`, or BenchError for an unknown name, a depth below 1, bad sizes or settings."""
    if name not in DIFFUSION_MODELS:
        raise BenchError(f"unknown diffusion model {name!r}; known: {', '.join(DIFFUSION_MODELS)}")
    if depth is not None and depth < 1:
        raise BenchError(f"depth must be at least 1 block, got {depth}")
    if settings.batch < 1 or settings.repeats < 1 or settings.warmup < 0 or settings.min_time < 0:
        raise BenchError("batch and repeats must be at least 1, warmup and min_time 0 or more")
    if settings.dtype not in DTYPES:
        raise BenchError(f"dtype must be one of {', '.join(DTYPES)}, got {settings.dtype!r}")
    shape = DIFFUSION_MODELS[name]
    check_dit_resolutions(shape, settings.resolutions)
    return shape


def _step(model: nn.Module, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, dtype: str) -> Callable[[], object]:
    autocast = dtype != "float32"

    def run() -> object:
        with torch.inference_mode(), torch.autocast(x.device.type, dtype=DTYPES[dtype], enabled=autocast):
            return model(x, timestep=t, class_labels=y).sample

    return run


def run_diffusion_bench(
    name: str,
    configs: list[TargetConfig],
    settings: DiffusionBenchSettings,
    depth: int | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Time `name` (a DIFFUSION_MODELS key) original and converted per target at each resolution; a JSON-safe result
    with per-size latencies, ratios to the original and the token count where each target becomes faster."""
    shape = check_diffusion_bench(name, settings, depth)
    blocks = depth or shape.depth
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    original = build_dit(shape, blocks).to(device)
    variants: dict[str, tuple[nn.Module, str, TargetConfig | None]] = {ORIGINAL: (original, "softmax", None)}
    for config in configs:
        patched = copy.deepcopy(original)
        patch_model(patched, config)
        variants[config.target] = (patched.eval(), config.target, config)
    rows: list[dict[str, Any]] = []
    with use_cpu_kernels(settings.cpu_kernel):
        for px in sorted(settings.resolutions):
            tokens = shape.tokens(px)
            side = px // VAE_FACTOR
            gen = torch.Generator().manual_seed(px)
            x = torch.randn(settings.batch, shape.in_channels, side, side, generator=gen).to(device)
            t = torch.full((settings.batch,), 500, device=device)
            y = torch.arange(settings.batch, device=device) % shape.num_classes
            runs = {v: _step(m, x, t, y, settings.dtype) for v, (m, _, _) in variants.items()}
            log(f"timing {px}px ({tokens} tokens): {', '.join(runs)}")
            timed = time_interleaved(
                runs, device, warmup=settings.warmup, repeats=settings.repeats, min_time=settings.min_time
            )
            for v, (_, target, config) in variants.items():
                row = {
                    "variant": v,
                    "resolution": px,
                    "latent": side,
                    "tokens": tokens,
                    "gmacs": dit_macs(shape, px, blocks, target, config) / 1e9,
                    "latency_ms": median(timed[v]) * 1e3,
                    "latency_ms_runs": [s * 1e3 for s in timed[v]],
                }
                if settings.memory:
                    row["memory_infer_mib"] = peak_mib(runs[v], device)
                rows.append(row)
    return _assemble(name, shape, blocks, variants, settings, rows)


def _assemble(name, shape, blocks, variants, settings, rows) -> dict[str, Any]:
    by = {(r["variant"], r["resolution"]): r for r in rows}
    ratios, crossovers = [], {}
    sizes = sorted(settings.resolutions)
    for v in variants:
        if v == ORIGINAL:
            continue
        mine = []
        for px in sizes:
            r, o = by[v, px], by[ORIGINAL, px]
            mine.append(
                {
                    "target": v,
                    "resolution": px,
                    "tokens": r["tokens"],
                    "latency_ratio": r["latency_ms"] / o["latency_ms"],
                    "flop_ratio": r["gmacs"] / o["gmacs"],
                }
            )
        ratios += mine
        tokens = [m["tokens"] for m in mine]
        crossovers[v] = {
            "latency_tokens": crossover(tokens, [m["latency_ratio"] for m in mine]),
            "flops_tokens": crossover(tokens, [m["flop_ratio"] for m in mine]),
        }
    return {
        "meta": {
            "model": name,
            "shape": asdict(shape),
            "depth": blocks,
            "settings": asdict(settings),
            "variants": {v: {"target": t, "config": c and c.to_dict()} for v, (_, t, c) in variants.items()},
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "cpu_count": os.cpu_count(),
            "loadavg_1_5_15": list(os.getloadavg()),
            **cpu_kernel_status(),  # "vca_cpu_kernel": ...
            "units": {"latency": "ms per denoising step (median)", "gmacs": "1e9 MACs per latent"},
        },
        "results": rows,
        "ratios": ratios,
        "crossover": crossovers,
    }


def crossover_text(result: dict[str, Any]) -> list[str]:
    """One line per target: where it becomes faster than the original (tokens and image pixels), or that it never
    does over the sweep, and where its MACs drop below the original's."""
    shape = DiTShape(**result["meta"]["shape"])
    lines = []
    for target, c in result["crossover"].items():
        flops = c["flops_tokens"]
        flops_text = f"MACs cross at ~{flops:,.0f} tokens" if flops is not None else "MACs never cross"
        tokens = c["latency_tokens"]
        if tokens is None:
            lines.append(f"{target}: slower than the original at every size measured; {flops_text}")
            continue
        first = min(r["tokens"] for r in result["ratios"] if r["target"] == target)
        if tokens <= first:
            where = f"already at the smallest size measured ({first:,} tokens)"
            lines.append(f"{target}: faster than the original {where}; {flops_text}")
            continue
        px = tokens**0.5 * shape.patch_size * VAE_FACTOR
        lines.append(f"{target}: faster than the original from ~{tokens:,.0f} tokens (~{px:,.0f} px); {flops_text}")
    return lines


def diffusion_table(result: dict[str, Any]) -> Any:
    """A rich table: per size the latent, tokens, each variant's latency and MACs, and its ratio to the original."""
    from rich.table import Table

    meta, s = result["meta"], result["meta"]["settings"]
    title = (
        f"{meta['model']} ({meta['depth']} blocks, random weights) · {s['device']} · {s['dtype']} · "
        f"batch {s['batch']} · {meta['threads']} threads · median of ≥ {s['repeats']} denoising steps"
    )
    table = Table(title=title, title_justify="left")
    for column in ("px", "latent", "tokens", "variant", "latency ms", "× original", "GMACs", "MACs ×"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    ratios = {(r["target"], r["resolution"]): r for r in result["ratios"]}
    previous = None
    for r in result["results"]:
        first = r["resolution"] != previous
        previous = r["resolution"]
        ratio = ratios.get((r["variant"], r["resolution"]))
        table.add_row(
            str(r["resolution"]) if first else "",
            f"{r['latent']}×{r['latent']}" if first else "",
            str(r["tokens"]) if first else "",
            r["variant"],
            f"{r['latency_ms']:.1f}",
            f"{ratio['latency_ratio']:.2f}" if ratio else "",
            f"{r['gmacs']:.1f}",
            f"{ratio['flop_ratio']:.2f}" if ratio else "",
        )
    return table
