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
            help="Dynamic batch, height and width (default: dynamic when the original takes any image size)",
        ),
    ] = None,
    img_size: Annotated[
        str | None, typer.Option("--img-size", help="Example and checked size: N or HxW (default: the model's)")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Output file (default: DIRECTORY.pt2 / .onnx beside it)")
    ] = None,
) -> None:
    """Export a converted model to .pt2 or ONNX; the written file is checked against eager (max error printed)."""
    from vca_patch.export import FORMATS, ExportError, export_folder

    if format not in FORMATS:
        raise ExportError(f"unsupported --format {format!r}: choose one of {', '.join(FORMATS)}")
    size = _parse_size(img_size)
    out = output if output is not None else directory.parent / f"{directory.name}.{format}"
    check_output(out, {"model folder": directory}, kind="file", option="-o")
    result = export_folder(directory, out, format=format, dynamic=dynamic, img_size=size)
    shapes = ", ".join(f"{b}x{h}x{w}" for b, h, w in result.checked)
    console.print(
        f"wrote {result.path} ({result.format}, {'dynamic batch/height/width' if result.dynamic else 'static'}); "
        f"checked against eager at {shapes} (batch x H x W): max |error| {result.max_error:.2e}",
        highlight=False,
        soft_wrap=True,
    )
