"""What every layer needs to feed a model and read its output: input size, placement, probe batches, outputs."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def model_input_size(model: nn.Module) -> tuple[int, int, int]:
    """(C, H, W) the model expects: `vca_patch_input_size` when set (the CLI's --img-size for a model that takes
    any size), else from its pretrained config or patch embedding."""
    chosen = getattr(model, "vca_patch_input_size", None)
    if chosen is not None:
        return tuple(int(v) for v in chosen)
    cfg = getattr(model, "pretrained_cfg", None) or {}
    embed = getattr(model, "patch_embed", None)
    if embed is not None and getattr(embed, "img_size", None) is not None:
        chans = embed.proj.in_channels if hasattr(embed, "proj") else cfg.get("input_size", (3,))[0]
        return int(chans), int(embed.img_size[0]), int(embed.img_size[1])
    if "input_size" in cfg:
        return tuple(int(v) for v in cfg["input_size"])
    config = getattr(model, "config", None)  # transformers
    config = getattr(config, "vision_config", config)
    size = getattr(config, "image_size", None)
    if size:
        height, width = (size, size) if isinstance(size, int) else size
        return int(getattr(config, "num_channels", 3)), int(height), int(width)
    raise ValueError(f"cannot tell the input size of {type(model).__name__}")


def output_tensor(output: Any) -> torch.Tensor:
    """The main tensor of a model output: itself, or a transformers output's logits / pooled / last hidden state."""
    if isinstance(output, torch.Tensor):
        return output
    for name in ("logits", "logits_per_image", "pooler_output", "last_hidden_state"):
        value = getattr(output, name, None)
        if isinstance(value, torch.Tensor):
            return value
    raise TypeError(f"cannot find the output tensor in a {type(output).__name__}")


def model_placement(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """(device, floating dtype) of the model's first floating-point parameter or buffer (cpu/float32 without)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point():
            return tensor.device, tensor.dtype
    return torch.device("cpu"), torch.float32


def to_model(x: torch.Tensor, model: nn.Module) -> torch.Tensor:
    """Images `x` on the model's device and, when floating, in its parameter dtype."""
    device, dtype = model_placement(model)
    return x.to(device=device, dtype=dtype) if x.is_floating_point() else x.to(device)


def probe_batch(model: nn.Module, batch_size: int = 4, seed: int = 0) -> torch.Tensor:
    """A deterministic batch of standard-normal images of the model's input size, on its device and in its dtype.

    Drawn on the CPU from `seed` (the same images on every device), then moved."""
    generator = torch.Generator().manual_seed(seed)
    return to_model(torch.randn(batch_size, *model_input_size(model), generator=generator, device="cpu"), model)


@torch.no_grad()
def compare_outputs(reference: Any, candidate: Any) -> dict[str, Any]:
    """Relative error, mean per-sample cosine, max |Δ|, and top-1 agreement for class logits."""
    reference, candidate = output_tensor(reference), output_tensor(candidate)
    ref = reference.detach().double().flatten(1)
    cand = candidate.detach().to(ref.device).double().flatten(1)
    metrics: dict[str, Any] = {
        "relative_error": float((cand - ref).norm() / ref.norm().clamp_min(1e-30)),
        "cosine": float(F.cosine_similarity(ref, cand, dim=1).mean()),
        "max_abs_diff": float((cand - ref).abs().max()),
    }
    if reference.ndim == 2 and reference.shape[1] > 1:
        metrics["top1_agreement"] = float((ref.argmax(1) == cand.argmax(1)).double().mean())
    return metrics


def features_and_logits(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token features [B, N, C] (or pooled [B, C]) and class logits (None without a head), in one forward.

    timm: forward_features / forward_head; transformers: the last hidden state and the logits, if any.
    """
    if hasattr(model, "forward_features"):
        features = model.forward_features(x)
        has_head = getattr(model, "num_classes", 0) and hasattr(model, "forward_head")
        return features, model.forward_head(features) if has_head else None
    out = model(x, output_hidden_states=True) if type(model).__module__.startswith("transformers.") else model(x)
    if isinstance(out, torch.Tensor):
        return out, None
    features = getattr(out, "last_hidden_state", None)
    if features is None and getattr(out, "hidden_states", None):
        features = out.hidden_states[-1]
    return features, getattr(out, "logits", None)
