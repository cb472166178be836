"""`vca-patch convert`: build a model, patch it with VCA or MANO, measure it, save it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from vca_patch.checkpoint import save_pretrained
from vca_patch.checkpoint.folder import CARD_NAME, CONFIG_NAME, FORMS
from vca_patch.cli import convert_budget as budget
from vca_patch.cli.common import (
    check_model_sizes,
    console,
    err_console,
    fail,
    load_base,
    parse_layers,
    prepare_cpu_kernel,
    refuse_checkpoint_input,
    resolve_device,
    resolve_dtype,
)
from vca_patch.cli.convert_args import LLAVA_SP, ConvertArgs
from vca_patch.cli.errors import hold
from vca_patch.cli.fidelity import (
    calibrate_for_convert,
    calibrated_targets,
    check_calibration_splits,
    summary_table,
)
from vca_patch.cli.report_view import sites_table, totals_table
from vca_patch.cli.target_options import (
    refuse_other_targets,
    split_options,
    target_config,
    target_options,
    typer_command,
)
from vca_patch.core.atomic import check_output_dir, foreign_entries
from vca_patch.core.errors import ConfigError
from vca_patch.core.lock import output_lock
from vca_patch.core.model_io import compare_outputs, model_input_size
from vca_patch.core.paths import check_output
from vca_patch.families import hooks_for, libraries
from vca_patch.surgery import get_patch_state, patch_model
from vca_patch.targets.base import CONFIG_TYPES, TargetConfig
from vca_patch.targets.handler import handler_for
from vca_patch.targets.protocols import PackedForm

DEFAULT_TARGET = "vca"
CALIBRATION_IMAGES = 256  # without --budget (with it: convert_budget.PLAN_IMAGES)
CHECKPOINT_FILES = (CONFIG_NAME, CARD_NAME, *FORMS.values())  # what a checkpoint folder holds


def _local(path: Path | None) -> bool:
    """A local file or folder (a Hugging Face dataset name is not one)."""
    return path is not None and path.exists()


@typer_command(ConvertArgs)
def convert(**options: Any) -> None:
    """Convert MODEL's softmax attention to VCA (or another target with --to) and save it to --output.

    With --budget B, plan per block (softmax, VCA, MANO, token merging) to run within B x the original's latency at
    --resolution, convert, calibrate on --calibration-data, and measure on images kept apart (--eval-data).
    With --to llava-sp, MODEL is a transformers LLaVA (folder or Hub id) and gets LLaVA-SP's spatial tokens.
    """
    args, target_values = split_options(ConvertArgs, options)
    if args.budget is not None:
        _convert_with_budget(args, target_values)
        return
    budget.refuse_without_budget(args, _defaults())
    _refuse_plan_conflicts(args, target_values)
    args.to = args.to or DEFAULT_TARGET
    args.calibration_images = CALIBRATION_IMAGES if args.calibration_images is None else args.calibration_images
    if args.to == LLAVA_SP:
        _convert_llava_sp(args, target_values)
        return
    config = _checked_config(args, target_values)
    _check_inputs(args)
    net, base_weights = _build_base(args)
    config = _check_sizes(args, net, config)
    if args.plan is None:
        _note_if_vca_cannot_pay(args, net)
    _patch_measure_save(args, net, config, base_weights)


def _refuse_plan_conflicts(args: ConvertArgs, target_values: dict[str, Any]) -> None:
    """--plan says what each block becomes: --to, --layers, --include, --exclude or a target's option given with it
    would be ignored, so they are refused (one line naming them) before any work."""
    if args.plan is None:
        return
    given = [f"--to {args.to}"] if args.to is not None else []
    given += [f"--{name}" for name in ("layers", "include", "exclude") if getattr(args, name) is not None]
    options = {option.param: option for option in target_options()}
    given += [options[k].flag for k, v in target_values.items() if k in options and v != options[k].default]
    if given:
        fail(f"--plan {args.plan} already says what each block becomes, so {', '.join(given)} would be ignored; "
             "drop them, or drop --plan", 2)  # fmt: skip


def _defaults() -> dict[str, Any]:
    """Every option's default by parameter name: convert's own and the targets'."""
    own = {f.name: f.default for f in dataclasses.fields(ConvertArgs)}
    return own | {option.param: option.default for option in target_options()}


def _convert_with_budget(args: ConvertArgs, target_values: dict[str, Any]) -> None:
    """`convert --budget`: the planner chooses per block within the budget (`make_faster`), then the model is
    saved with its plan and measured latency and fidelity; every refusal comes before any work."""
    defaults = _defaults()
    search = budget.search_options(args, target_values, defaults)
    if args.resolution is not None and args.img_size is not None and args.resolution != args.img_size:
        raise ConfigError(f"--resolution {args.resolution} and --img-size {args.img_size} differ; pass one")
    args.img_size, args.device = args.img_size or args.resolution, "cpu"
    if args.recipe is not None:
        from vca_patch.train import load_recipe

        load_recipe(args.recipe)  # a bad recipe is refused now, not after the planning
    _check_output(args)
    _check_inputs(args)
    split = budget.image_split(args)
    net, base_weights = _build_base(args)
    resolution = args.img_size or model_input_size(net)[-1]
    budget.check_vca_pays(args, net, resolution, search)
    recover = budget.recovery_hook(args, net, resolution)  # its data and image size checked before the planning
    report = budget.run(args, net, split, resolution, search, recover)
    metadata = {"base_weights": base_weights, "model_name": args.model, "dtype": args.dtype,
                "speedup": report.metrics()}  # fmt: skip
    with console.status(f"Saving to {args.output}..."):
        save_pretrained(net, args.output, overwrite=args.force, metadata=metadata)
    budget.show(args, report)


def _note_if_vca_cannot_pay(args: ConvertArgs, net: torch.nn.Module) -> None:
    """One line when VCA converts a single-grid model at a size where it is slower than softmax attention (the
    conversion goes on: it is what was asked), naming what pays there."""
    if args.to != "vca":
        return
    from vca_patch.planner.speedup import VCA_PAYS_FROM_TOKENS, vca_pays
    from vca_patch.surgery import inspect_model

    try:
        layout = inspect_model(net).layout
    except ValueError:  # not a model these checks can read: the conversion's own checks say why
        return
    if layout is None:  # hierarchical: one grid per stage
        return
    tokens = layout.num_prefix_tokens + layout.grid[0] * layout.grid[1]
    if not vca_pays(tokens):
        err_console.print(
            f"[bold yellow]note:[/] {tokens} tokens: VCA is slower than softmax attention here (it pays from "
            f"~{VCA_PAYS_FROM_TOKENS}); token merging pays (--budget B --calibration-data DIR plans it), or convert at "
            "a larger --img-size", highlight=False, soft_wrap=True,
        )  # fmt: skip


def _check_sizes(args: ConvertArgs, net: torch.nn.Module, config: TargetConfig) -> TargetConfig:
    """From the built model's shapes, before any forward pass: a plan made for this resolution and grid (its own
    check first: it says more than the grid rule), an input of whole patches, settings that fit the grid, and
    activations that fit this machine's memory. Returns the config fitted to the grid (`check_model_sizes`)."""
    if args.plan is not None:  # `load_plan` gave the plan space's config: check it fits this model's grid
        from vca_patch.core.model_io import model_input_size
        from vca_patch.planner import check_plan_fits
        from vca_patch.surgery import inspect_model

        layout = inspect_model(net).layout
        if layout is not None:
            warning = check_plan_fits(args.plan, config, model_input_size(net)[1:], layout.grid)
            if warning:
                err_console.print(f"[bold yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    device = str(next(net.parameters()).device)
    return check_model_sizes(net, config, batch=args.probe_size, device=device, what=args.model)


def _checked_config(args: ConvertArgs, target_values: dict[str, Any]) -> TargetConfig:
    """The target config the options (or --plan) ask for, after the checks that need no model; exits on an error."""
    if args.calibration_data is not None and _takes_no_images(args.model):  # checked again once loaded
        fail("--calibration-data takes images for vision encoders; a diffusion transformer is measured on random "
             "latents, timesteps and conditions (distil it to recover quality)", 2)  # fmt: skip
    _check_output(args)
    refuse_other_targets(args.to, target_values, _convert_only_options(args))
    _check_calibration_options(args)
    if args.plan is not None:
        from vca_patch.planner import load_plan

        return load_plan(args.plan)
    common = {"layers": parse_layers(args.layers), "seed": args.seed, "include": args.include}
    return target_config(args.to, target_values, exclude=args.exclude, **common)


def _takes_no_images(name: str) -> bool:
    """Whether a library knows `name`, from local files, as a model that takes no images
    (`ModelLibrary.takes_no_images`: a diffusers pipeline folder)."""
    return any(library.takes_no_images(name) for library in libraries().values())


def _check_output(args: ConvertArgs) -> None:
    """The output rule (see `check_output`), before any work: -o is replaced as a whole, so it is none of the
    inputs (a local MODEL folder, --weights, --calibration-data, --plan), is inside none and holds none."""
    inputs = {"MODEL folder": Path(args.model), "--weights file": args.weights,
              "--calibration-data": args.calibration_data, "--plan file": args.plan, "--eval-data": args.eval_data,
              "--recipe file": args.recipe}  # fmt: skip
    check_output(args.output, inputs, kind="folder", replaces=True, option="-o")
    check_output_dir(args.output, overwrite=args.force)
    hold(output_lock(args.output, "vca-patch convert"))  # a second run into -o fails at once, naming this one


def _convert_only_options(args: ConvertArgs) -> dict[str, tuple[bool, tuple[str, ...]]]:
    """Options of `convert` that are not config fields, {flag: (given, the targets they apply to)}."""
    packers = tuple(name for name, cls in sorted(CONFIG_TYPES.items()) if isinstance(handler_for(cls), PackedForm))
    calibration = {
        "--calibration-data": args.calibration_data is not None,
        "--split": args.split != "train",
        "--eval-split": args.eval_split != "test",
        "--grow-tokens": args.grow_tokens is not None,
    }
    calibrated = calibrated_targets()
    return {"--packed": (args.packed, packers)} | {k: (v, calibrated) for k, v in calibration.items()}


def _check_calibration_options(args: ConvertArgs) -> None:
    unused = [name for name, given in (("--split", args.split != "train"), ("--eval-split", args.eval_split != "test"))
              if given and args.calibration_data is None]  # fmt: skip
    if unused:
        raise ConfigError(f"{' and '.join(unused)} choose splits of --calibration-data; pass it too, or drop them")
    grow = args.grow_tokens
    if grow is not None and (args.calibration_data is None or not grow > 0):
        raise ConfigError(f"--grow-tokens takes a positive error threshold and --calibration-data; got {grow}")
    for name, value in (("--probe-size", args.probe_size), ("--calibration-images", args.calibration_images)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1 image, got {value}")


def _check_inputs(args: ConvertArgs) -> None:
    """Checks of the input files, and the warning of what --force removes, before any work."""
    refuse_checkpoint_input(args.model)
    if args.weights is not None and not args.weights.is_file():
        fail(f"weights file {args.weights} does not exist", 2)
    if _local(args.calibration_data) and args.budget is None:  # --budget reads every image file (any layout)
        check_calibration_splits(args.calibration_data, args.calibration_kind, args.split, args.eval_split)
    removed = foreign_entries(args.output, CHECKPOINT_FILES)
    if removed:  # --force replaces the folder as a whole: say so before anything is done
        shown = ", ".join(removed[:6]) + (f" and {len(removed) - 6} more" if len(removed) > 6 else "")
        err_console.print(
            f"[bold yellow]warning:[/] --force replaces {args.output}/ as a whole; these entries in it will be "
            f"removed: {shown}",
            highlight=False,
            soft_wrap=True,
        )


def _build_base(args: ConvertArgs) -> tuple[torch.nn.Module, str]:
    """MODEL with its base weights, on --device in --dtype, and which weights those are."""
    torch_device, torch_dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    base_weights = "local file" if args.weights else ("pretrained" if args.pretrained else "random")
    with console.status(f"Building {args.model} ({base_weights} weights)..."):
        with torch.random.fork_rng(devices=[]):  # random weights follow --seed: a reproducible offline demo
            torch.manual_seed(args.seed)
            net = load_base(args.model, pretrained=args.pretrained, weights=args.weights, img_size=args.img_size)
        net.eval().to(device=torch_device, dtype=torch_dtype)
    return net, base_weights


def _patch_measure_save(args: ConvertArgs, net: torch.nn.Module, config: TargetConfig, base_weights: str) -> None:
    family = hooks_for(net)  # its probe (a diffusion transformer's: a random denoising step) and how to call it
    if not family.takes_images and args.calibration_data is not None:
        fail(f"--calibration-data takes images for vision encoders, not {type(net).__name__}", 2)
    probe = family.probe_inputs(net, args.probe_size, args.seed)
    if handler_for(config).cpu_kernel(type(config)) is not None and next(net.parameters()).device.type == "cpu":
        prepare_cpu_kernel()  # a target's fused CPU kernel: compiled on the first run, under its own spinner
    with console.status("Patching and probing..."), torch.no_grad():
        reference = family.predict(net, probe)
        report = patch_model(net, config, strict=args.strict)
        metrics = compare_outputs(reference, family.predict(net, probe))
    measured = family.probe_fidelity(net, probe, metrics, args.probe_size)  # None: measured on images
    if measured is not None:
        fidelity_summary, measured_on = measured
    else:
        fidelity_summary, measured_on = calibrate_for_convert(  # progress bars with totals and ETA
            net, args.calibration_data, args.calibration_kind, args.calibration_images, probe,
            split=args.split, eval_split=args.eval_split, grow_tokens=args.grow_tokens,
            skip_bad_images=args.skip_bad_images,
        )  # fmt: skip
        report = get_patch_state(net).report  # --grow-tokens re-patched the grown blocks: their n and +params
    metadata = {"base_weights": base_weights, "model_name": args.model, "probe": metrics, "dtype": args.dtype}
    with console.status(f"Saving to {args.output}..."):
        save_pretrained(net, args.output, overwrite=args.force, metadata=metadata, packed=args.packed)
    console.print(sites_table(report))
    console.print(totals_table(report, probe=metrics))
    console.print(summary_table(fidelity_summary, f"Fidelity to the original ({measured_on})"))
    console.print(f"[bold green]Saved[/] {args.output}/ (model.safetensors, config.json, README.md)")


def _convert_llava_sp(args: ConvertArgs, target_values: dict[str, Any]) -> None:
    """`convert --to llava-sp`: add spatial tokens to a LLaVA's projector and save model, tokens and processor."""
    from vca_patch.formats.llava_sp import convert_to_llava_sp
    from vca_patch.targets.llava_sp import SpatialTokensConfig

    _check_output(args)
    refuse_other_targets(LLAVA_SP, target_values, _convert_only_options(args))
    try:
        config = SpatialTokensConfig(variant=args.spatial_variant, num_tokens=args.spatial_tokens, seed=args.seed)
    except ValueError as exc:  # an option's value: the user's to fix
        raise ConfigError(str(exc)) from exc
    with console.status(f"Adding {config.num_tokens} {config.variant} spatial tokens to {args.model}..."):
        report = convert_to_llava_sp(args.model, args.output, config, pretrained=args.pretrained, overwrite=args.force)
    console.print(str(report), highlight=False, soft_wrap=True)
    console.print(f"Saved {args.output}/ (load with vca_patch.load_spatial_tokens)")
