"""The recipe engine: staged recovery of a patched model against its original, on Hugging Face accelerate.

One code path for a CPU, one CUDA GPU or many processes (`accelerate launch`, torchrun): batches are
drawn by a deterministic, step-indexed sampler sharded over processes, gradients are averaged over
processes after each accumulation window, and only the main process evaluates and writes. Resuming
from a checkpoint replays exactly the same batches, so results match an uninterrupted run.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from ..adapters.call_shims import attention_output, call_tokens
from ..fidelity import features_and_logits, fidelity
from ..io.atomic import atomic_write_text
from ..recovery.calibrate import calibrate
from ..recovery.capture import patched_modules
from ..surgery import get_patch_state
from .checkpoints import latest_checkpoint, load_training_state, save_training_state
from .ema import ModelEma
from .params import guard_lambdas, lambda_trace, parameter_groups
from .recipe import Recipe, StageSpec


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped before applying that step."""


@dataclass
class RunResult:
    """What a recipe run produced."""

    model: nn.Module  # the weights to publish (EMA when enabled)
    metrics: dict[str, Any]
    completed: bool


def make_accelerator(mixed_precision: str = "auto", cpu: bool | None = None) -> Any:
    """An `accelerate.Accelerator`; "auto" picks bf16 on a GPU that supports it, else full precision."""
    from accelerate import Accelerator

    if cpu is None:
        cpu = not torch.cuda.is_available()
    if mixed_precision == "auto":
        mixed_precision = "bf16" if (not cpu and torch.cuda.is_bf16_supported()) else "no"
    return Accelerator(mixed_precision=mixed_precision, cpu=cpu)


class BatchStream:
    """Deterministic batches indexed by micro-step: micro-step u covers positions [u·G, (u+1)·G) of
    an endless sequence of seeded epoch permutations (G = per-process batch × processes); each
    process takes its own slice. No loader state, so a resumed run sees the same batches."""

    def __init__(self, dataset: Dataset, batch_size: int, rank: int, world: int, seed: int, workers: int = 0) -> None:
        if len(dataset) == 0:
            raise ValueError("the training set is empty")
        self.dataset, self.batch_size, self.rank, self.world = dataset, batch_size, rank, world
        self.seed, self.workers = seed, workers
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms = {epoch: torch.randperm(len(self.dataset), generator=g)}
        return self._perms[epoch]

    def indices(self, micro_step: int) -> list[int]:
        start = (micro_step * self.world + self.rank) * self.batch_size
        n = len(self.dataset)
        return [int(self._perm(p // n)[p % n]) for p in range(start, start + self.batch_size)]

    def batches(self, start: int, count: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if isinstance(self.dataset, TensorDataset):
            for u in range(start, start + count):
                idx = torch.tensor(self.indices(u))
                yield tuple(t[idx] for t in self.dataset.tensors)
            return
        sampler = [self.indices(u) for u in range(start, start + count)]
        yield from DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.workers)


def _stage_lr(stage: StageSpec, step: int) -> float:
    """Multiplier of the base lr at stage step `step`: linear warmup then cosine to min_lr_ratio."""
    if step < stage.warmup_steps:
        return (step + 1) / stage.warmup_steps
    progress = (step - stage.warmup_steps) / max(1, stage.steps - stage.warmup_steps)
    return stage.min_lr_ratio + (1 - stage.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _optimizer(model: nn.Module, stage: StageSpec) -> torch.optim.Optimizer:
    groups = parameter_groups(model)
    lrs = {"new": stage.lr, "lambda": stage.lambda_lr, "carried": stage.carried_lr, "rest": stage.rest_lr}
    if stage.kind == "attention_transfer":
        lrs["rest"] = 0.0  # outside attention nothing is in the loss
    param_groups = []
    for name, params in groups.items():
        for _, p in params:
            p.requires_grad_(lrs[name] > 0)
        trainable = [p for _, p in params if lrs[name] > 0]
        if trainable:
            wd = stage.weight_decay if name in ("carried", "rest") else 0.0
            param_groups.append({"params": trainable, "lr": lrs[name], "base_lr": lrs[name], "weight_decay": wd})
    if not param_groups:
        raise ValueError(f"stage {stage.name!r} trains nothing: every learning rate is 0")
    return torch.optim.AdamW(param_groups, betas=(0.9, 0.999))


def _transfer_loss(student: nn.Module, teacher: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Mean over layers of ‖VCA(x_l) − MHSA(x_l)‖² / ‖MHSA(x_l)‖², x_l the teacher's layer input."""
    paths = list(patched_modules(student))
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    handles = [
        teacher.get_submodule(p).register_forward_hook(
            lambda m, a, k, o, path=p, store=captured: store.__setitem__(
                path, (call_tokens(a, k).detach(), attention_output(o).detach())
            ),
            with_kwargs=True,
        )
        for p in paths
    ]
    try:
        with torch.no_grad():
            features_and_logits(teacher, x)
    finally:
        for h in handles:
            h.remove()
    state = get_patch_state(student)
    state.adapter.embedding_module(student)(x)  # sets the token layout (grid) for this input
    layout = state.tracker.current()
    losses = []
    for p in paths:
        inp, target = captured[p]
        out = attention_output(student.get_submodule(p)(inp, layout=layout))
        losses.append((out.float() - target.float()).pow(2).sum() / target.float().pow(2).sum().clamp_min(1e-12))
    return torch.stack(losses).mean()


def _distill_loss(
    student: nn.Module, teacher: nn.Module, x: torch.Tensor, y: torch.Tensor | None, stage: StageSpec
) -> torch.Tensor:
    with torch.no_grad():
        t_feat, t_logits = features_and_logits(teacher, x)
    s_feat, s_logits = features_and_logits(student, x)
    if t_logits is not None:
        T = stage.kd_temperature
        loss = F.kl_div(
            F.log_softmax(s_logits.float() / T, -1),
            F.log_softmax(t_logits.float() / T, -1),
            reduction="batchmean",
            log_target=True,
        ) * (T * T)
        if stage.label_weight > 0 and y is not None:
            target = y if y.ndim == 2 else F.one_hot(y, s_logits.shape[-1]).float()
            ce = torch.sum(-target * F.log_softmax(s_logits.float(), -1), dim=-1).mean()
            loss = loss + stage.label_weight * ce
        return loss
    # No head: cosine on the prefix token 0 and the patch tokens.
    cos = F.cosine_similarity(s_feat.float(), t_feat.float(), dim=-1)
    return (1 - cos).mean()


def _sync_gradients(params: list[nn.Parameter], world: int) -> None:
    if world <= 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p, g in zip(params, grads, strict=True):
        p.grad = flat[offset : offset + g.numel()].view_as(g).clone()
        offset += g.numel()


def _any_process(flag: bool, device: torch.device, world: int) -> bool:
    if world <= 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t)
    return bool(t.item() > 0)


class _Progress:
    """A rich progress bar (main process, interactive terminals) or plain log lines."""

    def __init__(self, enabled: bool, total: int, completed: int) -> None:
        self.enabled = enabled
        self.bar = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        console = Console(stderr=True)
        if console.is_terminal:
            self.bar = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=console,
            )
            self.task = self.bar.add_task("recovery", total=total, completed=completed, info="")
            self.bar.start()
        self.console = console

    def update(self, stage: str, step: int, info: str, log: bool) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=step, description=stage, info=info)
        elif log:
            self.console.print(f"[{stage}] step {step} {info}", highlight=False)

    def print(self, text: str) -> None:
        if self.enabled:
            (self.bar.console if self.bar is not None else self.console).print(text, highlight=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def evaluate(student: nn.Module, teacher: nn.Module, eval_set: Dataset | None, images: int) -> dict[str, Any]:
    """Fidelity to the teacher (and accuracy when labelled) on the first `images` eval images."""
    if eval_set is None:
        return {}
    device = next(student.parameters()).device
    n = min(images, len(eval_set))
    batches = (
        (x.to(device), y.to(device)) for x, y in DataLoader(torch.utils.data.Subset(eval_set, range(n)), batch_size=128)
    )
    report = fidelity(teacher, student, batches)
    return {**report.summary(), "layer_error": report.layer_error}


def run_recipe(
    student: nn.Module,
    teacher: nn.Module,
    recipe: Recipe,
    output: str | Path,
    *,
    train_set: Dataset,
    eval_set: Dataset | None = None,
    resume: bool = False,
    accelerator: Any = None,
    num_classes: int = 0,
    stop_after_steps: int | None = None,
    extra_metrics: dict[str, Any] | None = None,
) -> RunResult:
    """Run every stage of `recipe` on `student` (patched) against `teacher` (the original, frozen).

    Writes output/metrics.json (every evaluation) and output/checkpoints/step_*.pt every
    `train.checkpoint_every` optimizer steps. `resume` continues from the latest checkpoint.
    `stop_after_steps` stops (after checkpointing) at that global step, as an interruption would.
    Raises TrainingDiverged on a NaN/inf loss; the last good checkpoint stays on disk.
    """
    output = Path(output)
    tr = recipe.train
    accelerator = accelerator or make_accelerator(tr.mixed_precision)
    device, world, rank = accelerator.device, accelerator.num_processes, accelerator.process_index
    main = accelerator.is_main_process
    torch.manual_seed(tr.seed)
    student.to(device)
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    stream = BatchStream(train_set, tr.batch_size, rank, world, tr.seed, recipe.data.num_workers)
    mixup = None
    if recipe.data.mixup > 0 or recipe.data.cutmix > 0:
        from ..data import mixup_fn

        mixup = mixup_fn(recipe.data, num_classes)
    ema = ModelEma(student, tr.ema_decay) if tr.ema_decay > 0 else None

    metrics: dict[str, Any] = {
        "recipe": recipe.name,
        "status": "running",
        "world_size": world,
        "device": str(device),
        "mixed_precision": accelerator.mixed_precision,
        "global_batch": tr.batch_size * world * tr.grad_accum,
        **(extra_metrics or {}),
        "evaluations": [],
    }
    global_step = stage_index = stage_step = micro_step = 0
    opt_state = None
    if resume:
        ckpt = latest_checkpoint(output)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {output}/checkpoints")
        state = load_training_state(ckpt)
        student.load_state_dict(state["model"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        global_step, stage_index, stage_step = state["global_step"], state["stage_index"], state["stage_step"]
        micro_step, opt_state = state["micro_step"], state["optimizer"]
        metrics["evaluations"] = state["evaluations"]
        metrics["before"] = state.get("before", {})
        metrics["resumed_from"] = global_step

    def write_metrics() -> None:
        if main:
            output.mkdir(parents=True, exist_ok=True)
            atomic_write_text(output / "metrics.json", json.dumps(metrics, indent=2) + "\n")

    def checkpoint(optimizer: torch.optim.Optimizer | None, window: dict[str, float]) -> None:
        if main:
            save_training_state(
                output,
                global_step,
                {
                    "global_step": global_step,
                    "stage_index": stage_index,
                    "stage_step": stage_step,
                    "micro_step": micro_step,
                    "model": student.state_dict(),
                    "ema": ema.state_dict() if ema is not None else None,
                    "optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "evaluations": metrics["evaluations"],
                    "before": metrics.get("before", {}),
                    "window": dict(window),
                },
                keep=tr.keep_checkpoints,
            )
        accelerator.wait_for_everyone()

    if not resume and main:
        metrics["before"] = {k: v for k, v in evaluate(student, teacher, eval_set, tr.eval_images).items()}
    progress = _Progress(main, recipe.total_steps, global_step)
    completed = True
    try:
        while stage_index < len(recipe.stages):
            stage = recipe.stages[stage_index]
            if stage.kind == "calibrate":
                n = stage.calibration_images
                calib = [
                    (x.to(device), y)
                    for x, y in DataLoader(
                        torch.utils.data.Subset(train_set, range(min(n, len(train_set)))), batch_size=64
                    )
                ]
                report = calibrate(student, calib)
                before, after = report.mean_error("init"), report.mean_error()
                progress.print(f"[{stage.name}] calibrated: mean layer error {before:.3f} -> {after:.3f}")
                stage_index, stage_step = stage_index + 1, 0
                if ema is not None:
                    ema = ModelEma(student, tr.ema_decay)
                continue
            optimizer = _optimizer(student, stage)
            if opt_state is not None:
                optimizer.load_state_dict(opt_state)
                opt_state = None
            trainable = [p for g in optimizer.param_groups for p in g["params"]]
            window = {"loss": 0.0, "count": 0, "images": 0, "time": 0.0}
            if resume and metrics.get("resumed_from") == global_step and "window" in state:
                window.update(state["window"])
            student.train()
            while stage_step < stage.steps:
                tick = time.monotonic()
                factor = _stage_lr(stage, stage_step)
                for group in optimizer.param_groups:
                    group["lr"] = group["base_lr"] * factor
                optimizer.zero_grad(set_to_none=True)
                step_loss = 0.0
                for x, y in stream.batches(micro_step, tr.grad_accum):
                    x, y = x.to(device), y.to(device)
                    if mixup is not None and stage.kind == "distill":
                        np.random.seed((tr.seed * 7919 + micro_step) % 2**32)
                        torch.manual_seed(tr.seed * 7919 + micro_step)
                        x, y = mixup(x, y)
                    with accelerator.autocast():
                        if stage.kind == "attention_transfer":
                            loss = _transfer_loss(student, teacher, x)
                        else:
                            loss = _distill_loss(student, teacher, x, y, stage)
                    bad = _any_process(not bool(torch.isfinite(loss.detach())), device, world)
                    if bad:
                        metrics.update(status="diverged", diverged_at_step=global_step + 1, stage=stage.name)
                        write_metrics()
                        last = latest_checkpoint(output)
                        raise TrainingDiverged(
                            f"loss became {float(loss.detach()):.3g} at step {global_step + 1} (stage {stage.name!r}, "
                            f"stage step {stage_step + 1}); stopped before applying it. Last good checkpoint: "
                            f"{last or 'none (no checkpoint written yet)'}"
                        )
                    (loss / tr.grad_accum).backward()
                    step_loss += float(loss.detach()) / tr.grad_accum
                    micro_step += 1
                _sync_gradients(trainable, world)
                if tr.grad_clip > 0:
                    nn.utils.clip_grad_norm_(trainable, tr.grad_clip)
                optimizer.step()
                if tr.lambda_guard == "clamp":
                    guard_lambdas(student, tr.lambda_max)
                if ema is not None:
                    ema.update(student)
                global_step += 1
                stage_step += 1
                window["loss"] += step_loss
                window["count"] += 1
                window["images"] += tr.batch_size * world * tr.grad_accum
                window["time"] += time.monotonic() - tick
                throughput = window["images"] / max(window["time"], 1e-9)
                lr_now = optimizer.param_groups[0]["lr"]
                progress.update(
                    stage.name,
                    global_step,
                    f"loss {step_loss:.4f}  lr {lr_now:.2e}  {throughput:.0f} img/s",
                    global_step % tr.log_every == 0,
                )
                last_of_stage = stage_step == stage.steps
                if global_step % tr.eval_every == 0 or last_of_stage:
                    record: dict[str, Any] = {
                        "stage": stage.name,
                        "kind": stage.kind,
                        "step": global_step,
                        "stage_step": stage_step,
                        "loss": window["loss"] / max(1, window["count"]),
                        "lr": lr_now,
                        "images_per_s": throughput,
                        "lambda": lambda_trace(student),
                    }
                    if main:
                        record.update(evaluate(student, teacher, eval_set, tr.eval_images))
                        if ema is not None:
                            ema_eval = evaluate(ema.module, teacher, eval_set, tr.eval_images)
                            record["ema"] = {k: v for k, v in ema_eval.items() if k != "layer_error"}
                        student.train()
                    metrics["evaluations"].append(record)
                    window = {"loss": 0.0, "count": 0, "images": 0, "time": 0.0}
                    write_metrics()
                if last_of_stage:
                    stage_index, stage_step = stage_index + 1, 0
                if global_step % tr.checkpoint_every == 0 or last_of_stage:
                    checkpoint(optimizer if not last_of_stage else None, window)
                if stop_after_steps is not None and global_step >= stop_after_steps:
                    completed = False
                    break
                if last_of_stage:
                    break
            if not completed:
                break
    finally:
        progress.close()
    student.eval()
    final_model = ema.module if ema is not None else student
    if completed:
        metrics["status"] = "completed"
        metrics["final"] = {k: v for k, v in metrics["evaluations"][-1].items()} if metrics["evaluations"] else {}
        if ema is not None and main:
            metrics["final"] = {**evaluate(ema.module, teacher, eval_set, tr.eval_images), "weights": "ema"}
    else:
        metrics["status"] = "interrupted"
    write_metrics()
    return RunResult(final_model, metrics, completed)
