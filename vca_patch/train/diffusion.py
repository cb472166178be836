"""Diffusion distillation (`distill_diffusion` stages) and its evaluation, for diffusers diffusion transformers.

The loss follows LinFusion and CLEAR: on noised latents x_t at timesteps drawn per the recipe,

    objective_weight · ‖f_s(x_t) − target‖²       the model's own objective (ε for DiT/PixArt, velocity ε − x₀ for
                                                   SD3/Flux flow matching), on the prediction's first C channels
  + teacher_weight   · ‖f_s(x_t) − f_t(x_t)‖²      the frozen original's whole prediction (DiT's σ channels too)
  + attention_weight · mean_l ‖A_s,l − A_t,l‖² / ‖A_t,l‖²   every converted attention's output, each model on its
                                                   own activations (forward hooks on the same module paths)

each term a per-sample mean weighted by the recipe's timestep weighting. Noise and timesteps come from torch's
global RNG, which accelerate checkpoints, so a resumed run draws what an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from vca_patch.families.call_shims import attention_output
from vca_patch.recovery.capture import patched_modules
from vca_patch.surgery import get_patch_state
from vca_patch.train.diffusion_data import model_family
from vca_patch.train.diffusion_spec import DiffusionSpec
from vca_patch.train.objective import RecoveryObjective

EVAL_BATCH = 16


def prediction_type(model: nn.Module, spec: DiffusionSpec) -> str:
    """ "epsilon" or "flow" for `model` under `spec` ("auto": ε for DiT/PixArt, flow for SD3/Flux)."""
    if spec.prediction != "auto":
        return spec.prediction
    return "epsilon" if model_family(model) in ("dit", "pixart") else "flow"


class NoiseSchedule:
    """Draws (x_t, model timestep, target, weight) for clean latents x₀, per `spec`."""

    def __init__(self, model: nn.Module, spec: DiffusionSpec) -> None:
        self.spec, self.family = spec, model_family(model)
        self.prediction = prediction_type(model, spec)
        if self.prediction == "epsilon" and spec.timestep_weighting in ("sigma_sqrt", "cosmap"):
            raise ValueError(f"timestep_weighting {spec.timestep_weighting!r} is for flow matching, not epsilon")
        if self.prediction == "flow" and spec.timestep_weighting == "min_snr":
            raise ValueError("timestep_weighting 'min_snr' is for epsilon prediction, not flow matching")
        if self.prediction == "epsilon":
            from diffusers import DDPMScheduler

            scheduler = DDPMScheduler(
                num_train_timesteps=spec.num_train_timesteps,
                beta_schedule=spec.beta_schedule,
                beta_start=spec.beta_start,
                beta_end=spec.beta_end,
            )
            self.alphas_cumprod = torch.cumprod(1 - scheduler.betas.double(), 0)  # float64: SNR near t = 0

    def draw(
        self, x0: torch.Tensor, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3

        s, B = self.spec, x0.shape[0]
        u = compute_density_for_timestep_sampling(
            s.timestep_sampling, B, s.logit_mean, s.logit_std, s.mode_scale, device="cpu", generator=generator
        ).double()
        noise = torch.randn(x0.shape, generator=generator, dtype=torch.float32).to(x0)
        if self.prediction == "epsilon":
            T = s.num_train_timesteps
            t = (u * T).long().clamp(0, T - 1)
            ab = self.alphas_cumprod[t]
            weight = torch.ones(B, dtype=torch.float64)
            if s.timestep_weighting == "min_snr":
                snr = ab / (1 - ab)
                weight = snr.clamp(max=s.min_snr_gamma) / snr
            a, b = (v.to(x0).view(B, *[1] * (x0.ndim - 1)) for v in (ab.sqrt(), (1 - ab).sqrt()))
            return a * x0 + b * noise, t.to(x0.device), noise, weight.to(x0.device, torch.float32)
        sigma = s.flow_shift * u / (1 + (s.flow_shift - 1) * u)
        weight = torch.ones(B, dtype=torch.float64)
        if s.timestep_weighting in ("sigma_sqrt", "cosmap"):
            weight = compute_loss_weighting_for_sd3(s.timestep_weighting, sigmas=sigma).double()
        sig = sigma.to(x0).view(B, *[1] * (x0.ndim - 1))
        x_t = (1 - sig) * x0 + sig * noise
        t_model = sigma * (1.0 if self.family == "flux" else s.num_train_timesteps)  # Flux takes σ, SD3 σ·1000
        return x_t, t_model.to(x0), noise - x0, weight.to(x0.device, torch.float32)


def _flux_ids(height: int, width: int, text: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3)
    return img.to(like.device, like.dtype), torch.zeros(text, 3, device=like.device, dtype=like.dtype)


def predict(model: nn.Module, x_t: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
    """The model's prediction [B, C_out, H, W] for latents x_t [B, C, H, W] at timesteps t with conditions `cond`.

    Flux latents are its packed grid: the tokens are the H×W positions (img_ids row/column), C its in_channels."""
    family = model_family(model)
    floats = {k: v.to(x_t.dtype) for k, v in cond.items() if k != "class_labels"}
    if family == "dit":
        return model(x_t, timestep=t, class_labels=cond["class_labels"].long()).sample
    if family == "pixart":
        text, added = floats["encoder_hidden_states"], {"resolution": None, "aspect_ratio": None}
        return model(x_t, encoder_hidden_states=text, timestep=t, added_cond_kwargs=added).sample
    if family == "sd3":
        return model(
            x_t, encoder_hidden_states=floats["encoder_hidden_states"],
            pooled_projections=floats["pooled_projections"], timestep=t,
        ).sample  # fmt: skip
    B, _, H, W = x_t.shape
    img_ids, txt_ids = _flux_ids(H, W, floats["encoder_hidden_states"].shape[1], x_t)
    out = model(
        x_t.flatten(2).transpose(1, 2), encoder_hidden_states=floats["encoder_hidden_states"],
        pooled_projections=floats["pooled_projections"], timestep=t, img_ids=img_ids, txt_ids=txt_ids,
        guidance=floats.get("guidance"),
    ).sample  # fmt: skip
    return out.transpose(1, 2).reshape(B, -1, H, W)


@contextlib.contextmanager
def attention_outputs(model: nn.Module, paths: list[str], calls: bool = False) -> Iterator[dict[str, Any]]:
    """Record each converted attention's output (and, with `calls`, its call's args/kwargs) during forwards of
    `model` under the block, keyed by path. The student's entry "__layouts__" lists the token layouts it ran with."""
    seen: dict[str, Any] = {}
    state = get_patch_state(model)

    def hook(module, args, kwargs, output, path):
        seen[path] = (args, kwargs, attention_output(output)) if calls else attention_output(output)
        if state is not None:
            seen.setdefault("__layouts__", []).append(state.tracker.current())

    handles = [
        model.get_submodule(p).register_forward_hook(lambda m, a, k, o, p=p: hook(m, a, k, o, p), with_kwargs=True)
        for p in paths
    ]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def _per_sample_mse(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.float() - b.float()).pow(2).flatten(1).mean(1)


def distill_diffusion_loss(
    objective: RecoveryObjective, x0: torch.Tensor, cond: dict[str, torch.Tensor]
) -> torch.Tensor:
    """The stage's weighted sum of own-objective, teacher-prediction and attention-output losses (module doc)."""
    spec: DiffusionSpec | None = objective.diffusion
    if spec is None:
        raise ValueError("a distill_diffusion stage needs the recipe's `diffusion` section")
    student, teacher = objective.student, objective.teacher
    schedule = objective.__dict__.get("_schedule")
    if schedule is None:
        schedule = objective.__dict__["_schedule"] = NoiseSchedule(student, spec)
    x_t, t, target, weight = schedule.draw(x0)
    paths = list(patched_modules(student)) if spec.attention_weight > 0 else []
    with torch.no_grad(), attention_outputs(teacher, paths) as t_attn:
        t_pred = predict(teacher, x_t, t, cond)
    with attention_outputs(student, paths) as s_attn:
        s_pred = predict(student, x_t, t, cond)
    loss = torch.zeros((), device=x0.device)
    C = x0.shape[1]
    if spec.objective_weight > 0:
        loss = loss + spec.objective_weight * (weight * _per_sample_mse(s_pred[:, :C], target)).mean()
    if spec.teacher_weight > 0:
        loss = loss + spec.teacher_weight * (weight * _per_sample_mse(s_pred, t_pred)).mean()
    if paths:
        terms = []
        for p in paths:
            s_out, t_out = s_attn[p].float(), t_attn[p].float()
            err = (s_out - t_out).pow(2).flatten(1).sum(1)
            ref = t_out.pow(2).flatten(1).sum(1).sum()
            if objective.across is not None:
                ref = objective.across(ref)  # the batch's reference energy over every process
            terms.append((weight * err).sum() / ref.clamp_min(1e-12))
        loss = loss + spec.attention_weight * torch.stack(terms).mean()
    return loss


def _to(cond: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in cond.items()}


@torch.no_grad()
def evaluate_diffusion(
    student: nn.Module, teacher: nn.Module, eval_set: Dataset | None, count: int, spec: DiffusionSpec
) -> dict[str, Any]:
    """Fidelity of a converted diffusion transformer to its original on the first `count` items of `eval_set`.

    Noise and timesteps are drawn from `spec.seed` (the same at every evaluation). layer_error: per converted
    attention, relative error of its output given the original's input (teacher-forced); layer_error_free: each
    model on its own activations; prediction_error: relative error of the whole prediction (noise/velocity, and
    DiT's σ channels); objective_student / objective_teacher: each model's own objective (ε or velocity MSE).
    """
    if eval_set is None or len(eval_set) == 0:
        return {}
    device = next(student.parameters()).device
    dtype = next(p.dtype for p in student.parameters() if p.is_floating_point())
    paths = list(patched_modules(student))
    schedule = NoiseSchedule(student, spec)
    forced = {p: [0.0, 0.0] for p in paths}
    free = {p: [0.0, 0.0] for p in paths}
    pred_err = pred_ref = obj_s = obj_t = 0.0
    n = 0
    was = student.training, teacher.training
    student.eval()
    teacher.eval()
    generator = torch.Generator().manual_seed(spec.seed + 12_345)
    loader = DataLoader(Subset(eval_set, range(min(count, len(eval_set)))), batch_size=EVAL_BATCH)
    try:
        for x0, cond in loader:
            x0, cond = x0.to(device=device, dtype=dtype), _to(cond, device)
            x_t, t, target, _ = schedule.draw(x0, generator)
            with attention_outputs(teacher, paths, calls=True) as t_calls:
                t_pred = predict(teacher, x_t, t, cond)
            with attention_outputs(student, paths) as s_out:
                s_pred = predict(student, x_t, t, cond)
            _add_layer_errors(student, paths, t_calls, s_out, forced, free)
            pred_err += float((s_pred.double() - t_pred.double()).pow(2).sum())
            pred_ref += float(t_pred.double().pow(2).sum())
            C = x0.shape[1]
            obj_s += float((s_pred[:, :C].double() - target.double()).pow(2).mean(dtype=torch.float64)) * len(x0)
            obj_t += float((t_pred[:, :C].double() - target.double()).pow(2).mean(dtype=torch.float64)) * len(x0)
            n += len(x0)
    finally:
        student.train(was[0])
        teacher.train(was[1])
    layer_error = [_relative(forced[p]) for p in paths]
    return {
        "prediction_error": math.sqrt(pred_err / max(pred_ref, 1e-30)),
        "objective_student": obj_s / n,
        "objective_teacher": obj_t / n,
        "mean_layer_error": sum(layer_error) / max(1, len(layer_error)),
        "max_layer_error": max(layer_error, default=0.0),
        "layers": paths,
        "layer_error": layer_error,
        "layer_error_free": [_relative(free[p]) for p in paths],
        "latents": n,
        "prediction": schedule.prediction,
    }


def _add_layer_errors(
    student: nn.Module,
    paths: list[str],
    t_calls: dict[str, Any],
    s_out: dict[str, Any],
    forced: dict[str, list[float]],
    free: dict[str, list[float]],
) -> None:
    """Add one batch's squared errors and reference energies per layer: teacher-forced (the student's layer on the
    teacher's call) into `forced`, each model on its own activations into `free`."""
    layout = s_out["__layouts__"][-1]
    for p in paths:
        args, kwargs, ref = t_calls[p]
        out = attention_output(student.get_submodule(p)(*args, **kwargs, layout=layout))
        for acc, got in ((forced[p], out), (free[p], s_out[p])):
            acc[0] += float((got.double() - ref.double()).pow(2).sum())
            acc[1] += float(ref.double().pow(2).sum())


def _relative(acc: list[float]) -> float:
    return math.sqrt(acc[0] / max(acc[1], 1e-30))
