"""`vca-patch finetune`: run a recovery recipe on a converted checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .common import console, fail


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
) -> None:
    """Recover CONVERTED with RECIPE; writes a loadable checkpoint, metrics.json and checkpoints/ to --output.

    Runs on one device as is, or on several with `accelerate launch -m vca_patch finetune ...`
    (or torchrun); every stage runs on the chosen device, under the chosen autocast dtype.
    """
    from ..data import DatasetError
    from ..io import CheckpointError
    from ..train import RecipeError, TrainingDiverged, load_recipe
    from ..train import finetune as run
    from ..train.checkpoints import latest_checkpoint
    from ..train.engine import make_accelerator

    try:
        spec = load_recipe(recipe)
    except RecipeError as exc:
        fail(str(exc), 2)
    if not resume and latest_checkpoint(output) is not None:
        fail(f"{output} already holds training checkpoints: pass --resume to continue, or choose a new --output", 2)
    try:
        accelerator = make_accelerator(
            mixed_precision or spec.train.mixed_precision,
            device="cpu" if cpu else device,
            grad_accum=spec.train.grad_accum,
        )
    except ValueError as exc:
        fail(str(exc), 2)
    try:
        result = run(converted, spec, output, resume=resume, accelerator=accelerator)
    except (RecipeError, DatasetError, CheckpointError, FileNotFoundError) as exc:
        fail(str(exc), 2)
    except TrainingDiverged as exc:
        fail(str(exc), 1)
    if not accelerator.is_main_process:
        return
    final = result.metrics.get("final", {})
    shown = ", ".join(f"{k} {final[k]:.4f}" for k in ("top1_patched", "top1_agreement", "cls_cosine") if k in final)
    console.print(f"[bold green]Recovered[/] {output}/ ({shown}); metrics in {output}/metrics.json")
