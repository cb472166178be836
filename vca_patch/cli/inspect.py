"""`vca-patch inspect`: list every attention site and what a conversion would do, changing nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from vca_patch.cli.common import (
    PVT_MODE_HELP,
    STAGE_TOKENS_HELP,
    SWIN_MODE_HELP,
    console,
    fail,
    load_base,
    parse_layers,
    parse_stage_tokens,
    warn_contrast_grid,
)
from vca_patch.cli.report_view import sites_table, totals_table
from vca_patch.core.errors import ConfigError
from vca_patch.families.diffusers.dit import describe_sites
from vca_patch.families.diffusers.probe import is_diffusers_model
from vca_patch.surgery import PatchError, inspect_model
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.llava_sp.plan import projector_table
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.vca.config import VCAConfig


def inspect(
    model: Annotated[
        str, typer.Argument(help="timm model name, hf-hub:ORG/NAME, or a transformers or diffusers folder or ORG/NAME")
    ],
    pretrained: Annotated[bool, typer.Option(help="Load pretrained Hub weights (not needed to inspect)")] = False,
    weights: Annotated[Path | None, typer.Option(help="Local weights for MODEL")] = None,
    layers: Annotated[str | None, typer.Option(help="Blocks to convert, e.g. '0-5,8' (default: all)")] = None,
    include: Annotated[str | None, typer.Option(help="Regex: convert only matching module paths")] = None,
    exclude: Annotated[str | None, typer.Option(help="Regex: never convert matching module paths")] = None,
    contrast_tokens: Annotated[int, typer.Option(help="Pooled contrast tokens n (a perfect square)")] = 49,
    to: Annotated[str, typer.Option("--to", help="Target: vca or mano")] = "vca",
    swin_mode: Annotated[str, typer.Option(help=SWIN_MODE_HELP)] = "residual",
    pvt_mode: Annotated[str, typer.Option(help=PVT_MODE_HELP)] = "carry",
    stage_contrast_tokens: Annotated[str | None, typer.Option(help=STAGE_TOKENS_HELP)] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Fail on approximate or unverified conversions")] = False,
    img_size: Annotated[
        int | None, typer.Option(help="Input size in pixels (timm's img_size; transformers: the config's; DINOv2: any)")
    ] = None,
) -> None:
    """Dry run: show MODEL's attention sites and what `convert` would do with each."""
    try:
        selection = {"layers": parse_layers(layers), "include": include, "exclude": exclude}
        config: TargetConfig
        vca_only = {
            "--contrast-tokens": contrast_tokens != 49,
            "--swin-mode": swin_mode != "residual",
            "--pvt-mode": pvt_mode != "carry",
            "--stage-contrast-tokens": stage_contrast_tokens is not None,
        }
        given = [name for name, changed in vca_only.items() if changed]
        if to != "vca" and given:
            raise ConfigError(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} for --to vca, not --to {to}; "
                              f"drop {'it' if len(given) == 1 else 'them'}")  # fmt: skip
        if to == "vca":
            config = VCAConfig(
                contrast_tokens=contrast_tokens, swin_mode=swin_mode, pvt_mode=pvt_mode,
                stage_contrast_tokens=parse_stage_tokens(stage_contrast_tokens), **selection,
            )  # fmt: skip
        elif to == "mano":
            config = MANOConfig(**selection)
        else:
            raise ConfigError(f"--to must be 'vca' or 'mano' for inspect, got {to!r}")
    except ConfigError as exc:
        fail(str(exc), 2)
    net = load_base(model, pretrained=pretrained, weights=weights, img_size=img_size)
    try:
        report = inspect_model(net, config, strict=strict)
    except PatchError as exc:
        fail(str(exc))
    console.print(sites_table(report, dry_run=True))
    if is_diffusers_model(net):  # what each attention is, and the tokens it sees
        kinds = Table(title="Diffusion transformer attention", title_justify="left")
        for column in ("module", "kind", "tokens"):
            kinds.add_column(column, no_wrap=column == "module")
        for row in describe_sites(net):
            kinds.add_row(row["module"], row["kind"], row["tokens"])
        console.print(kinds)
    console.print(totals_table(report))
    projector = projector_table(net, model)  # a LLaVA: its projector's spatial-token surgery (--to llava-sp)
    if projector is not None:
        console.print(projector)
    warn_contrast_grid(report, model)
