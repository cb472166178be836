"""The `diffusion:` section of a recipe: what a `distill_diffusion` stage trains on and how it weighs its losses.

Plain data (validated by `train.recipe` like every other section); the objective lives in `train.diffusion`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DiffusionSpec:
    """Latents, noise schedule and loss weights of diffusion distillation (LinFusion/CLEAR form).

    latents: a folder of .pt/.safetensors latents (a [C, H, W] or [B, C, H, W] tensor, or a dict with `latents` and
    optional `class_labels` / `encoder_hidden_states` / `pooled_projections`), or null: generated standard-normal
    latents of the model's `sample_size` (`latent_size` overrides it) with random conditions of the right shape.
    train_latents / eval_latents: how many (generated, or the first of the folder; eval ones come after the train ones).
    prediction: "auto" (ε for DiT/PixArt, flow-matching velocity for SD3/Flux), "epsilon" or "flow".
    timestep_sampling: diffusers' `compute_density_for_timestep_sampling` scheme (uniform, logit_normal, mode) for
    u ∈ [0, 1] (ε: t = ⌊u·T⌋; flow: σ = shift·u / (1 + (shift − 1)·u)).
    timestep_weighting: per-sample weight of every loss term: none; min_snr (ε: min(SNR, γ)/SNR); sigma_sqrt or
    cosmap (flow: diffusers' `compute_loss_weighting_for_sd3`).
    attention_weight, teacher_weight, objective_weight: weights of the per-layer attention-output error (normalised
    MSE against the frozen original, each model on its own activations), of the MSE to the teacher's prediction and
    of the model's own objective (ε or velocity MSE).
    text_tokens: length of the random text embeddings for text-conditioned models.
    """

    latents: str | None = None
    train_latents: int = 1024
    eval_latents: int = 64
    latent_size: int | None = None
    text_tokens: int = 16
    prediction: Literal["auto", "epsilon", "flow"] = "auto"
    num_train_timesteps: int = 1000
    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"] = "linear"
    beta_start: float = 0.0001
    beta_end: float = 0.02
    flow_shift: float = 1.0
    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    timestep_weighting: Literal["none", "min_snr", "sigma_sqrt", "cosmap"] = "none"
    min_snr_gamma: float = 5.0
    attention_weight: float = 0.5
    teacher_weight: float = 0.5
    objective_weight: float = 1.0
    seed: int = 0


MAX_SEED = 2**32 - 1  # numpy's seed range
MAX_LATENT_SIZE = 4096  # latent pixels a side (a 32768 px image at 8x)
_COUNT_LIMITS = {"train_latents": 100_000_000, "eval_latents": 100_000_000, "text_tokens": 65_536,
                 "num_train_timesteps": 1_000_000}  # fmt: skip


def check_diffusion_spec(spec: DiffusionSpec) -> list[str]:
    """What is wrong with `spec` (empty when nothing), each message naming the key."""
    problems = []
    for key, high in _COUNT_LIMITS.items():
        if not 1 <= getattr(spec, key) <= high:
            problems.append(f"diffusion.{key} must be >= 1 and <= {high}, got {getattr(spec, key)}")
    if spec.latent_size is not None and not 1 <= spec.latent_size <= MAX_LATENT_SIZE:
        problems.append(
            f"diffusion.latent_size must be >= 1 and <= {MAX_LATENT_SIZE} (null: the model's sample_size), "
            f"got {spec.latent_size}"
        )
    if not 0 <= spec.seed <= MAX_SEED:
        problems.append(f"diffusion.seed must be >= 0 and <= {MAX_SEED}, got {spec.seed}")
    for key in ("attention_weight", "teacher_weight", "objective_weight", "logit_std", "min_snr_gamma"):
        if getattr(spec, key) < 0:
            problems.append(f"diffusion.{key} must be >= 0, got {getattr(spec, key)}")
    if spec.attention_weight + spec.teacher_weight + spec.objective_weight <= 0:
        problems.append("diffusion: attention_weight, teacher_weight and objective_weight are all 0: nothing to train")
    if spec.flow_shift <= 0:
        problems.append(f"diffusion.flow_shift must be > 0, got {spec.flow_shift}")
    if not 0 < spec.beta_start < spec.beta_end < 1:
        problems.append(f"diffusion: need 0 < beta_start < beta_end < 1, got {spec.beta_start}, {spec.beta_end}")
    if spec.prediction == "epsilon" and spec.timestep_weighting in ("sigma_sqrt", "cosmap"):
        problems.append(f"diffusion.timestep_weighting {spec.timestep_weighting!r} is for flow matching, not epsilon")
    if spec.prediction == "flow" and spec.timestep_weighting == "min_snr":
        problems.append("diffusion.timestep_weighting 'min_snr' is for epsilon prediction, not flow matching")
    return problems
