"""Final-token measurements of a conversion against its original: token cosines and interleaved latency ratios.

Used by the planner, `benchmarks/real_weights.py` and `examples/dinov2_real_weights.py`, so all report the same
numbers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.bench.timing import median, time_interleaved


def final_tokens(model: nn.Module, images: torch.Tensor) -> torch.Tensor:
    """The final (normed) token features [B, 1 + patches, C] of a timm ViT or a transformers Dinov2Model."""
    if hasattr(model, "forward_features"):
        return model.forward_features(images)
    return model(pixel_values=images).last_hidden_state


@torch.no_grad()
def tokens(model: nn.Module, images: torch.Tensor, batch: int) -> torch.Tensor:
    """Final token features [N, 1 + patches, C] (float64), in batches."""
    return torch.cat([final_tokens(model, images[i : i + batch]).double() for i in range(0, len(images), batch)])


def fidelity(reference: torch.Tensor, candidate: torch.Tensor, per_image: bool = False) -> dict[str, Any]:
    """Cosines to the original: CLS, each patch token (dense), the mean patch token; means/minima over images, and
    with `per_image` the CLS and patch-token cosine of each image ("cls_per_image", "patch_per_image")."""
    cls = F.cosine_similarity(reference[:, 0], candidate[:, 0], dim=-1)
    per_token = F.cosine_similarity(reference[:, 1:], candidate[:, 1:], dim=-1).mean(1)
    pooled = F.cosine_similarity(reference[:, 1:].mean(1), candidate[:, 1:].mean(1), dim=-1)
    scores: dict[str, Any] = {
        "cls_cosine": float(cls.mean()),
        "cls_cosine_min": float(cls.min()),
        "patch_token_cosine": float(per_token.mean()),
        "patch_token_cosine_min": float(per_token.min()),
        "mean_patch_cosine": float(pooled.mean()),
    }
    if per_image:
        scores |= {"cls_per_image": cls.tolist(), "patch_per_image": per_token.tolist()}
    return scores


@torch.no_grad()
def latency(
    models: dict[str, nn.Module],
    sizes: tuple[int, ...],
    repeats: int,
    log: Callable[[str], None] | None = None,
    min_time: float = 0.0,
) -> dict[str, dict[int, dict]]:
    """Batch-1 CPU inference latency (no autograd) per model and size, all models interleaved per size; ratio to the
    model 'original'. Each model runs `repeats` rounds at least, and more until it has `min_time` seconds timed (a
    62 ms model timed 3 times read 0.76x and 0.80x for one plan in one run; `bench.timing.time_interleaved`)."""
    if "original" not in models:
        raise ValueError(f"latency ratios need a model named 'original'; got {sorted(models)}")
    out: dict[str, dict[int, dict]] = {name: {} for name in models}
    for size in sizes:
        x = torch.randn(1, 3, size, size, generator=torch.Generator().manual_seed(size))
        fns = {name: (lambda m=m, x=x: final_tokens(m, x)) for name, m in models.items()}
        if log is not None:
            log(f"  latency at {size} px ({len(models)} models x {repeats} rounds, at least {min_time:g} s each)")
        times = time_interleaved(fns, torch.device("cpu"), warmup=1, repeats=repeats, min_time=min_time)
        base = median(times["original"])
        for name, samples in times.items():
            out[name][size] = {"ms": 1e3 * median(samples), "ratio": median(samples) / base, "samples": len(samples)}
    return out
