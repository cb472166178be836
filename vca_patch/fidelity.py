"""How far a converted model's outputs are from the original's."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def model_input_size(model: nn.Module) -> tuple[int, int, int]:
    """(C, H, W) the model expects, from its pretrained config or patch embedding."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    embed = getattr(model, "patch_embed", None)
    if embed is not None and getattr(embed, "img_size", None) is not None:
        chans = embed.proj.in_channels if hasattr(embed, "proj") else cfg.get("input_size", (3,))[0]
        return int(chans), int(embed.img_size[0]), int(embed.img_size[1])
    if "input_size" in cfg:
        return tuple(int(v) for v in cfg["input_size"])
    raise ValueError(f"cannot tell the input size of {type(model).__name__}")


def probe_batch(model: nn.Module, batch_size: int = 4, seed: int = 0) -> torch.Tensor:
    """A deterministic batch of standard-normal images of the model's input size."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch_size, *model_input_size(model), generator=generator)


@torch.no_grad()
def compare_outputs(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, Any]:
    """Relative error, mean per-sample cosine, max |Δ|, and top-1 agreement for class logits."""
    ref = reference.detach().double().flatten(1)
    cand = candidate.detach().double().flatten(1)
    metrics: dict[str, Any] = {
        "relative_error": float((cand - ref).norm() / ref.norm().clamp_min(1e-30)),
        "cosine": float(F.cosine_similarity(ref, cand, dim=1).mean()),
        "max_abs_diff": float((cand - ref).abs().max()),
    }
    if reference.ndim == 2 and reference.shape[1] > 1:
        metrics["top1_agreement"] = float((reference.argmax(1) == candidate.argmax(1)).double().mean())
    return metrics
