"""`vca-patch convert`: build a model, patch it with VCA or MANO, measure it, save it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import torch
import typer

from vca_patch.checkpoint import OutputExistsError, save_pretrained
from vca_patch.checkpoint.folder import CARD_NAME, CONFIG_NAME, FORMS
from vca_patch.cli.common import (
    DEVICE_HELP,
    DTYPE_HELP,
    PVT_MODE_HELP,
    STAGE_TOKENS_HELP,
    SWIN_MODE_HELP,
    console,
    err_console,
    fail,
    load_base,
    parse_layers,
    parse_stage_tokens,
    prepare_cpu_kernel,
    resolve_device,
    resolve_dtype,
    warn_contrast_grid,
)
from vca_patch.cli.fidelity import calibrate_for_convert, check_calibration_splits, summary_table
from vca_patch.cli.report_view import sites_table, totals_table
from vca_patch.core.atomic import UnsafeOutputError, check_output_dir, check_output_outside_inputs, foreign_entries
from vca_patch.core.errors import ConfigError
from vca_patch.core.model_io import compare_outputs, probe_batch
from vca_patch.families.diffusers import probe as dfp
from vca_patch.families.diffusers import source as dfs
from vca_patch.surgery import PatchError, get_patch_state, patch_model
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.didb import DIDBConfig
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.vca.config import VCAConfig

CHECKPOINT_FILES = (CONFIG_NAME, CARD_NAME, *FORMS.values())  # what a checkpoint folder holds


def _local(path: Path | None) -> bool:
    """A local file or folder (a Hugging Face dataset name is not one)."""
    return path is not None and path.exists()


def convert(
    model: Annotated[
        str,
        typer.Argument(
            help="timm model name (e.g. deit_tiny_patch16_224), hf-hub:ORG/NAME, or a transformers or diffusers model "
            "(a local folder, e.g. a diffusers pipeline with model_index.json + transformer/, or ORG/NAME)"
        ),
    ],
    output: Annotated[Path, typer.Option("--output", "-o", help="Folder to write the converted checkpoint to")],
    pretrained: Annotated[
        bool, typer.Option(help="Start from pretrained Hub weights (--no-pretrained: random)")
    ] = True,
    weights: Annotated[
        Path | None, typer.Option(help="Local weights (.safetensors/.pth) for MODEL instead of the Hub's")
    ] = None,
    layers: Annotated[str | None, typer.Option(help="Blocks to convert, e.g. '0-5,8' (default: all)")] = None,
    include: Annotated[str | None, typer.Option(help="Regex: convert only matching module paths")] = None,
    exclude: Annotated[str | None, typer.Option(help="Regex: never convert matching module paths")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Refuse approximate or unverified conversions")] = False,
    to: Annotated[
        str, typer.Option("--to", help="Target: vca, mano, didb (binarised); llava-sp (spatial tokens on a LLaVA)")
    ] = "vca",
    contrast_tokens: Annotated[int, typer.Option(help="Pooled contrast tokens n (a perfect square)")] = 49,
    softmax: Annotated[str, typer.Option(help="Stage-II softmax: joint or separate")] = "joint",
    init: Annotated[
        str, typer.Option(help="preserve (function-preserving); VCA: paper (from scratch); MANO: multipole or random")
    ] = "preserve",
    window: Annotated[int, typer.Option(help="MANO: window side k")] = 7,
    rate: Annotated[int, typer.Option(help="MANO: coarsening rate r between levels")] = 2,
    levels: Annotated[int | None, typer.Option(help="MANO: number of levels (default: auto per grid)")] = None,
    down: Annotated[str, typer.Option(help="MANO: conv or avg")] = "conv",
    up: Annotated[str, typer.Option(help="MANO: conv or nearest")] = "conv",
    prefix: Annotated[str, typer.Option(help="MANO: prefix tokens global or separate")] = "global",
    probe_size: Annotated[int, typer.Option(help="Images in the probe batch that measures the change")] = 4,
    seed: Annotated[
        int, typer.Option(help="Seed of random base weights, of the init's random parts and of the probe batch")
    ] = 0,
    prefix_readout: Annotated[
        str, typer.Option(help="VCA: prefix tokens read all keys (exact) or only the contrast tokens (contrast, paper)")
    ] = "exact",
    stage2_temperature: Annotated[bool, typer.Option(help="VCA: per-head Stage-II temperature (init 1)")] = True,
    token_magnitude: Annotated[
        bool | None,
        typer.Option(
            "--token-magnitude/--no-token-magnitude",
            help="VCA: per-token output gain that calibration fits (default: on for single-grid ViTs)",
        ),
    ] = None,
    local_window: Annotated[
        int,
        typer.Option(
            help="VCA: each patch also attends to its K x K neighbours (odd K, e.g. 7; calibration fits it; 0: off)"
        ),
    ] = 0,
    grow_tokens: Annotated[
        float | None,
        typer.Option(help="VCA calibration: layers whose error stays above this get 4x the contrast tokens (e.g. 0.4)"),
    ] = None,
    calibration_data: Annotated[
        Path | None, typer.Option(help="VCA: calibrate on real images (idx folder, ImageFolder root, HF name)")
    ] = None,
    calibration_kind: Annotated[
        str | None, typer.Option(help="fashion_mnist, imagefolder or hf (default: from --calibration-data)")
    ] = None,
    calibration_images: Annotated[int, typer.Option(help="Images used to calibrate, and to measure")] = 256,
    split: Annotated[
        str, typer.Option(help="--calibration-data split to calibrate on (ImageFolder: its sub-folder; flat: 4 in 5)")
    ] = "train",
    eval_split: Annotated[
        str, typer.Option(help="--calibration-data split to measure on (val/validation/test aliases; flat: 1 in 5)")
    ] = "test",
    force: Annotated[
        bool, typer.Option("--force", help="Replace a non-empty output folder as a whole (its other files are listed)")
    ] = False,
    img_size: Annotated[
        int | None, typer.Option(help="Input size in pixels (timm's img_size; transformers: the config's; DINOv2: any)")
    ] = None,
    device: Annotated[str, typer.Option(help=f"Where to convert and measure: {DEVICE_HELP}")] = "auto",
    dtype: Annotated[str, typer.Option(help=f"{DTYPE_HELP} (the model is cast, then patched)")] = "float32",
    spatial_variant: Annotated[str, typer.Option(help="LLaVA-SP: pooling or cropping")] = "pooling",
    spatial_tokens: Annotated[int, typer.Option(help="LLaVA-SP: spatial tokens added per image")] = 6,
    plan: Annotated[
        Path | None, typer.Option(help="Apply a plan file from `vca-patch plan` (token merging + VCA) instead of --to")
    ] = None,
    packed: Annotated[
        bool, typer.Option("--packed", help="DIDB: save the binarised Linears as packed sign bits + scales (~1/32)")
    ] = False,
    swin_mode: Annotated[str, typer.Option(help=SWIN_MODE_HELP)] = "residual",
    pvt_mode: Annotated[str, typer.Option(help=PVT_MODE_HELP)] = "carry",
    stage_contrast_tokens: Annotated[str | None, typer.Option(help=STAGE_TOKENS_HELP)] = None,
) -> None:
    """Convert MODEL's softmax attention to VCA (or MANO with --to mano) and save it to --output.

    With --to llava-sp, MODEL is a transformers LLaVA (folder or Hub id) and gets LLaVA-SP's spatial tokens.
    """
    if to == "llava-sp":
        _convert_llava_sp(model, output, pretrained, spatial_variant, spatial_tokens, seed, force)
        return
    torch_device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    if calibration_data is not None and dfs.is_local_diffusers(model):  # checked again once a Hub model is loaded
        fail("--calibration-data takes images for vision encoders; a diffusion transformer is measured on random "
             "latents, timesteps and conditions (distil it to recover quality)", 2)  # fmt: skip
    try:
        check_output_dir(output, overwrite=force)
        data = calibration_data if _local(calibration_data) else None
        check_output_outside_inputs(output, {"--weights file": weights, "--calibration-data": data}, replaces=True)
        options = {
            "vca": {"--contrast-tokens": (contrast_tokens, 49), "--softmax": (softmax, "joint"),
                    "--prefix-readout": (prefix_readout, "exact"), "--stage2-temperature": (stage2_temperature, True),
                    "--calibration-data": (calibration_data, None), "--split": (split, "train"),
                    "--eval-split": (eval_split, "test"), "--swin-mode": (swin_mode, "residual"),
                    "--pvt-mode": (pvt_mode, "carry"), "--stage-contrast-tokens": (stage_contrast_tokens, None),
                    "--token-magnitude": (token_magnitude, None), "--grow-tokens": (grow_tokens, None),
                    "--local-window": (local_window, 0)},
            "mano": {"--window": (window, 7), "--rate": (rate, 2), "--levels": (levels, None), "--down": (down, "conv"),
                     "--up": (up, "conv"), "--prefix": (prefix, "global")},
            "didb": {"--packed": (packed, False)},
        }  # fmt: skip
        for target, given in options.items():
            other = [name for name, (value, default) in given.items() if value != default]
            if to != target and to in options and other:
                raise ConfigError(f"{', '.join(other)} {'is' if len(other) == 1 else 'are'} for --to {target}, "
                                  f"not --to {to}; drop {'it' if len(other) == 1 else 'them'}")  # fmt: skip
        unused = [name for name, given in (("--split", split != "train"), ("--eval-split", eval_split != "test"))
                  if given and calibration_data is None]  # fmt: skip
        if unused:
            raise ConfigError(f"{' and '.join(unused)} choose splits of --calibration-data; pass it too, or drop them")
        if grow_tokens is not None and (calibration_data is None or not grow_tokens > 0):
            raise ConfigError(
                f"--grow-tokens takes a positive error threshold and --calibration-data; got {grow_tokens}"
            )
        for name, value in (("--probe-size", probe_size), ("--calibration-images", calibration_images)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1 image, got {value}")
        config: TargetConfig
        if plan is not None:
            from vca_patch.planner import load_plan

            config = load_plan(plan)
        elif to == "vca":
            config = VCAConfig(
                contrast_tokens=contrast_tokens, softmax=softmax, init=init, layers=parse_layers(layers), seed=seed,
                prefix_readout=prefix_readout, stage2_temperature=stage2_temperature, token_magnitude=token_magnitude,
                local_window=local_window, include=include, exclude=exclude,
                swin_mode=swin_mode, pvt_mode=pvt_mode, stage_contrast_tokens=parse_stage_tokens(stage_contrast_tokens),
            )  # fmt: skip
        elif to == "mano":
            config = MANOConfig(
                window=window, rate=rate, levels=levels, down=down, up=up, init=init, prefix=prefix,
                layers=parse_layers(layers), seed=seed, include=include, exclude=exclude,
            )  # fmt: skip
        elif to == "didb":
            config = DIDBConfig(layers=parse_layers(layers), seed=seed, include=include, exclude=exclude)
        else:
            raise ConfigError(f"--to must be 'vca', 'mano', 'didb' or 'llava-sp', got {to!r}")
    except (OutputExistsError, UnsafeOutputError, ConfigError) as exc:  # a bad --plan file: PlanError, a ConfigError
        fail(str(exc), 2)
    if weights is not None and not weights.is_file():
        fail(f"weights file {weights} does not exist", 2)
    if _local(calibration_data):
        check_calibration_splits(calibration_data, calibration_kind, split, eval_split)  # before any work
    removed = foreign_entries(output, CHECKPOINT_FILES)
    if removed:  # --force replaces the folder as a whole: say so before anything is done
        shown = ", ".join(removed[:6]) + (f" and {len(removed) - 6} more" if len(removed) > 6 else "")
        err_console.print(
            f"[bold yellow]warning:[/] --force replaces {output}/ as a whole; these entries in it will be removed: "
            f"{shown}",
            highlight=False,
            soft_wrap=True,
        )

    base_weights = "local file" if weights else ("pretrained" if pretrained else "random")
    with console.status(f"Building {model} ({base_weights} weights)..."):
        with torch.random.fork_rng(devices=[]):  # random weights follow --seed: a reproducible offline demo
            torch.manual_seed(seed)
            net = load_base(model, pretrained=pretrained, weights=weights, img_size=img_size).eval()
        net.to(device=torch_device, dtype=torch_dtype)
    diffusion = dfp.is_diffusers_model(net)  # a diffusion transformer: a random denoising step is the probe
    if diffusion and calibration_data is not None:
        fail(f"--calibration-data takes images for vision encoders, not {type(net).__name__}", 2)
    probe = dfp.probe_inputs(net, probe_size, seed) if diffusion else probe_batch(net, probe_size, seed)
    run = dfp.predict if diffusion else (lambda module, x: module(x))
    if config.target == "vca" and torch_device.type == "cpu":
        prepare_cpu_kernel()
    with console.status("Patching and probing..."), torch.no_grad():
        reference = run(net, probe)
        try:
            report = patch_model(net, config, strict=strict)
        except (PatchError, ConfigError) as exc:  # ConfigError: e.g. a --plan made for another model
            fail(str(exc))
        metrics = compare_outputs(reference, run(net, probe))
    warn_contrast_grid(report, model)
    if diffusion:
        fidelity_summary = dfp.fidelity_summary(dfp.attention_errors(net, probe), metrics)
        measured_on = f"{probe_size} random denoising inputs"
    else:
        with console.status("Calibrating and measuring fidelity..."):
            fidelity_summary, measured_on = calibrate_for_convert(
                net,
                calibration_data,
                calibration_kind,
                calibration_images,
                probe,
                split=split,
                eval_split=eval_split,
                grow_tokens=grow_tokens,
            )
        report = get_patch_state(net).report  # --grow-tokens re-patched the grown blocks: their n and +params
    with console.status(f"Saving to {output}..."):
        save_pretrained(
            net,
            output,
            overwrite=force,
            metadata={"base_weights": base_weights, "model_name": model, "probe": metrics, "dtype": dtype},
            packed=packed,
        )
    console.print(sites_table(report))
    console.print(totals_table(report, probe=metrics))
    console.print(summary_table(fidelity_summary, f"Fidelity to the original ({measured_on})"))
    console.print(f"[bold green]Saved[/] {output}/ (model.safetensors, config.json, README.md)")


def _convert_llava_sp(
    model: str, output: Path, pretrained: bool, variant: str, num_tokens: int, seed: int, force: bool
) -> None:
    """`convert --to llava-sp`: add spatial tokens to a LLaVA's projector and save model, tokens and processor."""
    from vca_patch.checkpoint.base_model import HubUnavailableError, UnknownModelError
    from vca_patch.targets.llava_sp import SpatialTokensConfig
    from vca_patch.targets.llava_sp.convert import convert_to_llava_sp
    from vca_patch.targets.llava_sp.model import SpatialTokensError

    try:
        config = SpatialTokensConfig(variant=variant, num_tokens=num_tokens, seed=seed)
    except ValueError as exc:
        fail(str(exc), 2)
    try:
        with console.status(f"Adding {num_tokens} {variant} spatial tokens to {model}..."):
            report = convert_to_llava_sp(model, output, config, pretrained=pretrained, overwrite=force)
    except (OutputExistsError, UnsafeOutputError) as exc:
        fail(str(exc), 2)
    except (SpatialTokensError, UnknownModelError, HubUnavailableError) as exc:
        fail(str(exc), 1)
    console.print(str(report), highlight=False, soft_wrap=True)
    console.print(f"Saved {output}/ (load with vca_patch.load_spatial_tokens)")
