"""`vca-patch finetune`: run a recovery recipe on a converted checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer

from vca_patch.cli.common import console, fail
from vca_patch.cli.errors import hold
from vca_patch.core.lock import output_lock

RUN_FILES = ("model.safetensors", "config.json", "README.md", "metrics.json", "checkpoints")


def _is_run(output: Path) -> bool:
    """Whether `output` holds a finetune run: a metrics.json that names a recipe, or training checkpoints."""
    if (output / "checkpoints").is_dir():
        return True
    try:
        metrics = json.loads((output / "metrics.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(metrics, dict) and "recipe" in metrics


def check_finetune_output(converted: Path, recipe: Path, spec, output: Path, *, resume: bool, force: bool) -> None:
    """Exit with one line when --output would change an input, land in a foreign folder, or restart a run."""
    from vca_patch.core.paths import check_output
    from vca_patch.train.checkpoints import latest_checkpoint

    data = Path(spec.data.path) if spec.data.path else None
    inputs = {"converted checkpoint": converted, "recipe": recipe, "dataset": data}
    # written into, not replaced: it may hold an input, but none of the files a run writes may be one
    check_output(output, inputs, kind="folder", replaces=False, writes=RUN_FILES, option="--output")
    if not resume and latest_checkpoint(output) is not None:
        fail(f"{output} already holds training checkpoints: pass --resume to continue, or choose a new --output", 2)
    if not resume and output.is_dir() and any(output.iterdir()) and not _is_run(output) and not force:
        fail(
            f"{output} is not empty and holds no finetune run; choose a new --output, or pass --force to write "
            f"{', '.join(RUN_FILES)} into it (other files stay)",
            2,
        )


def finetune(
    converted: Annotated[Path, typer.Argument(help="A converted checkpoint folder (vca-patch convert)")],
    recipe: Annotated[Path, typer.Option(help="Recipe YAML file (see recipes/)")],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder for the recovered checkpoint")],
    resume: Annotated[bool, typer.Option("--resume", help="Continue from the latest checkpoint in --output")] = False,
    device: Annotated[
        str, typer.Option(help="auto (a CUDA GPU when present), cpu, cuda or cuda:N (one process)")
    ] = "auto",
    mixed_precision: Annotated[
        str | None,
        typer.Option(
            "--mixed-precision",
            "--dtype",
            help="Autocast dtype: no (float32), bf16 (CPU too) or fp16 (CUDA); default: the recipe's "
            "train.mixed_precision (auto: bf16 on a GPU that supports it). The weights stay float32.",
        ),
    ] = None,
    cpu: Annotated[bool, typer.Option("--cpu", help="Same as --device cpu", hidden=True)] = False,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Write into a non-empty folder that is not a finetune run (only model.safetensors, config.json, "
            "README.md, metrics.json and checkpoints/ are written; other files stay)",
        ),
    ] = False,
    skip_bad_images: Annotated[
        bool,
        typer.Option(
            "--skip-bad-images",
            help="Skip unreadable or corrupt image files (counted and named on stderr); also the recipe's "
            "data.skip_bad_images",
        ),
    ] = False,
) -> None:
    """Recover CONVERTED with RECIPE; writes a loadable checkpoint, metrics.json and checkpoints/ to --output.

    Runs on one device as is, or on several with `accelerate launch -m vca_patch finetune ...`
    (or torchrun); every stage runs on the chosen device, under the chosen autocast dtype.
    """
    from vca_patch.checkpoint import CheckpointError
    from vca_patch.train import finetune as run
    from vca_patch.train import load_recipe

    spec = load_recipe(recipe)
    if skip_bad_images:
        spec.data.skip_bad_images = True
    check_finetune_output(converted, recipe, spec, output, resume=resume, force=force)
    if resume:
        _announce_resume(output)
    accelerator = _accelerator(mixed_precision or spec.train.mixed_precision, "cpu" if cpu else device, spec)
    if accelerator.is_main_process:  # a second run into --output fails at once, naming this one
        hold(output_lock(output, "vca-patch finetune"))
    # errors (recipe, data, checkpoint: 2; diverged: 1; Ctrl-C: 130, SIGTERM: 143) are reported by the CLI's boundary
    try:
        result = run(converted, spec, output, resume=resume, accelerator=accelerator)
    except FileNotFoundError as exc:  # an incomplete training checkpoint under --output: the user's files
        raise CheckpointError(str(exc)) from exc
    if accelerator.is_main_process:
        _print_result(output, result.metrics.get("final", {}))


def _announce_resume(output: Path) -> None:
    """The step --resume continues from, or a one-line refusal when --output holds no training checkpoint."""
    from vca_patch.train.checkpoints import latest_checkpoint
    from vca_patch.train.finetune import resume_point

    step = resume_point(output)
    if step is None:
        fail(f"--resume: {output} holds no training checkpoint (checkpoints/step_*); run without --resume", 2)
    console.print(f"Resuming from step {step} ({latest_checkpoint(output)})", highlight=False)


def _accelerator(mixed_precision: str, device: str, spec: Any) -> Any:
    """The accelerate Accelerator for --device and the autocast dtype; a bad value is the user's to fix."""
    from vca_patch.core.errors import ConfigError
    from vca_patch.train.engine import make_accelerator

    try:
        return make_accelerator(mixed_precision, device=device, grad_accum=spec.train.grad_accum)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def _print_result(output: Path, final: dict[str, float]) -> None:
    keys = ("top1_patched", "top1_agreement", "cls_cosine", "prediction_error", "mean_layer_error")  # (diffusion)
    shown = ", ".join(f"{k} {final[k]:.4f}" for k in keys if k in final)
    console.print(f"[bold green]Recovered[/] {output}/ ({shown}); metrics in {output}/metrics.json")
