"""Typer application: one sub-command per module in this package."""

from __future__ import annotations

import typer

from vca_patch.cli.bench import bench
from vca_patch.cli.convert import convert
from vca_patch.cli.fidelity import fidelity
from vca_patch.cli.finetune import finetune
from vca_patch.cli.inspect import inspect
from vca_patch.cli.plan import plan
from vca_patch.cli.push import push

app = typer.Typer(
    name="vca-patch",
    help="Convert pretrained vision transformers to Visual-Contrast Attention (VCA).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command()(bench)
app.command()(convert)
app.command()(fidelity)
app.command()(finetune)
app.command()(inspect)
app.command()(plan)
app.command()(push)


@app.command()
def version() -> None:
    """Print the vca-patch version."""
    from vca_patch._version import __version__

    typer.echo(__version__)


def main() -> None:
    app()
