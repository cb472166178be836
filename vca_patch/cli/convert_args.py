"""The options of `vca-patch convert`, as one dataclass (typer reads its fields; `convert` and `convert_budget` take
an instance)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from vca_patch.cli.common import DEVICE_HELP, DTYPE_HELP
from vca_patch.cli.fidelity import SKIP_HELP
from vca_patch.cli.target_options import target_names

LLAVA_SP = "llava-sp"  # not a registered target: its own command path, `convert._convert_llava_sp`


@dataclass
class ConvertArgs:
    """`convert`'s options besides the targets' (which come from their config fields)."""

    model: Annotated[
        str,
        typer.Argument(
            help="timm model name (e.g. deit_tiny_patch16_224), hf-hub:ORG/NAME, or a transformers or diffusers model "
            "(a local folder, e.g. a diffusers pipeline with model_index.json + transformer/, or ORG/NAME)"
        ),
    ]
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the converted checkpoint to")]
    pretrained: Annotated[bool, typer.Option(help="Start from pretrained Hub weights (--no-pretrained: random)")] = True
    weights: Annotated[
        Path | None, typer.Option(help="Local weights (.safetensors/.pth) for MODEL instead of the Hub's")
    ] = None
    layers: Annotated[str | None, typer.Option(help="Blocks to convert, e.g. '0-5,8' (default: all)")] = None
    include: Annotated[str | None, typer.Option(help="Regex: convert only matching module paths")] = None
    exclude: Annotated[str | None, typer.Option(help="Regex: never convert matching module paths")] = None
    strict: Annotated[bool, typer.Option("--strict", help="Refuse approximate or unverified conversions")] = False
    to: Annotated[str | None, typer.Option("--to", help=f"Target: {target_names((LLAVA_SP,))} (default: vca)")] = None
    probe_size: Annotated[int, typer.Option(help="Images in the probe batch that measures the change")] = 4
    seed: Annotated[
        int, typer.Option(help="Seed of random base weights, of the init's random parts and of the probe batch")
    ] = 0
    grow_tokens: Annotated[
        float | None,
        typer.Option(help="VCA calibration: layers whose error stays above this get 4x the contrast tokens (e.g. 0.4)"),
    ] = None
    calibration_data: Annotated[
        Path | None, typer.Option(help="VCA: calibrate on real images (idx folder, ImageFolder root, HF name)")
    ] = None
    calibration_kind: Annotated[
        str | None, typer.Option(help="fashion_mnist, imagefolder or hf (default: from --calibration-data)")
    ] = None
    calibration_images: Annotated[
        int | None, typer.Option(help="Images used to calibrate, and to measure (default: 256; --budget: 8)")
    ] = None
    skip_bad_images: Annotated[bool, typer.Option("--skip-bad-images", help=SKIP_HELP)] = False
    split: Annotated[
        str, typer.Option(help="--calibration-data split to calibrate on (ImageFolder: its sub-folder; flat: 4 in 5)")
    ] = "train"
    eval_split: Annotated[
        str, typer.Option(help="--calibration-data split to measure on (val/validation/test aliases; flat: 1 in 5)")
    ] = "test"
    force: Annotated[
        bool, typer.Option("--force", help="Replace a non-empty output folder as a whole (its other files are listed)")
    ] = False
    img_size: Annotated[
        int | None, typer.Option(help="Input size in pixels (timm's img_size; transformers: the config's; DINOv2: any)")
    ] = None
    device: Annotated[str, typer.Option(help=f"Where to convert and measure: {DEVICE_HELP}")] = "auto"
    dtype: Annotated[str, typer.Option(help=f"{DTYPE_HELP} (the model is cast, then patched)")] = "float32"
    spatial_variant: Annotated[str, typer.Option(help="LLaVA-SP: pooling or cropping")] = "pooling"
    spatial_tokens: Annotated[int, typer.Option(help="LLaVA-SP: spatial tokens added per image")] = 6
    plan: Annotated[
        Path | None, typer.Option(help="Apply a plan file from `vca-patch plan` (token merging + VCA) instead of --to")
    ] = None
    packed: Annotated[
        bool, typer.Option("--packed", help="DIDB: save the binarised Linears as packed sign bits + scales (~1/32)")
    ] = False
    budget: Annotated[
        float | None,
        typer.Option(
            help="Plan per block (softmax, VCA, MANO, token merging) to run within this ratio of the original's "
            "batch-1 CPU latency at --resolution, convert, calibrate, measure on held-out images and save "
            "(needs --calibration-data; e.g. 0.6). --contrast-tokens N: try VCA(N) only (0: no VCA blocks); "
            "--to vca: VCA blocks only"
        ),
    ] = None
    resolution: Annotated[
        int | None,
        typer.Option(help="--budget: input size in pixels to plan for (default: --img-size, else the model's own)"),
    ] = None
    eval_data: Annotated[
        Path | None,
        typer.Option(help="--budget: images kept apart to measure on (default: every 5th of --calibration-data)"),
    ] = None
    recipe: Annotated[
        Path | None,
        typer.Option(
            help="--budget: a recovery recipe run on the chosen plan after calibration, kept only if it brings the "
            "plan closer on the calibration images (its data: unlabelled images other than --eval-data; merge "
            "plans: recipes/dinov2_small_merge.yaml)"
        ),
    ] = None
    merge_fractions: Annotated[
        str | None, typer.Option(help="--budget: fractions of the patch tokens merging may remove (default 0.3-1.4)")
    ] = None
    merge_leads: Annotated[
        str | None,
        typer.Option(
            help="--budget: shares of the patch tokens merged in the first merging block, front-loaded merging "
            "(default 0.25,0.33; 'none': constant r only)"
        ),
    ] = None
    mano_windows: Annotated[
        str | None, typer.Option(help="--budget: MANO window sides k to try, e.g. '7' ('none': no MANO blocks)")
    ] = None
    repeats: Annotated[int, typer.Option(help="--budget: timing rounds per measurement")] = 3
    min_time: Annotated[float, typer.Option(help="--budget: seconds each timing runs at least")] = 0.5
