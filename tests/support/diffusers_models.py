"""What the diffusers tests share: tiny random-weight models, seeded inputs, Flux's position ids and rotary embedding,
a float64 rotary reference, grid recording, a denoising loop and the patch → save → reload round trip.

Import it after `pytest.importorskip("diffusers")`: it imports diffusers at module level.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import diffusers
import torch
from safetensors.torch import load_file, save_file

from vca_patch import patch_model
from vca_patch.checkpoint.folder import from_pretrained, save_pretrained
from vca_patch.families.diffusers.dit import patched_processors
from vca_patch.targets.base import TargetConfig


def latent(*shape: int, seed: int = 0) -> torch.Tensor:
    """A standard-normal tensor of `shape` from its own seeded generator (the global RNG is left alone)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative Frobenius error ‖got − expected‖ / ‖expected‖."""
    return float((got - expected).detach().norm() / expected.detach().norm())


def tiny_vae(**overrides) -> torch.nn.Module:
    """A one-block AutoencoderKL with 4 latent channels (seed 1); `overrides` go to its config."""
    torch.manual_seed(1)
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(8,), layers_per_block=1, latent_channels=4, norm_num_groups=8, sample_size=16,
        **overrides,
    ).eval()  # fmt: skip


def processor_impostor(processor_cls: type, change: Callable) -> type:
    """A subclass of `processor_cls` under its `__name__` (the adapter's name check passes) whose output is
    `change(original output)`: a processor computing something else, which verification must catch."""

    class Impostor(processor_cls):
        def __call__(self, attn, hidden_states, *args, **kwargs):
            return change(super().__call__(attn, hidden_states, *args, **kwargs))

    Impostor.__name__ = processor_cls.__name__
    return Impostor


# -- Flux -------------------------------------------------------------------------------------------------------


def tiny_flux(num_single_layers: int = 2) -> torch.nn.Module:
    """A FluxTransformer2DModel with 2 double-stream blocks and `num_single_layers` single-stream ones (seed 0)."""
    torch.manual_seed(0)
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=2, num_single_layers=num_single_layers, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=24, pooled_projection_dim=12, axes_dims_rope=(4, 6, 6),
    ).eval()  # fmt: skip


def image_ids(H: int, W: int, offset: int = 0) -> torch.Tensor:
    """Flux's row-major image position ids [H·W, 3]: (0, row + offset, col)."""
    rows, cols = torch.arange(H).repeat_interleave(W), torch.arange(W).repeat(H)
    return torch.stack([torch.zeros_like(rows), rows + offset, cols], -1).float()


def flux_rotary(model: torch.nn.Module, L: int, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's (cos, sin) [L + H·W, d] for L text tokens (ids 0) followed by the image tokens on `grid`."""
    return model.pos_embed(torch.cat([torch.zeros(L, 3), image_ids(*grid)]))


def flux_inputs(batch: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Seeded text [B, 7, 24] and pooled [B, 12] conditioning for `tiny_flux`."""
    return latent(batch, 7, 24, seed=seed), latent(batch, 12, seed=seed + 1)


def flux_call(model: torch.nn.Module, x: torch.Tensor, grid: tuple[int, int], seed: int = 3) -> torch.Tensor:
    """`tiny_flux` on image tokens x [B, H·W, 16] at timestep 0.5, with seeded conditioning."""
    B = x.shape[0]
    text, pooled = (t.to(x) for t in flux_inputs(B, seed))
    return model(
        hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=torch.full((B,), 0.5),
        img_ids=image_ids(*grid), txt_ids=torch.zeros(7, 3),
    ).sample  # fmt: skip


def flux_denoise(model: torch.nn.Module, x: torch.Tensor, grid: tuple[int, int], steps: int = 3) -> torch.Tensor:
    """Flow-matching Euler denoising of x [B, H·W, 16] on `grid` with `tiny_flux`, seeded conditioning."""
    B = x.shape[0]
    text, pooled = flux_inputs(B)

    def velocity(sample: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return model(
            hidden_states=sample, encoder_hidden_states=text, pooled_projections=pooled,
            timestep=(t / 1000).expand(B), img_ids=image_ids(*grid), txt_ids=torch.zeros(7, 3),
        ).sample  # fmt: skip

    return denoise(diffusers.FlowMatchEulerDiscreteScheduler(), x.clone(), velocity, steps)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Float64-reference rotary embedding: [B, S, M, d] rotated by interleaved pairs, (x₀, x₁) -> (x₀cos − x₁sin,
    x₁cos + x₀sin), with cos/sin [S, d] (each pair's angle repeated, as Flux builds them)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, 0::2], sin[None, :, None, 0::2]
    return torch.stack([x0 * c - x1 * s, x1 * c + x0 * s], dim=-1).flatten(-2)


# -- the patched model: grids, denoising, checkpoints -------------------------------------------------------------


def attention_processors(model: torch.nn.Module) -> dict[str, object]:
    """Every attention processor of `model` (patched or not), by module path."""
    return {p: m.processor for p, m in model.named_modules() if hasattr(m, "processor")}


def record_grids(model: torch.nn.Module, paths: Iterable[str] | None = None) -> list[tuple[int, int]]:
    """A list that fills with the layout grid of every call of the patched layers at `paths` (default: all)."""
    grids: list[tuple[int, int]] = []
    processors = patched_processors(model)
    for path in processors if paths is None else paths:
        processors[path].layer.register_forward_hook(lambda m, a, o: grids.append(m.layout_source().grid))
    return grids


def denoise(
    scheduler,
    sample: torch.Tensor,
    predict: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int = 3,
) -> torch.Tensor:
    """`steps` steps of `scheduler` from `sample`, the model output being `predict(sample, t)`; no gradients."""
    scheduler.set_timesteps(steps)
    with torch.no_grad():
        for t in scheduler.timesteps:
            sample = scheduler.step(predict(sample, t), t, sample).prev_sample
    return sample


@dataclass
class Reloaded:
    """What `patch_save_reload` gives back."""

    model: torch.nn.Module  # the model from_pretrained loaded
    expected: torch.Tensor  # `run` of the patched model before it was saved
    delta: dict[str, torch.Tensor] | None  # the tensors of delta.safetensors (form "delta"), else None


def patch_save_reload(
    model: torch.nn.Module,
    config: TargetConfig,
    form: str,
    folder: Path,
    run: Callable[[torch.nn.Module], torch.Tensor],
) -> Reloaded:
    """Save `model`'s weights as `folder/base.safetensors`, patch it with `config`, record `run(model)`, save it to
    `folder/ckpt` in `form` ("merged" or "delta", the delta against that base) and load it back."""
    base = folder / "base.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(base))
    patch_model(model, config)
    with torch.no_grad():
        expected = run(model)
    options = {"form": "delta", "base_weights": base} if form == "delta" else {}
    save_pretrained(model, folder / "ckpt", **options)
    loaded = from_pretrained(folder / "ckpt", **({"base_weights": base} if form == "delta" else {}))
    delta = load_file(str(folder / "ckpt" / "delta.safetensors")) if form == "delta" else None
    return Reloaded(loaded, expected, delta)


def tiny_dit(num_classes: int = 10) -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=16,
        patch_size=2, num_embeds_ada_norm=num_classes,
    ).eval()  # fmt: skip


def tiny_pixart() -> torch.nn.Module:
    torch.manual_seed(0)
    return diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=16,
        patch_size=2, cross_attention_dim=32, caption_channels=24,
    ).eval()  # fmt: skip
