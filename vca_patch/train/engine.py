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
from vca_patch.targets.handler import handler_for
from vca_patch.train.checkpoints import latest_checkpoint, load_checkpoint, save_checkpoint, trainer_state
from vca_patch.train.objective import RecoveryObjective
from vca_patch.train.optim import StageScheduler, stage_optimizer
from vca_patch.train.params import guard_parameters, parameter_trace
from vca_patch.train.recipe import Recipe, RecipeError, StageSpec
from vca_patch.train.tasks import task_for

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
        from vca_patch.data.errors import DatasetError  # a ValueError: the recipe's data is the user's to fix

        raise DatasetError(
            f"the training set has {len(dataset)} images, fewer than one batch ({batch_size} x {world}); give more "
            "images (data.train_limit) or a smaller train.batch_size"
        )
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
    """A rich progress bar (main process, interactive terminals) or plain log lines with the step, the total and
    the time left (piped output, e.g. a log file or a job scheduler)."""

    def __init__(self, enabled: bool, total: int, completed: int) -> None:
        self.enabled = enabled
        self.bar = None
        self.total, self.first, self.start = total, completed, time.monotonic()
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
            line = f"[{stage}] step {step}/{self.total}{self._eta(step)} {info}"
            self.console.print(line, highlight=False, markup=False)

    def _eta(self, step: int) -> str:
        """ ", ETA h:mm:ss" from the steps done in this process (empty before the first or after the last)."""
        done, left = step - self.first, self.total - step
        if done <= 0 or left <= 0:
            return ""
        seconds = int((time.monotonic() - self.start) / done * left)
        return f", ETA {seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"

    def print(self, text: str) -> None:
        if self.enabled:
            (self.bar.console if self.bar is not None else self.console).print(text, highlight=False, markup=False)

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
            handler_for(patch.config).check_stage_state(patch.config, stage.target_state)
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
        handler_for(patch.config).apply_stage_state(patch.config, model, state)


def _new_ema(student: nn.Module, decay: float) -> nn.Module:
    from timm.utils.model_ema import ModelEmaV3

    ema = ModelEmaV3(student, decay=decay)
    for p in ema.parameters():
        p.requires_grad_(False)
    return ema


@dataclass
class RunOptions:
    """What `run_recipe` takes besides the models, the recipe and the output folder."""

    train_set: Dataset
    eval_set: Dataset | None = None
    resume: bool = False  # continue from the latest checkpoint under output/checkpoints
    accelerator: Any = None  # None: one made from the recipe's train.mixed_precision
    num_classes: int = 0  # for mixup / cutmix labels
    stop_after_steps: int | None = None  # stop (after checkpointing) at this global step, as an interruption would
    extra_metrics: dict[str, Any] | None = None  # merged into metrics.json


@dataclass
class _StageLoop:
    """One training stage's prepared objects: the objective (wrapped), optimizer, schedule, batches, loss window."""

    stage: StageSpec
    target_state: dict[str, Any]
    model: Any
    optimizer: Any
    scheduler: Any
    batches: Iterator[Any]
    trainable: list[nn.Parameter]
    window: _Window
    lr: float = 0.0


def run_recipe(
    student: nn.Module,
    teacher: nn.Module,
    recipe: Recipe,
    output: str | Path,
    options: RunOptions | None = None,
    **fields: Any,
) -> RunResult:
    """Run every stage of `recipe` on `student` (patched) against `teacher` (the original, frozen).

    `options` (or its fields as keywords: train_set=..., eval_set=..., resume=..., ...; see `RunOptions`).
    Both models run on the accelerator's device, in the student's dtype (mixed precision per the
    accelerator). Writes output/metrics.json (every evaluation) and output/checkpoints/step_*/ every
    `train.checkpoint_every` optimizer steps and at the end of each stage. `resume` continues from the
    latest checkpoint (same number of processes). `stop_after_steps` stops (after checkpointing) at that
    global step, as an interruption would. Raises TrainingDiverged on a NaN/inf loss; the last good
    checkpoint stays on disk.
    """
    run = _RecipeRun(student, teacher, recipe, Path(output), options or RunOptions(**fields))
    run.begin()
    try:
        run.train_stages()
    finally:
        run.progress.close()
        run.accelerator.free_memory()
    return run.finish()


class _RecipeRun:
    """The state of one `run_recipe` call; each method is one named step of the run."""

    def __init__(self, student: nn.Module, teacher: nn.Module, recipe: Recipe, output: Path, opts: RunOptions) -> None:
        from accelerate.utils import set_seed

        tr = recipe.train
        _check_target_states(student, recipe)  # a target_state the target cannot apply fails here, before any work
        self.student, self.teacher, self.recipe, self.output, self.opts, self.tr = (
            student, teacher, recipe, output, opts, tr
        )  # fmt: skip
        self.accelerator = opts.accelerator or make_accelerator(tr.mixed_precision, grad_accum=tr.grad_accum)
        _configure(self.accelerator, tr.grad_accum)
        acc = self.accelerator
        self.device, self.world, self.main = acc.device, acc.num_processes, acc.is_main_process
        set_seed(tr.seed)
        student.to(self.device)
        teacher.to(self.device).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        self.dtype = _model_dtype(student)
        self.loader = _train_loader(opts.train_set, tr.batch_size, recipe.data.num_workers, self.world, tr.seed)
        self.task = task_for(recipe)
        self.mixup = self.task.batch_mixer(recipe, opts.num_classes)
        self.ema = _new_ema(student, tr.ema_decay) if tr.ema_decay > 0 else None
        self.metrics: dict[str, Any] = {
            "recipe": recipe.name,
            "status": "running",
            "world_size": self.world,
            "device": str(next(student.parameters()).device),
            "mixed_precision": acc.mixed_precision,
            "global_batch": tr.batch_size * self.world * tr.grad_accum,
            **(opts.extra_metrics or {}),
            "evaluations": [],
        }
        self.global_step = self.stage_index = self.stage_step = 0
        self.ckpt: Path | None = None
        self.saved_window: dict[str, float] | None = None
        self.completed = True

    # -- resume, metrics, evaluation ------------------------------------------------------------------------

    def begin(self) -> None:
        """Resume from the latest checkpoint, or measure the student before training; start the progress bar."""
        if self.opts.resume:
            self.resume()
        else:
            self.metrics["before"] = self.evaluate(self.student)
        self.progress = _Progress(self.main, self.recipe.total_steps, self.global_step)

    def resume(self) -> None:
        """Step counters, evaluations and the loss window from the latest checkpoint (its weights load later)."""
        self.ckpt = latest_checkpoint(self.output)
        if self.ckpt is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.output}/checkpoints")
        state = trainer_state(self.ckpt)
        self.global_step, self.stage_index, self.stage_step = (
            state[k] for k in ("global_step", "stage_index", "stage_step")
        )
        self.metrics["evaluations"] = state["evaluations"]
        self.metrics["before"] = state.get("before", {})
        self.metrics["resumed_from"] = self.global_step
        self.saved_window = state.get("window")

    def write_metrics(self) -> None:
        if self.main:
            self.output.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.output / "metrics.json", json.dumps(self.metrics, indent=2) + "\n")

    def evaluate(self, model: nn.Module) -> dict[str, Any]:
        """The recipe's task's measurements of `model` against the teacher on the evaluation set."""
        return self.task.evaluate(model, self.teacher, self.opts.eval_set, self.recipe, self.accelerator)

    # -- stages ----------------------------------------------------------------------------------------------

    def train_stages(self) -> None:
        """Every stage from the current one on; stops early (self.completed False) at `stop_after_steps`."""
        while self.stage_index < len(self.recipe.stages):
            stage = self.recipe.stages[self.stage_index]
            target_state = self.enter_stage()
            if stage.kind == "calibrate":
                self.calibrate(stage)
            elif not self.train_stage(stage, target_state):
                self.completed = False
                return
            self.stage_index, self.stage_step = self.stage_index + 1, 0

    def enter_stage(self) -> dict[str, Any]:
        """Put the student (and its EMA copy) into the stage's target state; also re-applied when resuming."""
        target_state = stage_target_state(self.recipe, self.stage_index)
        _apply_target_state([self.student] + ([self.ema.module] if self.ema is not None else []), target_state)
        return target_state

    def calibrate(self, stage: StageSpec) -> None:
        """A calibration stage: closed-form fit of the new layers on the first training images."""
        train_set = self.opts.train_set
        subset = Subset(train_set, range(min(stage.calibration_images, len(train_set))))
        calib = [(x.to(device=self.device, dtype=self.dtype), y) for x, y in DataLoader(subset, batch_size=64)]
        report = calibrate(self.student, calib)
        before, after = report.mean_error("init"), report.mean_error()
        self.progress.print(f"[{stage.name}] calibrated: mean layer error {before:.3f} -> {after:.3f}")
        if self.ema is not None:
            self.ema = _new_ema(self.student, self.tr.ema_decay)

    def prepare_stage(self, stage: StageSpec, target_state: dict[str, Any]) -> _StageLoop:
        """The stage's objective, optimizer, schedule and loader through `Accelerator.prepare`; a pending resume
        checkpoint loads into them."""
        acc = self.accelerator
        acc.free_memory()
        across = (lambda t: acc.reduce(t, "mean")) if self.world > 1 else None
        objective = RecoveryObjective(self.student, self.teacher, stage, across, self.recipe.diffusion)
        optimizer = stage_optimizer(self.student, stage)
        scheduler = StageScheduler(optimizer, stage)
        model, optimizer, train_loader, scheduler = acc.prepare(objective, optimizer, self.loader, scheduler)
        window = _Window(self.device)
        if self.ckpt is not None:
            load_checkpoint(acc, self.ckpt, self.ema.module if self.ema is not None else None)
            window, self.ckpt = _Window(self.device, self.saved_window), None
        trainable = [p for g in optimizer.param_groups for p in g["params"]]
        batches = _batches(acc, train_loader, self.tr.seed, self.global_step * self.tr.grad_accum)
        return _StageLoop(stage, target_state, model, optimizer, scheduler, batches, trainable, window)

    def train_stage(self, stage: StageSpec, target_state: dict[str, Any]) -> bool:
        """The optimizer steps of one training stage; False when stopped at `stop_after_steps`."""
        loop = self.prepare_stage(stage, target_state)
        loop.model.train()
        while self.stage_step < stage.steps:
            tick = time.monotonic()
            step_loss = self.optimizer_step(loop)
            self.guard_parameters()
            if self.ema is not None:
                self.ema.update(self.student)
            self.global_step += 1
            self.stage_step += 1
            loop.window.add(step_loss, self.tr.batch_size * self.world * self.tr.grad_accum, time.monotonic() - tick)
            self.log_step(loop, step_loss)
            last_of_stage = self.stage_step == stage.steps
            if self.global_step % self.tr.eval_every == 0 or last_of_stage:
                self.evaluate_step(loop)
            if self.global_step % self.tr.checkpoint_every == 0 or last_of_stage:
                self.checkpoint(loop)
            stop = self.opts.stop_after_steps
            if stop is not None and self.global_step >= stop:
                return False
        return True

    # -- one optimizer step ----------------------------------------------------------------------------------

    def optimizer_step(self, loop: _StageLoop) -> torch.Tensor:
        """`grad_accum` micro-batches and one update; the step's mean loss (a device tensor)."""
        acc, tr = self.accelerator, self.tr
        step_loss = torch.zeros((), device=self.device)
        for _ in range(tr.grad_accum):
            x, y = next(loop.batches)
            if self.mixup is not None and loop.stage.kind == "distill":
                x, y = self.mixup(x, y)
            x = x.to(dtype=self.dtype)
            with acc.accumulate(loop.model):
                loss = loop.model(x, y)
                acc.backward(loss)
                step_loss += loss.detach()
                if acc.sync_gradients:
                    step_loss = acc.reduce(step_loss, "mean") / tr.grad_accum
                    self.check_finite(loop.stage, step_loss)
                    if tr.grad_clip > 0:
                        acc.clip_grad_norm_(loop.trainable, tr.grad_clip)
                    loop.lr = loop.optimizer.param_groups[0]["lr"]
                loop.optimizer.step()
                if acc.sync_gradients:
                    loop.scheduler.step()
                loop.optimizer.zero_grad(set_to_none=True)
        return step_loss

    def check_finite(self, stage: StageSpec, step_loss: torch.Tensor) -> None:
        """Stop (TrainingDiverged, metrics marked) before applying a NaN/inf loss: the one host sync per step."""
        if bool(torch.isfinite(step_loss)):
            return
        self.metrics.update(status="diverged", diverged_at_step=self.global_step + 1, stage=stage.name)
        self.write_metrics()
        last = latest_checkpoint(self.output)
        raise TrainingDiverged(
            f"loss became {float(step_loss):.3g} at step {self.global_step + 1} (stage {stage.name!r}, stage step "
            f"{self.stage_step + 1}); stopped before applying it. "
            f"Last good checkpoint: {last or 'none (no checkpoint written yet)'}"
        )

    def guard_parameters(self) -> None:
        """The target's parameter guard after each update, as its keys of the recipe's `train` section say (VCA: λ
        projected back into [0, lambda_max] under `lambda_guard: clamp`)."""
        guard_parameters(self.student, self.tr)

    def log_step(self, loop: _StageLoop, step_loss: torch.Tensor) -> None:
        log = self.global_step % self.tr.log_every == 0
        rate = loop.window.throughput()
        speed = f"{rate:.0f} img/s" if rate >= 10 else f"{rate:.2f} img/s"  # slow steps: not "0 img/s"
        info = f"loss {float(step_loss):.4f}  lr {loop.lr:.2e}  {speed}" if log else None
        self.progress.update(loop.stage.name, self.global_step, info, log)

    # -- evaluation and checkpoints ------------------------------------------------------------------------

    def evaluate_step(self, loop: _StageLoop) -> None:
        """Record the window's loss and throughput and the task's measurements (and the EMA's) in metrics.json."""
        stage = loop.stage
        record: dict[str, Any] = {
            "stage": stage.name,
            "kind": stage.kind,
            "step": self.global_step,
            "stage_step": self.stage_step,
            "loss": loop.window.mean_loss(),
            "lr": loop.lr,
            "images_per_s": loop.window.throughput(),
            **parameter_trace(self.student),  # the target's health values (VCA: "lambda")
        }
        if loop.target_state:
            record["target_state"] = dict(loop.target_state)
        record.update(self.evaluate(self.student))
        if self.ema is not None:
            record["ema"] = {k: v for k, v in self.evaluate(self.ema.module).items() if k != "layer_error"}
        loop.model.train()
        self.metrics["evaluations"].append(record)
        loop.window = _Window(self.device)
        self.write_metrics()

    def checkpoint(self, loop: _StageLoop) -> None:
        """A `save_state` checkpoint with the step counters, evaluations and loss window to resume from."""
        progress_state = {
            "global_step": self.global_step,
            "stage_index": self.stage_index,
            "stage_step": self.stage_step,
            "evaluations": self.metrics["evaluations"],
            "before": self.metrics.get("before", {}),
            "window": loop.window.state(),
        }
        ema = self.ema.module if self.ema else None
        save_checkpoint(
            self.accelerator, self.output, self.global_step, progress_state, ema, keep=self.tr.keep_checkpoints
        )

    def finish(self) -> RunResult:
        """The final metrics (the EMA weights measured again) and the weights to publish."""
        self.student.eval()
        final_model = self.ema.module if self.ema is not None else self.student
        if self.completed:
            self.metrics["status"] = "completed"
            evaluations = self.metrics["evaluations"]
            self.metrics["final"] = dict(evaluations[-1]) if evaluations else {}
            if self.ema is not None:
                self.metrics["final"] = {**self.evaluate(self.ema.module), "weights": "ema"}
        else:
            self.metrics["status"] = "interrupted"
        self.write_metrics()
        return RunResult(final_model, self.metrics, self.completed)
