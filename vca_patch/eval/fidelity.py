"""How far a converted model's outputs are from the original's."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.core.atomic import atomic_file
from vca_patch.core.install import install_hint
from vca_patch.core.model_io import (  # noqa: F401  (re-exported for callers of eval.fidelity)
    compare_outputs,
    features_and_logits,
    model_input_size,
    model_placement,
    output_tensor,
    probe_batch,
    to_model,
)
from vca_patch.families.call_shims import attention_output, call_tokens
from vca_patch.layers.layout import TokenLayout


@dataclass
class FidelityReport:
    """How close a patched model is to its original on real batches.

    layer_error: per patched layer, relative error of the attention output when the layer gets the
    original model's input (teacher-forced: called alone, or inside one forward of the patched model where its
    layers run only inside their blocks, as PVT's and Swin's do); layer_error_free: the same, each model on its own
    activations (errors accumulate with depth). cls_cosine / patch_cosine / pooled_cosine: final
    features (forward_features) of the prefix token 0, of each patch token (mean), and of the
    mean-pooled patch tokens. top1_agreement and top1 (original, patched) when there is a head
    (top1 needs labels).
    """

    layers: list[str]
    layer_error: list[float]
    layer_error_free: list[float]
    cls_cosine: float | None
    patch_cosine: float
    pooled_cosine: float
    top1_agreement: float | None = None
    top1_original: float | None = None
    top1_patched: float | None = None
    num_images: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> dict[str, float]:
        """The headline numbers (None entries dropped)."""
        out = {
            "cls_cosine": self.cls_cosine,
            "patch_cosine": self.patch_cosine,
            "pooled_cosine": self.pooled_cosine,
            "mean_layer_error": sum(self.layer_error) / max(1, len(self.layer_error)),
            "max_layer_error": max(self.layer_error, default=0.0),
            "top1_agreement": self.top1_agreement,
            "top1_original": self.top1_original,
            "top1_patched": self.top1_patched,
        }
        return {k: v for k, v in out.items() if v is not None}

    def plot(self, path: str | Path) -> Path:
        """Write a PNG of the per-layer errors (needs matplotlib, vca-patch's plot extra)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(f"plotting needs matplotlib: {install_hint('plot')}") from exc
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
        xs = list(range(len(self.layers)))
        ax.plot(xs, self.layer_error, "o-", label="teacher-forced")
        ax.plot(xs, self.layer_error_free, "s--", label="free-running")
        ax.set_xlabel("patched layer")
        ax.set_ylabel("relative error of attention output")
        ax.set_xticks(xs)
        title = f"CLS cos {self.cls_cosine:.3f}, " if self.cls_cosine is not None else ""
        ax.set_title(f"{title}patch cos {self.patch_cosine:.3f}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = Path(path)
        with atomic_file(path, suffix=".png") as tmp:  # an interrupted write keeps the old file
            fig.savefig(tmp, format="png")
        plt.close(fig)
        return path


class _Accumulator:
    def __init__(self) -> None:
        self.sq_err = 0.0
        self.sq_ref = 0.0
        self.count = 0

    def add(self, candidate: torch.Tensor, reference: torch.Tensor) -> None:
        self.sq_err += float((candidate.double() - reference.double()).pow(2).sum())
        self.sq_ref += float(reference.double().pow(2).sum())
        self.count += 1

    def value(self) -> float:
        if not self.count:  # e.g. a token-merging layer, whose output has fewer tokens than the original's
            return math.nan
        return math.sqrt(self.sq_err / max(self.sq_ref, 1e-30))


@torch.no_grad()
def fidelity(original: nn.Module | None, patched: nn.Module, batches: Iterable) -> FidelityReport:
    """Measure `patched` against `original` on `batches` (tensors, (images, labels) pairs or dicts).

    `original=None` uses the patched model's own original attention modules (swapped in for the
    reference pass), so no copy of the model is needed. Each model runs on its own device and in its parameter
    dtype (images are moved and cast); every error and cosine is accumulated in float64.
    """
    from vca_patch.recovery.capture import batch_images, original_attention, patched_modules
    from vca_patch.train.forced import layer_outputs

    paths = list(patched_modules(patched))
    state_tracker = patched.vca_patch_state.tracker
    reference_model = original if original is not None else patched
    ref_paths = paths
    errors = {p: _Accumulator() for p in paths}
    errors_free = {p: _Accumulator() for p in paths}
    cls_cos, patch_cos, pooled_cos, agree = [], [], [], []
    correct_ref = correct_new = labelled = 0
    num_images = 0
    patched_was, ref_was = patched.training, reference_model.training
    patched.eval()
    reference_model.eval()
    try:
        for batch in batches:
            images = batch_images(batch)
            x = to_model(images, patched)
            device = x.device
            captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

            def ref_hook(module, args, kwargs, output, path=None, store=captured):
                store[path] = (call_tokens(args, kwargs), attention_output(output))

            ctx = original_attention(patched) if original is None else contextlib.nullcontext()
            with ctx:
                handles = [
                    reference_model.get_submodule(p).register_forward_hook(
                        functools.partial(ref_hook, path=p), with_kwargs=True
                    )
                    for p in ref_paths
                ]
                try:
                    ref_feat, ref_logits = features_and_logits(reference_model, to_model(images, reference_model))
                finally:
                    for h in handles:
                        h.remove()
            ref_feat = ref_feat.to(device)  # a separate original may live elsewhere
            ref_logits = ref_logits.to(device) if ref_logits is not None else None
            free: dict[str, torch.Tensor] = {}
            layouts: list[TokenLayout] = []  # the layout belongs to this forward: read inside it

            def free_hook(module, args, output, path=None, store=free, seen=layouts):
                store[path] = attention_output(output)
                seen.append(state_tracker.current())

            handles = [
                patched.get_submodule(p).register_forward_hook(functools.partial(free_hook, path=p)) for p in paths
            ]
            try:
                new_feat, new_logits = features_and_logits(patched, x)
            finally:
                for h in handles:
                    h.remove()
            layout = layouts[-1]
            forced = layer_outputs(patched, {p: (to_model(captured[p][0], patched), None) for p in paths}, x, layout)
            for p in paths:
                ref_out = captured[p][1].to(device)
                errors[p].add(forced[p], ref_out)
                if free[p].shape == ref_out.shape:  # token merging: fewer tokens, no per-token comparison
                    errors_free[p].add(free[p], ref_out)
            P = layout.num_prefix_tokens
            if ref_feat.ndim == 3:
                if P > 0:
                    cls_cos.append(F.cosine_similarity(ref_feat[:, 0].double(), new_feat[:, 0].double(), dim=-1))
                patch_cos.append(
                    F.cosine_similarity(ref_feat[:, P:].double(), new_feat[:, P:].double(), dim=-1).mean(1)
                )
                pooled_cos.append(
                    F.cosine_similarity(ref_feat[:, P:].double().mean(1), new_feat[:, P:].double().mean(1), dim=-1)
                )
            else:
                patch_cos.append(
                    F.cosine_similarity(ref_feat.flatten(1).double(), new_feat.flatten(1).double(), dim=-1)
                )
                pooled_cos.append(patch_cos[-1])
            if ref_logits is not None and new_logits is not None:
                agree.append((ref_logits.argmax(-1) == new_logits.argmax(-1)).double())
                if isinstance(batch, (list, tuple)) and len(batch) > 1 and isinstance(batch[1], torch.Tensor):
                    y = batch[1].to(device)
                    correct_ref += int((ref_logits.argmax(-1) == y).sum())
                    correct_new += int((new_logits.argmax(-1) == y).sum())
                    labelled += len(y)
            num_images += len(x)
    finally:
        patched.train(patched_was)
        reference_model.train(ref_was)
    if num_images == 0:
        raise ValueError("fidelity needs at least one batch")
    return FidelityReport(
        layers=paths,
        layer_error=[errors[p].value() for p in paths],
        layer_error_free=[errors_free[p].value() for p in paths],
        cls_cosine=float(torch.cat(cls_cos).mean()) if cls_cos else None,
        patch_cosine=float(torch.cat(patch_cos).mean()),
        pooled_cosine=float(torch.cat(pooled_cos).mean()),
        top1_agreement=float(torch.cat(agree).mean()) if agree else None,
        top1_original=correct_ref / labelled if labelled else None,
        top1_patched=correct_new / labelled if labelled else None,
        num_images=num_images,
    )


def diffusion_fidelity(
    original: nn.Module | None,
    patched: nn.Module,
    *,
    latents: str | Path | None = None,
    count: int = 64,
    seed: int = 0,
    latent_size: int | None = None,
    text_tokens: int = 16,
) -> dict[str, Any]:
    """Per-layer attention error and noise/velocity-prediction error of a converted diffusers transformer.

    Against `original` (None: the patched model's unpatched copy), on `count` latents from the folder `latents`
    (.pt/.safetensors) or generated ones, with random timesteps and conditions from `seed`; see
    `vca_patch.train.diffusion.evaluate_diffusion` for the keys."""
    from vca_patch.train.diffusion import evaluate_diffusion
    from vca_patch.train.diffusion_data import GeneratedLatents, LatentFolder
    from vca_patch.train.diffusion_spec import DiffusionSpec
    from vca_patch.train.finetune import teacher_from

    spec = DiffusionSpec(
        latents=None if latents is None else str(latents), eval_latents=count, latent_size=latent_size,
        text_tokens=text_tokens, seed=seed,
    )  # fmt: skip
    data = GeneratedLatents(patched, spec, "eval", count) if latents is None else LatentFolder(patched, spec, latents)
    reference = original if original is not None else teacher_from(patched)
    return evaluate_diffusion(patched, reference, data, count, spec)
