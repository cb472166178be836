"""Typer application: one sub-command per module in this package."""

from __future__ import annotations

import typer

from .bench import bench
from .convert import convert
from .fidelity import fidelity
from .finetune import finetune
from .inspect import inspect
from .plan import plan
from .push import push

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
    from .. import __version__

    typer.echo(__version__)


def main() -> None:
    app()
