"""Random denoiser inputs for a diffusers transformer, and what a conversion changes on them.

`probe_inputs` draws, from a seed, what one denoising step feeds the model: noisy latents at the config's
`sample_size` (Flux: packed tokens on an 8×8 grid with their `img_ids`), timesteps, and conditions (class labels
for DiT, random text embeddings and pooled projections for PixArt/SD3/Flux). `predict` runs the model on them and
returns its noise / velocity prediction. `attention_errors` measures every converted attention against its
original processor on the inputs it sees inside that forward (per-layer attention error).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vca_patch.families.diffusers.processor import CarriedLayerProcessor

FLUX_PROBE_GRID = (8, 8)  # packed-latent grid of Flux probes (Flux configs name no sample size)
TEXT_TOKENS = 8


def is_diffusers_model(model: nn.Module) -> bool:
    return type(model).__module__.startswith("diffusers.")


def probe_inputs(model: nn.Module, batch_size: int = 2, seed: int = 0) -> dict[str, Any]:
    """Keyword arguments of one random denoising step of `model`, drawn on the CPU from `seed`, then placed on the
    model's device and dtype."""
    from vca_patch.core.model_io import to_model

    config, name = model.config, type(model).__name__
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return to_model(torch.randn(*shape, generator=generator), model)

    B = batch_size
    if name == "FluxTransformer2DModel":
        H, W = FLUX_PROBE_GRID
        rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
        inputs: dict[str, Any] = {
            "hidden_states": normal(B, H * W, config.in_channels),
            "encoder_hidden_states": normal(B, TEXT_TOKENS, config.joint_attention_dim),
            "pooled_projections": normal(B, config.pooled_projection_dim),
            "timestep": to_model(torch.rand(B, generator=generator), model),
            "img_ids": to_model(torch.stack([torch.zeros_like(rows), rows, cols], -1).float(), model),
            "txt_ids": to_model(torch.zeros(TEXT_TOKENS, 3), model),
        }
        if config.guidance_embeds:
            inputs["guidance"] = to_model(torch.full((B,), 3.5), model)
        return inputs
    size = config.sample_size
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    inputs = {"hidden_states": normal(B, config.in_channels, height, width)}
    steps = torch.randint(0, 1000, (B,), generator=generator)
    if name == "DiTTransformer2DModel":
        labels = torch.randint(0, config.num_embeds_ada_norm, (B,), generator=generator)
        return {**inputs, "timestep": steps.to(inputs["hidden_states"].device), "class_labels": labels}
    if name == "PixArtTransformer2DModel":
        added = {"resolution": None, "aspect_ratio": None}
        if config.sample_size == 128:  # PixArt-α 1024 px takes resolution and aspect-ratio conditions
            added = {"resolution": normal(B, 2).abs() * 1024, "aspect_ratio": normal(B, 1).abs() + 0.5}
        return {
            **inputs,
            "encoder_hidden_states": normal(B, TEXT_TOKENS, config.caption_channels),
            "timestep": steps.to(inputs["hidden_states"].device),
            "added_cond_kwargs": added,
        }
    if name == "SD3Transformer2DModel":
        return {
            **inputs,
            "encoder_hidden_states": normal(B, TEXT_TOKENS, config.joint_attention_dim),
            "pooled_projections": normal(B, config.pooled_projection_dim),
            "timestep": to_model(steps.float(), model),
        }
    raise ValueError(f"no denoiser probe for {name}")


def predict(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The model's prediction (noise or velocity) on `inputs`."""
    return model(**inputs, return_dict=False)[0]


class _Capture:
    """Forward hook (with kwargs) on a converted attention module: the relative error of its output against its
    original processor's on the same inputs."""

    def __init__(self) -> None:
        self.errors: list[float] = []

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        patched = module.processor
        module.processor = patched.original  # the module's own forward (no hooks), with the original processor
        try:
            expected = module.forward(*args, **{k: v for k, v in kwargs.items() if k != "layout"})
        finally:
            module.processor = patched
        pairs = zip(output, expected, strict=True) if isinstance(output, tuple) else [(output, expected)]
        for got, want in pairs:
            want = want.detach().double()
            self.errors.append(float((got.detach().double() - want).norm() / want.norm().clamp_min(1e-30)))


@torch.no_grad()
def attention_errors(model: nn.Module, inputs: dict[str, Any]) -> dict[str, float]:
    """Relative error of each converted attention's output (both streams of joint attention: the larger) against
    its original processor on what it receives while `model` runs on `inputs`: {module path: error}."""
    captures: dict[str, _Capture] = {}
    handles = []
    for path, module in model.named_modules():
        if isinstance(getattr(module, "processor", None), CarriedLayerProcessor):
            captures[path] = _Capture()
            handles.append(module.register_forward_hook(captures[path], with_kwargs=True))
    try:
        predict(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    return {path: max(c.errors) for path, c in captures.items() if c.errors}


def fidelity_summary(errors: dict[str, float], prediction: dict[str, float]) -> dict[str, float]:
    """The numbers `convert` prints for a diffusion transformer."""
    values = list(errors.values()) or [float("nan")]
    return {
        "attention_error_mean": sum(values) / len(values),
        "attention_error_max": max(values),
        "prediction_relative_error": prediction["relative_error"],
        "prediction_cosine": prediction["cosine"],
    }
