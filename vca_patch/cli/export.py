"""`vca-patch export`: a converted folder to a `torch.export` program (.pt2) or an ONNX file, checked against eager."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from vca_patch.cli.common import console
from vca_patch.core.paths import check_output


def _parse_size(spec: str | None) -> int | tuple[int, int] | None:
    if spec is None:
        return None
    from vca_patch.export import ExportError

    match = re.fullmatch(r"\s*(\d+)\s*(?:[x,\s]\s*(\d+)\s*)?", spec)
    if not match:
        raise ExportError(f"--img-size takes N or HxW (e.g. 224 or 320x256), got {spec!r}")
    height, width = match.group(1), match.group(2)
    return int(height) if width is None else (int(height), int(width))


def export(
    directory: Annotated[Path, typer.Argument(help="A converted model folder (vca-patch convert's output)")],
    format: Annotated[str, typer.Option("--format", "-f", help="pt2 (torch.export) or onnx")] = "pt2",
    dynamic: Annotated[
        bool | None,
        typer.Option(
            "--dynamic/--static",
            help="--dynamic: dynamic batch, height and width; --static: every axis fixed (default: dynamic batch, "
            "and dynamic height and width when the original takes any image size)",
        ),
    ] = None,
    img_size: Annotated[
        str | None, typer.Option("--img-size", help="Example and checked size: N or HxW (default: the model's)")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output file (default: DIRECTORY.pt2 / .onnx beside it)")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace the output file if it exists")] = False,
) -> None:
    """Export a converted model to .pt2 or ONNX; the written file is checked against eager (max error printed)."""
    from vca_patch.checkpoint.folder import read_checkpoint_config
    from vca_patch.export import FORMATS, ExportError, FixedSizeError, export_folder

    if format not in FORMATS:
        raise ExportError(f"unsupported --format {format!r}: choose one of {', '.join(FORMATS)}")
    size = _parse_size(img_size)
    read_checkpoint_config(directory)  # the input first: a missing folder is named as such, not by its output
    out = output if output is not None else directory.parent / f"{directory.name}.{format}"
    check_output(out, {"model folder": directory}, kind="file", force=force, option="-o")
    try:
        result = export_folder(directory, out, format=format, dynamic=dynamic, img_size=size)
    except FixedSizeError as exc:  # the command that works: the model's own size, the batch dynamic
        raise FixedSizeError(f"{exc}: vca-patch export {directory} --format {format}") from None
    shapes = ", ".join(f"{b}x{h}x{w}" for b, h, w in result.checked)
    console.print(
        f"wrote {result.path} ({result.format}, {result.axes()}); checked against eager at {shapes} "
        f"(batch x H x W): max |error| {result.max_error:.2e}",
        highlight=False,
        soft_wrap=True,
    )
    refused = result.limits if result.format == "pt2" else [r for r in result.limits if r.size in result.unserved]
    if refused:
        runtime = "the .pt2 refuses" if result.format == "pt2" else "onnxruntime fails at"
        console.print(
            f"note: the traced graph holds only where {refused[0].guard} (a converted layer branches on the grid "
            f"size); {runtime} other sizes, e.g. {refused[0].height}x{refused[0].width}",
            highlight=False,
            soft_wrap=True,
        )
