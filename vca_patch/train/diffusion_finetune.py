"""`finetune_diffusion`: kept for callers of the former diffusion driver; `finetune` runs every task now."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vca_patch.train.engine import RunResult
from vca_patch.train.finetune import finetune
from vca_patch.train.recipe import Recipe
from vca_patch.train.tasks.diffusion import diffusion_card_metrics

__all__ = ["diffusion_card_metrics", "finetune_diffusion"]


def finetune_diffusion(
    converted: Path, recipe: Recipe, output: Path, *, resume: bool, stop_after_steps: int | None, accelerator: Any
) -> RunResult:
    """Run a diffusion `recipe` on the converted diffusers checkpoint `converted`; publish into `output`."""
    return finetune(
        converted, recipe, output, resume=resume, stop_after_steps=stop_after_steps, accelerator=accelerator
    )
