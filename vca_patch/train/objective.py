"""The recovery losses, and the module that holds the student and computes a stage's loss in its forward.

Each loss of a global batch split over processes (each process's loss, averaged by DDP) is exactly the
loss of that batch on one process: distillation is a mean of per-image terms, and attention transfer's
denominator (the teacher's output energy, a constant) is averaged over processes first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.core.model_io import features_and_logits
from vca_patch.families.call_shims import attention_output, call_tokens
from vca_patch.layers.layout import TokenLayout
from vca_patch.recovery.capture import patched_modules
from vca_patch.surgery import get_patch_state
from vca_patch.train.forced import layer_outputs
from vca_patch.train.recipe import RecipeError, StageSpec


@contextlib.contextmanager
def recorded_layout(model: nn.Module) -> Iterator[list[TokenLayout]]:
    """Record the token layout of each forward of the patched `model` (read from its embedding module)."""
    state = get_patch_state(model)
    seen: list[TokenLayout] = []
    handle = state.adapter.embedding_module(model).register_forward_hook(
        lambda m, a, k, o: seen.append(state.adapter.layout_from_embedding(m, a, k, o)), with_kwargs=True
    )
    try:
        yield seen
    finally:
        handle.remove()


def teacher_attention(
    teacher: nn.Module, paths: list[str], x: torch.Tensor
) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], torch.Tensor, torch.Tensor | None]:
    """Each attention site's (input tokens, output) in the frozen teacher on `x`, and its features and logits."""
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [
        teacher.get_submodule(p).register_forward_hook(
            lambda m, a, k, o, path=p: captured.__setitem__(path, (call_tokens(a, k).detach(), attention_output(o))),
            with_kwargs=True,
        )
        for p in paths
    ]
    try:
        with torch.no_grad():
            features, logits = features_and_logits(teacher, x)
    finally:
        for h in handles:
            h.remove()
    return captured, features, logits


def per_image_error(out: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(‖out − target‖², ‖target‖²) per image, in float32 or wider."""
    dtype = torch.promote_types(out.dtype, torch.float32)
    diff = (out.to(dtype) - target.to(dtype)).pow(2).flatten(1).sum(1)
    return diff, target.to(dtype).pow(2).flatten(1).sum(1)


def transfer_loss(
    student: nn.Module,
    teacher: nn.Module,
    x: torch.Tensor,
    across: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Mean over layers of Σ‖VCA(x_l) − MHSA(x_l)‖² / Σ‖MHSA(x_l)‖² over the batch, x_l the teacher's layer input
    (each layer called alone, or, where layers run only inside their blocks, inside one student forward).

    `across` averages the (constant) denominators over processes, so each process's share of the loss
    adds up to the loss of the whole global batch.
    """
    paths = list(patched_modules(student))
    captured, _, _ = teacher_attention(teacher, paths, x)

    def layout() -> TokenLayout:  # the token layout (grid) of this input, for layers called alone
        with recorded_layout(student) as seen:
            get_patch_state(student).adapter.embedding_module(student)(x)
        return seen[-1]

    outputs = layer_outputs(student, captured, x, layout)  # PVT/Swin: one teacher-forced forward, with gradients
    errors, refs = [], []
    for p in paths:
        err, ref = per_image_error(outputs[p], captured[p][1])
        errors.append(err.sum())
        refs.append(ref.sum())
    ref_sums = torch.stack(refs)
    if across is not None:
        ref_sums = across(ref_sums)
    return (torch.stack(errors) / ref_sums.clamp_min(1e-12)).mean()


class RunningStandardizer:
    """The teacher's per-channel mean and std of final tokens [B, T, C], token 0 (CLS) and tokens 1: apart, pooled
    over every batch seen so far (Chan's parallel update, float64); `__call__` standardises features with them.

    Plain tensors, not buffers: they are no part of the student's state dict or checkpoints (a resumed stage
    estimates them again). Under DDP each process pools its own batches.
    """

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps
        self.count = torch.zeros(2, dtype=torch.float64)
        self.mean: torch.Tensor | None = None  # [2, C]
        self.m2: torch.Tensor | None = None  # [2, C]: sums of squared deviations

    @torch.no_grad()
    def update(self, features: torch.Tensor) -> None:
        if features.ndim != 3 or features.shape[1] < 2:
            raise ValueError(f"standardized features need [B, tokens >= 2, C], got {tuple(features.shape)}")
        f = features.detach().to(torch.float64)
        if self.mean is None:
            self.count = self.count.to(f.device)
            self.mean, self.m2 = f.new_zeros(2, f.shape[-1]), f.new_zeros(2, f.shape[-1])
        for i, group in enumerate((f[:, 0], f[:, 1:].reshape(-1, f.shape[-1]))):
            n, mean = group.shape[0], group.mean(0)
            delta, total = mean - self.mean[i], self.count[i] + n
            self.m2[i] += ((group - mean) ** 2).sum(0) + delta**2 * self.count[i] * n / total
            self.mean[i] += delta * n / total
            self.count[i] = total

    def __call__(self, features: torch.Tensor) -> torch.Tensor:
        """`features` [B, T, C] standardised per channel (in float64, then float32): [B, T, C]."""
        if self.mean is None:
            raise RuntimeError("RunningStandardizer: update it with the teacher's features first")
        std = (self.m2 / (self.count[:, None] - 1).clamp_min(1)).sqrt().clamp_min(self.eps)  # [2, C]
        index = (torch.arange(features.shape[1], device=features.device) > 0).long()  # [T]: 0 for token 0, else 1
        return ((features.double() - self.mean[index]) / std[index]).float()  # float64: a large mean, a small std


def check_distill_fits(stage: StageSpec, *, has_head: bool) -> None:
    """RecipeError for a distill stage whose feature-loss options cannot apply: with a classifier head, distill
    compares logits, so feature_space and cls_weight (a head-less model's feature loss) would be ignored."""
    if stage.kind == "distill" and has_head and (stage.feature_space != "raw" or stage.cls_weight is not None):
        raise RecipeError(
            f"stage {stage.name!r}: feature_space and cls_weight shape a head-less model's feature loss, but this "
            "model has a classifier head, so distill compares its logits; drop them from the stage"
        )


def distill_loss(
    student: nn.Module,
    teacher: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor | None,
    stage: StageSpec,
    standardizer: RunningStandardizer | None = None,
) -> torch.Tensor:
    """KL(teacher ‖ student) on logits at temperature T (+ label cross-entropy), or feature cosine without a head
    (of standardised features when `standardizer` is given: updated with this batch's teacher features first;
    token 0 weighs `stage.cls_weight` of it when set)."""
    with torch.no_grad():
        t_feat, t_logits = features_and_logits(teacher, x)
    s_feat, s_logits = features_and_logits(student, x)
    if t_logits is not None:
        check_distill_fits(stage, has_head=True)
        T = stage.kd_temperature
        loss = F.kl_div(
            F.log_softmax(s_logits.float() / T, -1),
            F.log_softmax(t_logits.float() / T, -1),
            reduction="batchmean",
            log_target=True,
        ) * (T * T)
        if stage.label_weight > 0 and y is not None:
            target = y.float() if y.ndim == 2 else F.one_hot(y, s_logits.shape[-1]).float()
            ce = torch.sum(-target * F.log_softmax(s_logits.float(), -1), dim=-1).mean()
            loss = loss + stage.label_weight * ce
        return loss
    if standardizer is not None:
        standardizer.update(t_feat)
        s_feat, t_feat = standardizer(s_feat), standardizer(t_feat)
    cos = F.cosine_similarity(s_feat.float(), t_feat.float(), dim=-1)  # [B, T]: no head, token 0 and patch tokens
    if stage.cls_weight is None or cos.shape[1] < 2:
        return (1 - cos).mean()
    return stage.cls_weight * (1 - cos[:, 0]).mean() + (1 - stage.cls_weight) * (1 - cos[:, 1:]).mean()


class RecoveryObjective(nn.Module):
    """The student as a submodule and the stage's loss as `forward(x, y)`, for `Accelerator.prepare`.

    Going through this forward is what lets DDP synchronise the gradients of every stage, including
    attention transfer, which calls the student's layers one by one. The frozen teacher is held outside
    the module tree: it is in neither the state dict (checkpoints) nor DDP's parameters.
    """

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        stage: StageSpec,
        across: Callable[[torch.Tensor], torch.Tensor] | None = None,
        diffusion: Any = None,
    ) -> None:
        super().__init__()
        self.student = student
        self.stage = stage
        self.across = across  # mean over processes (None: one process)
        self.diffusion = diffusion  # the recipe's DiffusionSpec (distill_diffusion stages)
        self.standardizer = RunningStandardizer() if stage.feature_space == "standardized" else None
        object.__setattr__(self, "teacher", teacher)

    def forward(self, x: torch.Tensor, y: Any = None) -> torch.Tensor:
        try:
            loss = STAGE_LOSSES[self.stage.kind]
        except KeyError:
            raise ValueError(f"no loss for stage kind {self.stage.kind!r}; known: {sorted(STAGE_LOSSES)}") from None
        return loss(self, x, y)


# Stage kind -> loss(objective, batch inputs, batch targets): a training stage's loss, looked up by the objective.
StageLoss = Callable[[RecoveryObjective, torch.Tensor, Any], torch.Tensor]
STAGE_LOSSES: dict[str, StageLoss] = {
    "attention_transfer": lambda o, x, y: transfer_loss(o.student, o.teacher, x, o.across),
    "distill": lambda o, x, y: distill_loss(o.student, o.teacher, x, y, o.stage, o.standardizer),
}


def register_stage_loss(kind: str) -> Callable[[StageLoss], StageLoss]:
    """Decorator: `fn(objective, x, y) -> loss` computes the loss of stages of `kind` (a task registers its own
    losses this way: see `train.tasks`)."""

    def wrap(fn: StageLoss) -> StageLoss:
        STAGE_LOSSES[kind] = fn
        return fn

    return wrap
