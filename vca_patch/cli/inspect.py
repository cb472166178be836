"""`vca-patch inspect`: list every attention site and what a conversion would do, changing nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..config import ConfigError, VCAConfig
from ..surgery import PatchError, inspect_model
from .common import console, fail, load_base, parse_layers, warn_contrast_grid
from .report_view import sites_table, totals_table


def inspect(
    model: Annotated[str, typer.Argument(help="timm model name or hf-hub:ORG/NAME")],
    pretrained: Annotated[bool, typer.Option(help="Load pretrained Hub weights (not needed to inspect)")] = False,
    weights: Annotated[Path | None, typer.Option(help="Local weights for MODEL")] = None,
    layers: Annotated[str | None, typer.Option(help="Blocks to convert, e.g. '0-5,8' (default: all)")] = None,
    include: Annotated[str | None, typer.Option(help="Regex: convert only matching module paths")] = None,
    exclude: Annotated[str | None, typer.Option(help="Regex: never convert matching module paths")] = None,
    contrast_tokens: Annotated[int, typer.Option(help="Pooled contrast tokens n (a perfect square)")] = 49,
    strict: Annotated[bool, typer.Option("--strict", help="Fail on approximate or unverified conversions")] = False,
    img_size: Annotated[
        int | None, typer.Option(help="Input size in pixels (timm's img_size; transformers: must match the config)")
    ] = None,
) -> None:
    """Dry run: show MODEL's attention sites and what `convert` would do with each."""
    try:
        config = VCAConfig(
            contrast_tokens=contrast_tokens, layers=parse_layers(layers), include=include, exclude=exclude
        )
    except ConfigError as exc:
        fail(str(exc), 2)
    net = load_base(model, pretrained=pretrained, weights=weights, img_size=img_size)
    try:
        report = inspect_model(net, config, strict=strict)
    except PatchError as exc:
        fail(str(exc))
    console.print(sites_table(report, dry_run=True))
    console.print(totals_table(report))
    warn_contrast_grid(report, model)
