"""LLaVA-SP's two training stages: which parameters train, LoRA on the language model, caption batches."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from vca_patch.targets.llava_sp.model import SpatialTokensError, get_spatial_projector, image_token_count, llava_core

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _projector(model: nn.Module) -> nn.Module:
    projector = get_spatial_projector(model)
    if projector is None:
        raise SpatialTokensError("the model has no spatial tokens; call add_spatial_tokens first")
    return projector


def stage1_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Stage 1 (image–caption alignment): freeze everything but the projector and its spatial tokens.

    Returns the trainable parameters (the original projector's and the new modules').
    """
    projector = _projector(model)
    for p in model.parameters():
        p.requires_grad_(False)
    params = list(projector.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


def apply_stage2_lora(
    model: nn.Module,
    *,
    r: int = 128,
    alpha: int = 256,
    dropout: float = 0.05,
    target_modules: Sequence[str] = LORA_TARGETS,
) -> nn.Module:
    """Stage 2 (instruction tuning): LoRA (peft) on the language model's linear layers only, the projector and
    spatial tokens trained in full. Returns the PEFT model; `merge_and_unload()` it before save_spatial_tokens."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise SpatialTokensError("stage 2 needs peft: pip install peft") from None
    _projector(model)
    names = "|".join(target_modules)
    lora = LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=rf".*language_model\..*\.({names})",  # never the vision tower's q/k/v
        bias="none",
    )
    peft_model = get_peft_model(model, lora)
    for p in _projector(peft_model).parameters():
        p.requires_grad_(True)
    return peft_model


def stage2_param_groups(model: nn.Module, lr: float, projector_lr: float) -> list[dict[str, Any]]:
    """Optimizer groups for stage 2: LoRA weights at `lr`, the projector and spatial tokens at `projector_lr`
    (the authors' mm_projector_lr group, which also holds the spatial modules)."""
    projector_ids = {id(p) for p in _projector(model).parameters()}
    lora = [p for p in model.parameters() if p.requires_grad and id(p) not in projector_ids]
    projector = [p for p in model.parameters() if id(p) in projector_ids]
    return [{"params": lora, "lr": lr}, {"params": projector, "lr": projector_lr}]


def caption_batch(model: nn.Module, captions: torch.Tensor, *, bos_token_id: int | None = None) -> dict[str, Any]:
    """input_ids / attention_mask / labels for [bos?, <image>×count, caption] prompts, loss on the caption only.

    `captions` is [B, T] token ids; the image-token count is the model's current one (spatial tokens included).
    """
    core = llava_core(model)
    count = image_token_count(model)
    batch = captions.shape[0]
    parts = [torch.full((batch, count), core.config.image_token_id, dtype=torch.long, device=captions.device)]
    if bos_token_id is not None:
        parts.insert(0, torch.full((batch, 1), bos_token_id, dtype=torch.long, device=captions.device))
    input_ids = torch.cat([*parts, captions], dim=1)
    labels = input_ids.clone()
    labels[:, : input_ids.shape[1] - captions.shape[1]] = -100
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}
