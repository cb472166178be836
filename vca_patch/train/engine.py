"""The recipe engine: staged recovery of a patched model against its original, on Hugging Face accelerate.

One code path for a CPU, one CUDA GPU or many processes (`accelerate launch`, torchrun). Per training
stage the student (inside `RecoveryObjective`, whose forward is the stage's loss), the AdamW optimizer,
the training loader and timm's warmup-cosine schedule go through `Accelerator.prepare`; micro-batches run
under `accelerator.accumulate` / `accelerator.backward` (DDP averages the gradients), evaluation is sharded
and collected with `gather_for_metrics`. Checkpoints are `save_state` folders (RNG states included) and the
loader is a seeded, epoch-indexed sampler, so a resumed run replays the same batches and the same dropout
and drop-path draws as an uninterrupted one. Losses stay tensors; the host reads them once per optimizer
step (the divergence check), never per micro-batch.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

from vca_patch.core.atomic import atomic_write_text
from vca_patch.core.errors import ConfigError
from vca_patch.recovery.calibrate import calibrate
from vca_patch.surgery import get_patch_state
from vca_patch.train.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint, trainer_state
from vca_patch.train.diffusion import evaluate_diffusion
from vca_patch.train.evaluation import evaluate
from vca_patch.train.objective import RecoveryObjective
from vca_patch.train.optim import StageScheduler, stage_optimizer
from vca_patch.train.params import guard_lambdas, lambda_trace
from vca_patch.train.recipe import Recipe, RecipeError

MIXED_PRECISION = {"auto": "auto", "no": "no", "bf16": "bf16", "fp16": "fp16"}
_ALIASES = {"float32": "no", "fp32": "no", "none": "no", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
DEVICE_HELP = "auto, cpu, cuda or cuda:N"


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; training stopped before applying that step."""


@dataclass
class RunResult:
    """What a recipe run produced."""

    model: nn.Module  # the weights to publish (EMA when enabled)
    metrics: dict[str, Any]
    completed: bool


def mixed_precision_mode(value: str) -> str:
    """ "auto", "no", "bf16" or "fp16" from that or a dtype name (float32, bfloat16, float16)."""
    key = value.strip().lower()
    mode = MIXED_PRECISION.get(key) or _ALIASES.get(key)
    if mode is None:
        raise ValueError(f"mixed precision must be auto, no, bf16 or fp16 (or float32/bfloat16/float16), got {value!r}")
    return mode


def _use_cpu(device: str) -> bool:
    """Whether `device` means the CPU; selects GPU N for "cuda:N" (one process only)."""
    device = device.strip().lower()
    if device == "auto":
        return not torch.cuda.is_available()
    if device == "cpu":
        return True
    match = re.fullmatch(r"cuda(?::(\d+))?", device)
    if match is None:
        raise ValueError(f"device must be {DEVICE_HELP}, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: no CUDA GPU is visible to torch (torch.cuda.is_available() is False)")
    if match.group(1) is not None:
        index = int(match.group(1))
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError(
                f"device {device!r} names one GPU, but this is one of several processes (each uses its LOCAL_RANK "
                "GPU): pass device 'cuda' or 'auto', and choose GPUs with CUDA_VISIBLE_DEVICES"
            )
        torch.cuda.set_device(index)
    return False


def make_accelerator(
    mixed_precision: str = "auto", cpu: bool | None = None, *, device: str = "auto", grad_accum: int = 1
) -> Any:
    """An `accelerate.Accelerator` for the engine.

    device: "auto" (a CUDA GPU when there is one; under `accelerate launch`/torchrun each process's LOCAL_RANK
    GPU), "cpu", "cuda" or "cuda:N" (one process). `cpu=True` is the same as device="cpu".
    mixed_precision: "auto" (bf16 on a GPU that supports it, else full precision), "no", "bf16" (CPU too)
    or "fp16" (CUDA only, with a gradient scaler). The weights stay in their own dtype; forwards run under
    autocast.
    """
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import GradientAccumulationPlugin

    use_cpu = True if cpu else _use_cpu(device)
    mode = mixed_precision_mode(mixed_precision)
    if mode == "auto":
        mode = "bf16" if (not use_cpu and torch.cuda.is_bf16_supported()) else "no"
    if mode == "fp16" and use_cpu:
        raise ValueError("fp16 mixed precision needs a CUDA GPU; on the CPU use bf16")
    return Accelerator(
        mixed_precision=mode,
        cpu=use_cpu,
        gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=grad_accum, sync_with_dataloader=False),
        step_scheduler_with_optimizer=False,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )


def _configure(accelerator: Any, grad_accum: int) -> None:
    """The settings the loop relies on, also on an accelerator made elsewhere: `grad_accum` micro-batches per
    update, also across epoch ends, and the schedule stepped once per update (not once per process)."""
    accelerator.gradient_state.plugin_kwargs.update(num_steps=grad_accum, sync_with_dataloader=False)
    accelerator.step_scheduler_with_optimizer = False


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _train_loader(dataset: Dataset, batch_size: int, workers: int, world: int, seed: int) -> DataLoader:
    """Shuffled, full batches; epoch e's order comes from seed + e (accelerate's SeedableRandomSampler), and the
    loader's own generator (worker seeds) is reseeded per epoch, so no draw touches the global RNG."""
    from accelerate.data_loader import SeedableRandomSampler

    if len(dataset) < batch_size * world:
        raise ValueError(f"the training set has {len(dataset)} images, fewer than one batch ({batch_size} x {world})")
    sampler = SeedableRandomSampler(dataset, generator=torch.Generator(), data_seed=seed)
    return DataLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=True, num_workers=workers,
        generator=torch.Generator(),
    )  # fmt: skip


def _batches(accelerator: Any, loader: Any, seed: int, start: int) -> Iterator[Any]:
    """Endless micro-batches from position `start` of the sequence epoch 0, epoch 1, ... of `loader`."""
    per_epoch = len(loader)
    epoch, skip = divmod(start, per_epoch)
    while True:
        loader.set_epoch(epoch)
        loader.generator.manual_seed(seed * 1_000_003 + epoch)
        yield from accelerator.skip_first_batches(loader, skip) if skip else loader
        epoch, skip = epoch + 1, 0


class _Window:
    """Loss (a device tensor) and throughput since the last evaluation."""

    def __init__(self, device: torch.device, saved: dict[str, float] | None = None) -> None:
        saved = saved or {}
        self.loss = torch.tensor(saved.get("loss", 0.0), device=device)
        self.count, self.images, self.time = int(saved.get("count", 0)), saved.get("images", 0), saved.get("time", 0.0)

    def add(self, loss: torch.Tensor, images: int, seconds: float) -> None:
        self.loss += loss
        self.count, self.images, self.time = self.count + 1, self.images + images, self.time + seconds

    def mean_loss(self) -> float:
        return float(self.loss) / max(1, self.count)

    def throughput(self) -> float:
        return self.images / max(self.time, 1e-9)

    def state(self) -> dict[str, float]:
        return {"loss": float(self.loss), "count": self.count, "images": self.images, "time": self.time}


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

    def update(self, stage: str, step: int, info: str | None, log: bool) -> None:
        """Advance to `step`; `info` (None: keep the last) is shown on the bar, or printed when `log`."""
        if not self.enabled:
            return
        if self.bar is not None:
            extra = {"info": info} if info is not None else {}
            self.bar.update(self.task, completed=step, description=stage, **extra)
        elif log:
            self.console.print(f"[{stage}] step {step} {info}", highlight=False)

    def print(self, text: str) -> None:
        if self.enabled:
            (self.bar.console if self.bar is not None else self.console).print(text, highlight=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _check_target_states(student: nn.Module, recipe: Recipe) -> None:
    """Check every stage's `target_state` against the student's patch target (before any work)."""
    patch = get_patch_state(student)
    switching = [s.name for s in recipe.stages if s.target_state]
    if patch is None:
        if switching:
            raise RecipeError(f"stage {switching[0]!r} sets target_state, but the student is not a patched model")
        return
    for stage in recipe.stages:
        try:
            patch.config.check_stage_state(stage.target_state)
        except ConfigError as exc:
            raise RecipeError(f"stage {stage.name!r}: {exc}") from None


def stage_target_state(recipe: Recipe, stage_index: int) -> dict[str, Any]:
    """The target state in force during stage `stage_index`: the stages' `target_state` up to it, later keys win."""
    merged: dict[str, Any] = {}
    for stage in recipe.stages[: stage_index + 1]:
        merged.update(stage.target_state)
    return merged


def _apply_target_state(models: list[nn.Module], state: dict[str, Any]) -> None:
    """Hand `state` to each patched model's target (the student and its EMA copy, which has its own config)."""
    if not state:
        return
    for model in models:
        patch = get_patch_state(model)
        if patch is None:
            raise RecipeError(f"target_state {state}: {type(model).__name__} is not a patched model")
        patch.config.apply_stage_state(model, state)


def _new_ema(student: nn.Module, decay: float) -> nn.Module:
    from timm.utils.model_ema import ModelEmaV3

    ema = ModelEmaV3(student, decay=decay)
    for p in ema.parameters():
        p.requires_grad_(False)
    return ema


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

    Both models run on the accelerator's device, in the student's dtype (mixed precision per the
    accelerator). Writes output/metrics.json (every evaluation) and output/checkpoints/step_*/ every
    `train.checkpoint_every` optimizer steps and at the end of each stage. `resume` continues from the
    latest checkpoint (same number of processes). `stop_after_steps` stops (after checkpointing) at that
    global step, as an interruption would. Raises TrainingDiverged on a NaN/inf loss; the last good
    checkpoint stays on disk.
    """
    from accelerate.utils import set_seed

    output = Path(output)
    tr = recipe.train
    _check_target_states(student, recipe)  # a target_state the target cannot apply fails here, before any work
    accelerator = accelerator or make_accelerator(tr.mixed_precision, grad_accum=tr.grad_accum)
    _configure(accelerator, tr.grad_accum)
    device, world, main = accelerator.device, accelerator.num_processes, accelerator.is_main_process
    set_seed(tr.seed)
    student.to(device)
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    dtype = _model_dtype(student)
    loader = _train_loader(train_set, tr.batch_size, recipe.data.num_workers, world, tr.seed)
    mixup = None
    if recipe.data.mixup > 0 or recipe.data.cutmix > 0:
        from vca_patch.data import mixup_fn

        mixup = mixup_fn(recipe.data, num_classes)
    ema = _new_ema(student, tr.ema_decay) if tr.ema_decay > 0 else None

    metrics: dict[str, Any] = {
        "recipe": recipe.name,
        "status": "running",
        "world_size": world,
        "device": str(next(student.parameters()).device),
        "mixed_precision": accelerator.mixed_precision,
        "global_batch": tr.batch_size * world * tr.grad_accum,
        **(extra_metrics or {}),
        "evaluations": [],
    }
    global_step = stage_index = stage_step = 0
    ckpt, saved_window = None, None
    if resume:
        ckpt = latest_checkpoint(output)
        if ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {output}/checkpoints")
        progress_state = trainer_state(ckpt)
        global_step, stage_index, stage_step = (progress_state[k] for k in ("global_step", "stage_index", "stage_step"))
        metrics["evaluations"] = progress_state["evaluations"]
        metrics["before"] = progress_state.get("before", {})
        metrics["resumed_from"] = global_step
        saved_window = progress_state.get("window")

    def write_metrics() -> None:
        if main:
            output.mkdir(parents=True, exist_ok=True)
            atomic_write_text(output / "metrics.json", json.dumps(metrics, indent=2) + "\n")

    def eval_now(model: nn.Module) -> dict[str, Any]:
        if recipe.diffusion is not None:  # a diffusion transformer: layer and prediction errors (train.diffusion)
            return evaluate_diffusion(model, teacher, eval_set, tr.eval_images, recipe.diffusion)
        return evaluate(model, teacher, eval_set, tr.eval_images, accelerator)

    if not resume:
        metrics["before"] = eval_now(student)
    progress = _Progress(main, recipe.total_steps, global_step)
    completed = True
    try:
        while stage_index < len(recipe.stages):
            stage = recipe.stages[stage_index]
            target_state = stage_target_state(recipe, stage_index)  # also re-applied when resuming in this stage
            _apply_target_state([student] + ([ema.module] if ema is not None else []), target_state)
            if stage.kind == "calibrate":
                subset = Subset(train_set, range(min(stage.calibration_images, len(train_set))))
                calib = [(x.to(device=device, dtype=dtype), y) for x, y in DataLoader(subset, batch_size=64)]
                report = calibrate(student, calib)
                before, after = report.mean_error("init"), report.mean_error()
                progress.print(f"[{stage.name}] calibrated: mean layer error {before:.3f} -> {after:.3f}")
                stage_index, stage_step = stage_index + 1, 0
                if ema is not None:
                    ema = _new_ema(student, tr.ema_decay)
                continue
            accelerator.free_memory()
            across = (lambda t: accelerator.reduce(t, "mean")) if world > 1 else None
            objective = RecoveryObjective(student, teacher, stage, across, recipe.diffusion)
            optimizer = stage_optimizer(student, stage)
            scheduler = StageScheduler(optimizer, stage)
            model, optimizer, train_loader, scheduler = accelerator.prepare(objective, optimizer, loader, scheduler)
            window = _Window(device)
            if ckpt is not None:
                load_checkpoint(accelerator, ckpt, ema.module if ema is not None else None)
                window, ckpt = _Window(device, saved_window), None
            trainable = [p for g in optimizer.param_groups for p in g["params"]]
            batches = _batches(accelerator, train_loader, tr.seed, global_step * tr.grad_accum)
            model.train()
            while stage_step < stage.steps:
                tick = time.monotonic()
                step_loss = torch.zeros((), device=device)
                for _ in range(tr.grad_accum):
                    x, y = next(batches)
                    if mixup is not None and stage.kind == "distill":
                        x, y = mixup(x, y)
                    x = x.to(dtype=dtype)
                    with accelerator.accumulate(model):
                        loss = model(x, y)
                        accelerator.backward(loss)
                        step_loss += loss.detach()
                        if accelerator.sync_gradients:
                            step_loss = accelerator.reduce(step_loss, "mean") / tr.grad_accum
                            if not bool(torch.isfinite(step_loss)):  # the one host sync per optimizer step
                                metrics.update(status="diverged", diverged_at_step=global_step + 1, stage=stage.name)
                                write_metrics()
                                last = latest_checkpoint(output)
                                raise TrainingDiverged(
                                    f"loss became {float(step_loss):.3g} at step {global_step + 1} (stage "
                                    f"{stage.name!r}, stage step {stage_step + 1}); stopped before applying it. "
                                    f"Last good checkpoint: {last or 'none (no checkpoint written yet)'}"
                                )
                            if tr.grad_clip > 0:
                                accelerator.clip_grad_norm_(trainable, tr.grad_clip)
                            lr_now = optimizer.param_groups[0]["lr"]
                        optimizer.step()
                        if accelerator.sync_gradients:
                            scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
                if tr.lambda_guard == "clamp":
                    guard_lambdas(student, tr.lambda_max)
                if ema is not None:
                    ema.update(student)
                global_step += 1
                stage_step += 1
                window.add(step_loss, tr.batch_size * world * tr.grad_accum, time.monotonic() - tick)
                log = global_step % tr.log_every == 0
                rate = window.throughput()
                speed = f"{rate:.0f} img/s" if rate >= 10 else f"{rate:.2f} img/s"  # slow steps: not "0 img/s"
                info = f"loss {float(step_loss):.4f}  lr {lr_now:.2e}  {speed}" if log else None
                progress.update(stage.name, global_step, info, log)
                last_of_stage = stage_step == stage.steps
                if global_step % tr.eval_every == 0 or last_of_stage:
                    record: dict[str, Any] = {
                        "stage": stage.name,
                        "kind": stage.kind,
                        "step": global_step,
                        "stage_step": stage_step,
                        "loss": window.mean_loss(),
                        "lr": lr_now,
                        "images_per_s": window.throughput(),
                        "lambda": lambda_trace(student),
                    }
                    if target_state:
                        record["target_state"] = dict(target_state)
                    record.update(eval_now(student))
                    if ema is not None:
                        record["ema"] = {k: v for k, v in eval_now(ema.module).items() if k != "layer_error"}
                    model.train()
                    metrics["evaluations"].append(record)
                    window = _Window(device)
                    write_metrics()
                if global_step % tr.checkpoint_every == 0 or last_of_stage:
                    progress_state = {
                        "global_step": global_step,
                        "stage_index": stage_index,
                        "stage_step": stage_step,
                        "evaluations": metrics["evaluations"],
                        "before": metrics.get("before", {}),
                        "window": window.state(),
                    }
                    save_checkpoint(
                        accelerator, output, global_step, progress_state, ema.module if ema else None,
                        keep=tr.keep_checkpoints,
                    )  # fmt: skip
                if stop_after_steps is not None and global_step >= stop_after_steps:
                    completed = False
                    break
            if not completed:
                break
            stage_index, stage_step = stage_index + 1, 0
    finally:
        progress.close()
        accelerator.free_memory()
    student.eval()
    final_model = ema.module if ema is not None else student
    if completed:
        metrics["status"] = "completed"
        metrics["final"] = dict(metrics["evaluations"][-1]) if metrics["evaluations"] else {}
        if ema is not None:
            metrics["final"] = {**eval_now(ema.module), "weights": "ema"}
    else:
        metrics["status"] = "interrupted"
    write_metrics()
    return RunResult(final_model, metrics, completed)
