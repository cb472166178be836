"""`vca-patch fidelity`: measure a converted checkpoint against its original on real data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from .common import DEVICE_HELP, DTYPE_HELP, console, fail, resolve_device, resolve_dtype

KINDS = ("fashion_mnist", "imagefolder", "hf")


def data_spec(kind: str | None, path: str | None, split: str, limit: int | None, option: str = "--data-kind"):
    """A DataSpec for one evaluation split given on the command line; without `kind`, inferred from `path`."""
    from ..data import DatasetError, infer_kind
    from ..train.recipe import DataSpec

    if kind is None:
        try:
            kind = infer_kind(path)
        except DatasetError as exc:
            fail(str(exc), 2)
    if kind not in KINDS:
        fail(f"{option} must be one of {', '.join(KINDS)}, got {kind!r}", 2)
    return DataSpec(kind=kind, path=path, eval_split=split, eval_limit=limit)


def fidelity(
    checkpoint: Annotated[Path, typer.Argument(help="A converted checkpoint folder (save_pretrained / convert)")],
    data: Annotated[str | None, typer.Option(help="Dataset: idx folder, ImageFolder root or HF dataset name")] = None,
    data_kind: Annotated[
        str | None,
        typer.Option(help="fashion_mnist, imagefolder or hf (default: from --data: idx files, a folder, or a name)"),
    ] = None,
    split: Annotated[
        str, typer.Option(help="Split to measure on (ImageFolder: its sub-folder; val/test aliases; flat: held out)")
    ] = "test",
    limit: Annotated[int, typer.Option(help="Images to measure on")] = 512,
    batch_size: Annotated[int, typer.Option(help="Batch size")] = 64,
    original: Annotated[
        Path | None,
        typer.Option(help="Checkpoint whose original attention is the reference (default: CHECKPOINT's own)"),
    ] = None,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of the per-layer errors (needs matplotlib)")] = None,
    json_out: Annotated[Path | None, typer.Option("--json", help="Write the full report as JSON")] = None,
    device: Annotated[str, typer.Option(help=f"Where to run both models: {DEVICE_HELP}")] = "auto",
    dtype: Annotated[str, typer.Option(help=f"{DTYPE_HELP} of both models (errors are summed in float64)")] = (
        "float32"
    ),
) -> None:
    """Per-layer attention error, final-feature cosines and top-1 agreement of CHECKPOINT vs its original."""
    import torch
    from torch.utils.data import DataLoader

    from ..data import DatasetError, build_dataset
    from ..fidelity import fidelity as measure
    from ..fidelity import model_input_size
    from ..io import CheckpointError, from_pretrained
    from ..train.finetune import teacher_from

    if limit < 1:
        fail(f"--limit must be at least 1 image, got {limit}", 2)
    if batch_size < 1:
        fail(f"--batch-size must be at least 1, got {batch_size}", 2)
    torch_device, torch_dtype = resolve_device(device), resolve_dtype(dtype)
    try:
        model = from_pretrained(checkpoint, device=torch_device).to(torch_dtype)
        reference = None
        if original is not None:
            reference = teacher_from(from_pretrained(original, device=torch_device).to(torch_dtype))
    except CheckpointError as exc:
        fail(str(exc), 2)
    spec = data_spec(data_kind, data, split, limit)
    size = model_input_size(model)
    try:
        dataset = build_dataset(
            spec,
            split,
            training=False,
            img_size=size[1],
            model_cfg={**(model.pretrained_cfg or {}), "input_size": size},
        )
    except DatasetError as exc:
        fail(str(exc), 2)
    with console.status(f"Measuring on {min(limit, len(dataset))} images..."), torch.no_grad():
        report = measure(reference, model, DataLoader(dataset, batch_size=batch_size))
    table = Table(title="Per-layer relative error of the attention output", title_justify="left")
    for column in ("layer", "teacher-forced", "free-running"):
        table.add_column(column, justify="right" if column != "layer" else "left")
    for name, e, f in zip(report.layers, report.layer_error, report.layer_error_free, strict=True):
        table.add_row(name, f"{e:.4f}", f"{f:.4f}")
    console.print(table)
    summary = Table(title="Summary", title_justify="left", show_header=False)
    summary.add_column(style="bold")
    summary.add_column(justify="right")
    for key, value in report.summary().items():
        summary.add_row(key, f"{value:.4f}")
    summary.add_row("images", str(report.num_images))
    console.print(summary)
    if json_out is not None:
        json_out.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    if plot is not None:
        try:
            report.plot(plot)
        except ImportError as exc:
            fail(str(exc), 2)
        console.print(f"wrote {plot}")


def summary_table(summary: dict[str, float], title: str = "Fidelity to the original") -> Table:
    """A two-column table of a FidelityReport.summary()."""
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in summary.items():
        table.add_row(key.replace("_", " "), f"{value:.4f}")
    return table


def calibrate_for_convert(net, data: Path | None, kind: str | None, images: int, probe) -> tuple[dict[str, float], str]:
    """Calibrate a freshly patched VCA model on `images` training images of `data` (when given) and
    measure it (on held-out images of the same data, else on `probe`). Returns (summary, where measured)."""
    import torch
    from torch.utils.data import DataLoader, Subset

    from ..attention import VisualContrastAttention
    from ..data import DatasetError, build_dataset
    from ..fidelity import fidelity as measure
    from ..fidelity import model_input_size
    from ..recovery import calibrate

    if data is None:
        with torch.no_grad():
            return measure(None, net, [probe]).summary(), f"{len(probe)} random probe images"
    if not any(isinstance(m, VisualContrastAttention) for m in net.modules()):
        fail("--calibration-data applies to VCA conversions only", 2)
    spec = data_spec(kind, str(data), "test", None, "--calibration-kind")
    size = model_input_size(net)
    cfg = {**(getattr(net, "pretrained_cfg", None) or {}), "input_size": size}
    try:
        # training=True: the train split (spec.augment is "none": eval transforms), disjoint from the held-out one
        train = build_dataset(spec, "train", training=True, img_size=size[1], model_cfg=cfg)
        held_out = build_dataset(spec, "test", training=False, img_size=size[1], model_cfg=cfg)
    except DatasetError as exc:
        fail(str(exc), 2)
    calib = DataLoader(Subset(train, range(min(images, len(train)))), batch_size=64)
    probe_set = DataLoader(Subset(held_out, range(min(images, len(held_out)))), batch_size=64)
    with torch.no_grad():
        calibrate(net, calib)
        return measure(None, net, probe_set).summary(), f"{min(images, len(held_out))} held-out images of {data}"
