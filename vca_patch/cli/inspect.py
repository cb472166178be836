"""`vca-patch inspect`: list every attention site and what a conversion would do, changing nothing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from vca_patch.cli.common import check_model_sizes, console, load_base, parse_layers
from vca_patch.cli.report_view import sites_table, totals_table
from vca_patch.cli.target_options import split_options, target_config, target_names, typer_command
from vca_patch.families import hooks_for
from vca_patch.surgery import inspect_model
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.llava_sp.plan import projector_table


@dataclass
class InspectArgs:
    """`inspect`'s options besides the targets' (which come from their config fields)."""

    model: Annotated[
        str, typer.Argument(help="timm model name, hf-hub:ORG/NAME, or a transformers or diffusers folder or ORG/NAME")
    ]
    pretrained: Annotated[bool, typer.Option(help="Load pretrained Hub weights (not needed to inspect)")] = False
    weights: Annotated[Path | None, typer.Option(help="Local weights for MODEL")] = None
    layers: Annotated[str | None, typer.Option(help="Blocks to convert, e.g. '0-5,8' (default: all)")] = None
    include: Annotated[str | None, typer.Option(help="Regex: convert only matching module paths")] = None
    exclude: Annotated[str | None, typer.Option(help="Regex: never convert matching module paths")] = None
    to: Annotated[str, typer.Option("--to", help=f"Target: {target_names()}")] = "vca"
    strict: Annotated[bool, typer.Option("--strict", help="Fail on approximate or unverified conversions")] = False
    img_size: Annotated[
        int | None, typer.Option(help="Input size in pixels (timm's img_size; transformers: the config's; DINOv2: any)")
    ] = None


@typer_command(InspectArgs)
def inspect(**options: Any) -> None:
    """Dry run: show MODEL's attention sites and what `convert` would do with each."""
    args, target_values = split_options(InspectArgs, options)
    selection = {"layers": parse_layers(args.layers), "include": args.include, "exclude": args.exclude}
    config = target_config(args.to, target_values, **selection)
    _show(args, config)


def _show(args: InspectArgs, config: TargetConfig) -> None:
    model, strict = args.model, args.strict
    net = load_base(model, pretrained=args.pretrained, weights=args.weights, img_size=args.img_size)
    config = check_model_sizes(net, config, batch=0, what=model)  # no forward pass: the grid and the contrast tokens
    report = inspect_model(net, config, strict=strict)
    console.print(sites_table(report, dry_run=True))
    kinds = _kinds_table(net)
    if kinds is not None:
        console.print(kinds)
    console.print(totals_table(report))
    projector = projector_table(net, model)  # a LLaVA: its projector's spatial-token surgery (--to llava-sp)
    if projector is not None:
        console.print(projector)


def _kinds_table(net: Any) -> Table | None:
    """What each attention module is and the tokens it sees, where the model's family says
    (`ModelAdapter.describe_sites`, e.g. a diffusion transformer's); None where it says nothing."""
    family = hooks_for(net)
    rows = family.describe_sites(net)
    if not rows:
        return None
    kinds = Table(title=family.sites_title, title_justify="left")
    for column in ("module", "kind", "tokens"):
        kinds.add_column(column, no_wrap=column == "module")
    for row in rows:
        kinds.add_row(row["module"], row["kind"], row["tokens"])
    return kinds
