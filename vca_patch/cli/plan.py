"""`vca-patch plan`: choose per block between softmax, VCA(n), MANO(k) and token merging to meet a latency budget."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Annotated

import torch
import typer
from rich.table import Table

from vca_patch.cli.common import check_model_sizes, console, fail, load_base
from vca_patch.core.atomic import atomic_file
from vca_patch.core.paths import check_output
from vca_patch.core.sizes import MAX_IMG_SIZE, check_bound
from vca_patch.planner import PLAN_UNMERGE_MODES, PlanError, PlanResult, draw_front, plan_model, save_plan
from vca_patch.planner.costs import token_counts
from vca_patch.planner.images import image_files, load_images


def _numbers(text: str, kind: type, name: str) -> list:
    try:
        return [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"{name} must be a comma-separated list of numbers, got {text!r}", 2)


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
    if finalist:  # what chose it: timed against the original, scored on the calibration crops kept for scoring
        table.add_row(
            "as a finalist", f"{finalist['latency_ratio']:.3f}", f"{finalist['cls_cosine']:.4f}",
            f"{finalist['patch_token_cosine']:.4f}", f"{finalist['mean_patch_cosine']:.4f}",
        )  # fmt: skip
    if measured:
        table.add_row(
            "measured", f"{measured['latency_ratio']:.3f}", f"{measured['cls_cosine']:.4f}",
            f"{measured['patch_token_cosine']:.4f}", f"{measured['mean_patch_cosine']:.4f}",
        )  # fmt: skip
    return table


def over_budget_line(result: PlanResult) -> str | None:
    """A warning when the chosen plan measured slower than the budget, else None."""
    if not result.over_budget:
        return None
    return (
        f"Measured {result.measured['latency_ratio']:.3f}x is over the {result.budget:g}x budget (predicted "
        f"{result.chosen.latency:.3f}x). Batch-1 latency varies between runs: time the plan again with a longer "
        "--min-time on an idle machine, or plan for a lower --budget."
    )


def plan(
    model: Annotated[str, typer.Argument(help="timm model name (e.g. vit_small_patch14_dinov2) or hf-hub:ORG/NAME")],
    calibration_data: Annotated[
        Path, typer.Option(help="Folder of calibration images (any layout; every image file under it)")
    ],
    budget: Annotated[float, typer.Option(help="Latency budget: ratio to the original's batch-1 latency")] = 0.5,
    resolution: Annotated[int, typer.Option(help="Input size in pixels to plan for")] = 224,
    output: Annotated[Path, typer.Option("--output", "-o", help="Plan file to write (JSON)")] = Path("plan.json"),
    png: Annotated[Path | None, typer.Option(help="Pareto-front PNG (default: the plan file with .png)")] = None,
    images: Annotated[int, typer.Option(help="Calibration images to use (the first, sorted by path)")] = 8,
    eval_images: Annotated[
        int, typer.Option(help="Further images, after the calibration ones, kept apart to measure the plan on")
    ] = 0,
    contrast_tokens: Annotated[
        str, typer.Option(help="VCA contrast-token counts n to try, e.g. '16,49' ('none': merging only)")
    ] = "16,49",
    mano_windows: Annotated[
        str, typer.Option(help="MANO window sides k to try, e.g. '7' ('' or 'none': no MANO blocks)")
    ] = "7",
    local_window: Annotated[
        int,
        typer.Option(
            help="Give the VCA candidates a local term: each patch also attends exactly to its k×k neighbours "
            "(odd k, e.g. 7; 0: none). Costs latency, buys fidelity; the plan weighs both"
        ),
    ] = 0,
    merge_fractions: Annotated[
        str, typer.Option(help="Fractions of the patch tokens merging may remove, e.g. '0.3,0.5,0.7,0.85,0.95'")
    ] = "0.3,0.5,0.7,0.85,0.95",
    objective: Annotated[str, typer.Option(help="What to keep: cls, patch (dense) or both")] = "both",
    unmerge: Annotated[
        str,
        typer.Option(
            help="How merged tokens return to their patches: copy (ToMe's), residual (plus what merging took "
            "from each patch: better patch tokens, a little slower) or auto (residual unless --objective cls)"
        ),
    ] = "auto",
    calibrate: Annotated[bool, typer.Option(help="Calibrate the VCA candidates (training-free)")] = True,
    pretrained: Annotated[
        bool, typer.Option(help="Start from pretrained Hub weights (--no-pretrained: random)")
    ] = True,
    weights: Annotated[Path | None, typer.Option(help="Local weights (.safetensors/.pth) for MODEL")] = None,
    repeats: Annotated[int, typer.Option(help="Timing rounds per measurement")] = 3,
    min_time: Annotated[
        float, typer.Option(help="Seconds each timing runs at least (more rounds for fast calls: steadier medians)")
    ] = 0.5,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's)")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an existing plan file / PNG")] = False,
) -> None:
    """Measure MODEL's per-layer sensitivity and latency, and save the plan that meets --budget at the best
    predicted fidelity (apply it with `vca-patch convert MODEL --plan FILE` or `patch_model(m, load_plan(FILE))`)."""
    png = png or output.with_suffix(".png")
    ns = [] if contrast_tokens.strip().lower() == "none" else _numbers(contrast_tokens, int, "--contrast-tokens")
    ks = [] if mano_windows.strip().lower() in ("", "none") else _numbers(mano_windows, int, "--mano-windows")
    fractions = _numbers(merge_fractions, float, "--merge-fractions")
    if not budget > 0:
        raise PlanError(f"--budget must be a positive latency ratio (e.g. 0.5), got {budget}")
    if images < 1 or eval_images < 0:
        raise PlanError("--images must be at least 1 and --eval-images at least 0")
    if unmerge not in PLAN_UNMERGE_MODES:
        raise PlanError(f"--unmerge must be one of {', '.join(PLAN_UNMERGE_MODES)}, got {unmerge!r}")
    check_bound(resolution, "--resolution", 1, MAX_IMG_SIZE)  # before a position table of that size is built
    inputs = {"--calibration-data": calibration_data, "--weights file": weights, "MODEL": Path(model)}
    for option, path in (("-o", output), ("--png", png)):  # never an input; its folder exists; --force to replace
        check_output(path, inputs, kind="file", force=force, option=option)
    if output.resolve() == png.resolve():
        raise PlanError(f"the plan and its PNG are the same file {output}; name another --png")
    files = image_files(calibration_data)
    if len(files) < images + eval_images:
        raise PlanError(
            f"--calibration-data {calibration_data} holds {len(files)} images; --images {images} and "
            f"--eval-images {eval_images} need {images + eval_images}"
        )
    if threads is not None:
        if threads < 1:
            raise PlanError(f"--threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    net = load_base(model, pretrained=pretrained, weights=weights, img_size=resolution).eval()
    check_model_sizes(net, SimpleNamespace(), batch=images + eval_images,  # candidates past the grid are skipped
                      what=f"{model} at --resolution {resolution}")  # fmt: skip
    cfg = getattr(net, "pretrained_cfg", None) or {}
    norm = {k: tuple(cfg[k]) for k in ("mean", "std") if k in cfg}
    calib = load_images(files[:images], resolution, **norm)
    held = load_images(files[images : images + eval_images], resolution, **norm) if eval_images else None
    with console.status(f"Planning {model} at {resolution} px for {budget:g}x latency..."):
        result = plan_model(
            net, calib, budget=budget, resolution=resolution, contrast_tokens=ns, mano_windows=ks,
            local_window=local_window, merge_fractions=fractions, calibrate=calibrate, objective=objective,
            unmerge=unmerge, eval_images=held, repeats=repeats, min_time=min_time, log=console.print,
        )  # fmt: skip
    console.print(plan_table(result))
    console.print(summary_table(result))
    warning = over_budget_line(result)
    if warning:
        console.print(f"[yellow]{warning}[/]", highlight=False)
    with atomic_file(png, suffix=".png") as tmp:
        series = {
            "merging alone (predicted)": [(c.latency, c.cls) for c in result.merging_front],
            "planner (predicted)": [(c.latency, c.cls) for c in result.front],
        }
        measured = result.measured
        chosen = (
            (measured["latency_ratio"], measured["cls_cosine"])
            if measured
            else (result.chosen.latency, result.chosen.cls)
        )
        draw_front(tmp, series, title=f"{model} at {resolution} px", budget=budget, chosen=chosen)
        save_plan(output, result.config, result.details(model))
    console.print(
        f"[bold green]Saved[/] {output} and {png}; apply with: vca-patch convert {model} --plan {output} "
        f"--img-size {resolution} -o DIR"
    )
