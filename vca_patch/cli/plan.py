"""`vca-patch plan`: choose per block between softmax, VCA(n), MANO(k) and token merging to meet a latency budget."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import torch
import typer
from rich.table import Table

from vca_patch.cli.common import check_model_sizes, console, fail, load_base
from vca_patch.cli.target_options import split_options, typer_command
from vca_patch.core.atomic import atomic_file
from vca_patch.core.paths import check_output
from vca_patch.core.sizes import MAX_IMG_SIZE, check_bound
from vca_patch.planner import PLAN_UNMERGE_MODES, PlanError, PlanResult, draw_front, plan_model, save_plan
from vca_patch.planner.costs import token_counts
from vca_patch.planner.images import image_files, load_images
from vca_patch.planner.planner import DEFAULT_MERGE_FRACTIONS, DEFAULT_MERGE_LEADS


def _numbers(text: str, kind: type, name: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{name} must be a comma-separated list of numbers, got {text!r}", 2)


def _numbers_or_none(text: str, kind: type, name: str) -> list:
    """`_numbers`, with 'none' (any case) for no candidates of that kind."""
    return [] if text.strip().lower() == "none" else _numbers(text, kind, name)


def plan_table(result: PlanResult) -> Table:
    """One row per block: attention, tokens merged after it, tokens entering it."""
    chosen = result.chosen
    counts = token_counts(result.info, result.resolution, chosen.schedule)
    table = Table(title=f"Plan: {chosen.describe()}")
    for column in ("block", "attention", "tokens in", "merged after"):
        table.add_column(column, justify="right" if column != "attention" else "left")
    for i, tokens in enumerate(counts):
        attention = "softmax"
        if i in chosen.vca_layers:
            attention = f"VCA n={chosen.vca_layers[i]}"
        elif i in chosen.mano_layers:
            attention = f"MANO k={chosen.mano_layers[i]}"
        if chosen.schedule[i] or any(chosen.schedule[:i]):
            attention += " (proportional)"
        table.add_row(str(i), attention, str(tokens), str(chosen.schedule[i]))
    if any(chosen.schedule):
        how = "plus what merging took from each" if result.config.unmerge == "residual" else "copied back"
        table.caption = f"merged tokens return to their patches at the end ({result.config.unmerge}: {how})"
    return table


def summary_table(result: PlanResult) -> Table:
    chosen, measured = result.chosen, result.measured
    table = Table(title=f"Predicted and measured at {result.resolution} px (budget {result.budget:g}x)")
    for column in ("", "latency ratio", "CLS cosine", "patch-token cosine", "mean-patch cosine"):
        table.add_column(column, justify="right")
    table.add_row("predicted", f"{chosen.latency:.3f}", f"{chosen.cls:.4f}", f"{chosen.patch:.4f}", "")
    table.add_row("FLOP model", f"{chosen.macs_ratio:.3f}", "", "", "")
    finalist = result.finalist
    timed = result.latency.describe() if result.latency is not None else None
    if finalist:  # what chose it: timed against the original, scored on the calibration crops kept for scoring
        table.add_row(
            "as a finalist", timed or f"{finalist['latency_ratio']:.3f}", f"{finalist['cls_cosine']:.4f}",
            f"{finalist['patch_token_cosine']:.4f}", f"{finalist['mean_patch_cosine']:.4f}",
        )  # fmt: skip
    if measured:
        table.add_row(
            "measured", f"{measured['latency_ratio']:.3f}", f"{measured['cls_cosine']:.4f}",
            f"{measured['patch_token_cosine']:.4f}", f"{measured['mean_patch_cosine']:.4f}",
        )  # fmt: skip
    return table


def over_budget_line(result: PlanResult) -> str | None:
    """A warning when the chosen plan measured slower than the budget, or its measured interval holds the budget;
    else None."""
    if not result.over_budget:
        if result.straddles_budget:
            return (
                f"Measured {result.latency.describe()}: the budget {result.budget:g}x lies inside this interval, so "
                "on this machine the plan may run either side of it."
            )
        return None
    return (
        f"Measured {result.measured['latency_ratio']:.3f}x is over the {result.budget:g}x budget (predicted "
        f"{result.chosen.latency:.3f}x). Batch-1 latency varies between runs: time the plan again with a longer "
        "--min-time on an idle machine, or plan for a lower --budget."
    )


@dataclass
class PlanArgs:
    """`plan`'s options."""

    model: Annotated[str, typer.Argument(help="timm model name (e.g. vit_small_patch14_dinov2) or hf-hub:ORG/NAME")]
    calibration_data: Annotated[
        Path, typer.Option(help="Folder of calibration images (any layout; every image file under it)")
    ]
    budget: Annotated[float, typer.Option(help="Latency budget: ratio to the original's batch-1 latency")] = 0.5
    resolution: Annotated[int, typer.Option(help="Input size in pixels to plan for")] = 224
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan file to write (JSON)")] = Path("plan.json")
    png: Annotated[Path | None, typer.Option(help="Pareto-front PNG (default: the plan file with .png)")] = None
    images: Annotated[int, typer.Option(help="Calibration images to use (the first, sorted by path)")] = 8
    eval_images: Annotated[
        int, typer.Option(help="Further images, after the calibration ones, kept apart to measure the plan on")
    ] = 0
    contrast_tokens: Annotated[
        str, typer.Option(help="VCA contrast-token counts n to try, e.g. '16,49' ('none': merging only)")
    ] = "16,49"
    mano_windows: Annotated[
        str, typer.Option(help="MANO window sides k to try, e.g. '7' ('' or 'none': no MANO blocks)")
    ] = "7"
    local_window: Annotated[
        int,
        typer.Option(
            help="Give the VCA candidates a local term: each patch also attends exactly to its k×k neighbours "
            "(odd k, e.g. 7; 0: none). Costs latency, buys fidelity; the plan weighs both"
        ),
    ] = 0
    merge_fractions: Annotated[
        str,
        typer.Option(
            help="Fractions of the patch tokens merging may remove, in (0, 2]: r = fraction × patches / blocks "
            "merged; above 1 merging is front-loaded (a merge takes at most half the tokens left)"
        ),
    ] = ",".join(f"{f:g}" for f in DEFAULT_MERGE_FRACTIONS)
    merge_leads: Annotated[
        str,
        typer.Option(
            help="Front-loaded merging: shares of the patch tokens merged in the first merging block, in (0, 0.5], "
            "each tried with every r of --merge-fractions after it ('none': constant r only)"
        ),
    ] = ",".join(f"{f:g}" for f in DEFAULT_MERGE_LEADS)
    objective: Annotated[str, typer.Option(help="What to keep: cls, patch (dense) or both")] = "both"
    unmerge: Annotated[
        str,
        typer.Option(
            help="How merged tokens return to their patches: copy (ToMe's), residual (plus what merging took "
            "from each patch: better patch tokens, a little slower) or auto (residual unless --objective cls)"
        ),
    ] = "auto"
    calibrate: Annotated[bool, typer.Option(help="Calibrate the VCA candidates (training-free)")] = True
    pretrained: Annotated[bool, typer.Option(help="Start from pretrained Hub weights (--no-pretrained: random)")] = True
    weights: Annotated[Path | None, typer.Option(help="Local weights (.safetensors/.pth) for MODEL")] = None
    repeats: Annotated[
        int,
        typer.Option(
            help="Timing rounds per measurement at least (more until each latency ratio's 90% interval is "
            "within ±0.02 or clear of the budget)"
        ),
    ] = 3
    min_time: Annotated[
        float, typer.Option(help="Seconds each timing runs at least (more rounds for fast calls: steadier medians)")
    ] = 0.5
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None
    force: Annotated[bool, typer.Option("--force", help="Replace an existing plan file / PNG")] = False


@typer_command(PlanArgs, target_options=False)
def plan(**options: Any) -> None:
    """Measure MODEL's per-layer sensitivity and latency, and save the plan that meets --budget at the best
    predicted fidelity (apply it with `vca-patch convert MODEL --plan FILE` or `patch_model(m, load_plan(FILE))`)."""
    args, _ = split_options(PlanArgs, options)
    args.png = args.png or args.output.with_suffix(".png")
    search = _search_space(args)
    files = _checked_inputs(args)
    net = load_base(args.model, pretrained=args.pretrained, weights=args.weights, img_size=args.resolution).eval()
    check_model_sizes(net, SimpleNamespace(), batch=args.images + args.eval_images,  # candidates past the grid: skipped
                      what=f"{args.model} at --resolution {args.resolution}")  # fmt: skip
    calib, held = _images(args, net, files)
    with console.status(f"Planning {args.model} at {args.resolution} px for {args.budget:g}x latency..."):
        result = plan_model(
            net, calib, budget=args.budget, resolution=args.resolution, **search, calibrate=args.calibrate,
            objective=args.objective, unmerge=args.unmerge, eval_images=held, repeats=args.repeats,
            min_time=args.min_time, log=console.print,
        )  # fmt: skip
    _show(result)
    _save(args, result)


def _search_space(args: PlanArgs) -> dict[str, Any]:
    """The candidates to weigh per block, from the options; a bad budget, count or mode refused before any work."""
    ns = _numbers_or_none(args.contrast_tokens, int, "--contrast-tokens")
    ks = _numbers_or_none(args.mano_windows, int, "--mano-windows")
    fractions = _numbers(args.merge_fractions, float, "--merge-fractions")
    leads = _numbers_or_none(args.merge_leads, float, "--merge-leads")
    if not args.budget > 0:
        raise PlanError(f"--budget must be a positive latency ratio (e.g. 0.5), got {args.budget}")
    if args.images < 1 or args.eval_images < 0:
        raise PlanError("--images must be at least 1 and --eval-images at least 0")
    if args.unmerge not in PLAN_UNMERGE_MODES:
        raise PlanError(f"--unmerge must be one of {', '.join(PLAN_UNMERGE_MODES)}, got {args.unmerge!r}")
    check_bound(args.resolution, "--resolution", 1, MAX_IMG_SIZE)  # before a position table of that size is built
    return {"contrast_tokens": ns, "mano_windows": ks, "local_window": args.local_window, "merge_fractions": fractions,
            "merge_leads": leads}  # fmt: skip


def _checked_inputs(args: PlanArgs) -> list[Path]:
    """The outputs checked (never an input, their folder exists, --force to replace), the threads set, and the
    calibration image files, enough for --images and --eval-images."""
    inputs = {"--calibration-data": args.calibration_data, "--weights file": args.weights, "MODEL": Path(args.model)}
    for option, path in (("-o", args.output), ("--png", args.png)):
        check_output(path, inputs, kind="file", force=args.force, option=option)
    if args.output.resolve() == args.png.resolve():
        raise PlanError(f"the plan and its PNG are the same file {args.output}; name another --png")
    files = image_files(args.calibration_data)
    need = args.images + args.eval_images
    if len(files) < need:
        raise PlanError(
            f"--calibration-data {args.calibration_data} holds {len(files)} images; --images {args.images} and "
            f"--eval-images {args.eval_images} need {need}"
        )
    if args.threads is not None:
        if args.threads < 1:
            raise PlanError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    return files


def _images(args: PlanArgs, net: torch.nn.Module, files: list[Path]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The calibration images and the held-out ones (None without --eval-images), normalised as the model's."""
    cfg = getattr(net, "pretrained_cfg", None) or {}
    norm = {k: tuple(cfg[k]) for k in ("mean", "std") if k in cfg}
    calib = load_images(files[: args.images], args.resolution, **norm)
    held_files = files[args.images : args.images + args.eval_images]
    return calib, (load_images(held_files, args.resolution, **norm) if args.eval_images else None)


def _show(result: PlanResult) -> None:
    console.print(plan_table(result))
    console.print(summary_table(result))
    warning = over_budget_line(result)
    if warning:
        console.print(f"[yellow]{warning}[/]", highlight=False)


def _save(args: PlanArgs, result: PlanResult) -> None:
    """The Pareto-front PNG and the plan file, each written atomically, and the command that applies the plan."""
    with atomic_file(args.png, suffix=".png") as tmp:
        series = {
            "merging alone (predicted)": [(c.latency, c.cls) for c in result.merging_front],
            "planner (predicted)": [(c.latency, c.cls) for c in result.front],
        }
        measured = result.measured
        chosen = (measured["latency_ratio"], measured["cls_cosine"]) if measured else (result.chosen.latency,
                                                                                       result.chosen.cls)  # fmt: skip
        title = f"{args.model} at {args.resolution} px"
        draw_front(tmp, series, title=title, budget=args.budget, chosen=chosen)
        save_plan(args.output, result.config, result.details(args.model))
    console.print(
        f"[bold green]Saved[/] {args.output} and {args.png}; apply with: vca-patch convert {args.model} --plan "
        f"{args.output} --img-size {args.resolution} -o DIR"
    )
