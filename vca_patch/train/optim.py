"""A stage's optimizer (AdamW over the patched model's parameter groups) and its timm warmup-cosine schedule."""

from __future__ import annotations

from typing import Any

import torch
from timm.scheduler.cosine_lr import CosineLRScheduler
from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from vca_patch.train.params import parameter_groups
from vca_patch.train.recipe import StageSpec
from vca_patch.train.target_keys import group_learning_rates


def stage_optimizer(model: nn.Module, stage: StageSpec) -> torch.optim.AdamW:
    """AdamW over the groups with a learning rate > 0 (the others are frozen: requires_grad False).

    Every group starts at the stage's peak lr with an `lr_scale` (its own lr / the peak), which timm's
    schedulers multiply in, so one schedule drives groups with different learning rates. With `train_only`
    "norms_and_biases", only those parameters of each group train (`norms_and_biases`).
    """
    groups = parameter_groups(model)
    if stage.train_only == "norms_and_biases":
        chosen = norms_and_biases(model)
        groups = {name: [(n, p) for n, p in params if id(p) in chosen] for name, params in groups.items()}
    lrs = {"new": stage.lr, **group_learning_rates(stage.options), "carried": stage.carried_lr, "rest": stage.rest_lr}
    if stage.kind == "attention_transfer":
        lrs["rest"] = 0.0  # outside attention nothing is in the loss
    peak = max(lrs.values())
    param_groups = []
    for p in model.parameters():
        p.requires_grad_(False)
    for name, params in groups.items():
        for _, p in params:
            p.requires_grad_(lrs[name] > 0)
        trainable = [p for _, p in params if lrs[name] > 0]
        if trainable:
            wd = stage.weight_decay if name in ("carried", "rest") else 0.0
            param_groups.append(
                {"params": trainable, "lr": peak, "lr_scale": lrs[name] / peak, "weight_decay": wd, "group": name}
            )
    if not param_groups:
        raise ValueError(f"stage {stage.name!r} trains nothing: every learning rate is 0")
    return torch.optim.AdamW(param_groups, betas=(0.9, 0.999))


def norms_and_biases(model: nn.Module) -> set[int]:
    """Ids of BitFit's parameters: every parameter of a normalisation layer (LayerNorm, RMSNorm, GroupNorm,
    BatchNorm and their subclasses) and every bias."""
    norms = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
    chosen = {id(p) for m in model.modules() if isinstance(m, norms) for p in m.parameters(recurse=False)}
    return chosen | {id(p) for name, p in model.named_parameters() if name.rsplit(".", 1)[-1] == "bias"}


class StageScheduler(LRScheduler):
    """timm's `CosineLRScheduler` (linear warmup, then cosine to min_lr_ratio × the peak) as a torch scheduler
    stepped once per optimizer update, so `Accelerator.prepare` wraps it and `save_state` checkpoints it.

    timm computes the learning rate of update t; each group gets it times its `lr_scale`. The state is the
    update count (`last_epoch`), so a checkpoint holds plain numbers only.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, stage: StageSpec) -> None:
        peak = optimizer.param_groups[0]["lr"]
        warmup = stage.warmup_steps
        self.cosine = CosineLRScheduler(
            optimizer,
            t_initial=max(1, stage.steps - warmup),
            lr_min=stage.min_lr_ratio * peak,
            warmup_t=warmup,
            warmup_lr_init=peak / warmup if warmup else 0.0,  # the first update runs at 1/warmup of the peak
            warmup_prefix=True,
            t_in_epochs=False,
        )
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:  # type: ignore[override]
        lrs = self.cosine._get_values(self.last_epoch, on_epoch=False)
        return [lr * group.get("lr_scale", 1.0) for lr, group in zip(lrs, self.optimizer.param_groups, strict=True)]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_step_count": self._step_count}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch, self._step_count = int(state_dict["last_epoch"]), int(state_dict["_step_count"])
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            group["lr"] = lr
