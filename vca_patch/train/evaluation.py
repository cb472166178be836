"""Fidelity of the student to the teacher on the eval set, sharded over processes and gathered per image.

The numbers are `vca_patch.eval.fidelity`'s (teacher-forced layer error, feature cosines, top-1): each process
computes per-image terms for its shard, `Accelerator.gather_for_metrics` collects them (dropping the
padding of the last uneven batch) and every process reduces the same tensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from vca_patch.core.model_io import features_and_logits
from vca_patch.recovery.capture import patched_modules
from vca_patch.train.forced import layer_outputs
from vca_patch.train.objective import per_image_error, recorded_layout, teacher_attention

EVAL_BATCH = 128


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


@torch.no_grad()
def image_terms(student: nn.Module, teacher: nn.Module, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
    """[B, 7 + 2L] per-image terms: agreement, teacher correct, student correct (NaN where unknown), CLS, patch
    and pooled cosine (NaN without prefix), has-head flag, then (‖err‖², ‖ref‖²) of each of the L layers."""
    paths = list(patched_modules(student))
    acc = torch.float64 if x.device.type != "mps" else torch.float32
    captured, t_feat, t_logits = teacher_attention(teacher, paths, x)
    with recorded_layout(student) as seen:
        s_feat, s_logits = features_and_logits(student, x)
    layout = seen[-1]
    B, nan = x.shape[0], torch.full((x.shape[0],), float("nan"), dtype=acc, device=x.device)
    cols = [nan, nan, nan]
    if t_logits is not None and s_logits is not None:
        t_top, s_top = t_logits.argmax(-1), s_logits.argmax(-1)
        cols[0] = (t_top == s_top).to(acc)
        if y is not None:
            cols[1], cols[2] = (t_top == y).to(acc), (s_top == y).to(acc)
    t_feat, s_feat = t_feat.to(acc), s_feat.to(acc)
    if t_feat.ndim == 3:
        P = layout.num_prefix_tokens
        cls = F.cosine_similarity(t_feat[:, 0], s_feat[:, 0], dim=-1) if P > 0 else nan
        patch = F.cosine_similarity(t_feat[:, P:], s_feat[:, P:], dim=-1).mean(1)
        pooled = F.cosine_similarity(t_feat[:, P:].mean(1), s_feat[:, P:].mean(1), dim=-1)
    else:
        cls, patch = nan, F.cosine_similarity(t_feat.flatten(1), s_feat.flatten(1), dim=-1)
        pooled = patch
    has_head = torch.full((B,), float(t_logits is not None and s_logits is not None), dtype=acc, device=x.device)
    cols += [cls, patch, pooled, has_head]
    forced = layer_outputs(student, captured, x, layout)  # alone, or one forced forward (PVT, Swin stages)
    for p in paths:
        out, target = forced[p], captured[p][1]
        # Per image: Swin's windows come batch-major ([B·windows, w², C]), as every other layout's rows.
        cols += [t.to(acc) for t in per_image_error(out.to(acc).reshape(B, -1), target.reshape(B, -1))]
    return torch.stack(cols, dim=1)


def summarize(terms: torch.Tensor) -> dict[str, Any]:
    """fidelity's summary (and per-layer errors) from the gathered per-image terms."""
    layer_err, layer_ref = terms[:, 7::2].sum(0), terms[:, 8::2].sum(0)
    layer_error = (layer_err / layer_ref.clamp_min(1e-30)).sqrt().tolist()
    out: dict[str, Any] = {}
    if not terms[:, 3].isnan().all():
        out["cls_cosine"] = float(terms[:, 3].mean())
    out["patch_cosine"], out["pooled_cosine"] = float(terms[:, 4].mean()), float(terms[:, 5].mean())
    out["mean_layer_error"] = sum(layer_error) / max(1, len(layer_error))
    out["max_layer_error"] = max(layer_error, default=0.0)
    if bool(terms[:, 6].all()):
        out["top1_agreement"] = float(terms[:, 0].mean())
        if not terms[:, 1].isnan().any():
            out["top1_original"], out["top1_patched"] = float(terms[:, 1].mean()), float(terms[:, 2].mean())
    out["layer_error"] = layer_error
    return out


def evaluate(
    student: nn.Module, teacher: nn.Module, eval_set: Dataset | None, images: int, accelerator: Any = None
) -> dict[str, Any]:
    """Fidelity to the teacher (and accuracy when labelled) on the first `images` eval images, on the model's
    device and dtype; with an `accelerator`, sharded over its processes (every process gets the result)."""
    if eval_set is None:
        return {}
    subset = Subset(eval_set, range(min(images, len(eval_set))))
    sharded = accelerator is not None and accelerator.num_processes > 1
    world = accelerator.num_processes if sharded else 1
    loader = DataLoader(subset, batch_size=max(1, min(EVAL_BATCH, math.ceil(len(subset) / world))))
    device = next(student.parameters()).device
    if sharded:
        from accelerate.data_loader import prepare_data_loader

        loader = prepare_data_loader(
            loader,
            device=device,
            num_processes=accelerator.num_processes,
            process_index=accelerator.process_index,
            put_on_device=True,
        )
    dtype = _model_dtype(student)
    was = student.training, teacher.training
    student.eval()
    teacher.eval()
    parts = []
    try:
        for batch in loader:
            items = list(batch) if isinstance(batch, (list, tuple)) else [batch]
            x, y = items[0], items[1] if len(items) > 1 else None
            x = x.to(device=device, dtype=dtype if x.is_floating_point() else x.dtype)
            y = y.to(device) if isinstance(y, torch.Tensor) and y.ndim == 1 else None
            terms = image_terms(student, teacher, x, y)
            parts.append(accelerator.gather_for_metrics(terms) if sharded else terms)
    finally:
        student.train(was[0])
        teacher.train(was[1])
    if not parts:
        return {}
    return summarize(torch.cat(parts).cpu())
