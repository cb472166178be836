"""Typer application: one sub-command per module in this package."""

from __future__ import annotations

import os
from typing import Annotated

import typer

from vca_patch.cli.bench import bench
from vca_patch.cli.convert import convert
from vca_patch.cli.errors import DEBUG_ENV, guarded, prepare_process, silence_library_warnings
from vca_patch.cli.export import export
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
for _command in (bench, convert, export, fidelity, finetune, inspect, plan, push):  # each inside the one error boundary
    app.command(name=_command.__name__)(guarded(_command))


@app.callback()
def _options(
    debug: Annotated[
        bool, typer.Option("--debug", help="Show the full stack of an error (and library warnings)")
    ] = False,
) -> None:
    """Convert pretrained vision transformers to Visual-Contrast Attention (VCA)."""
    if debug:
        os.environ[DEBUG_ENV] = "1"
    silence_library_warnings()


@app.command()
def version() -> None:
    """Print the vca-patch version."""
    from vca_patch._version import __version__

    typer.echo(__version__)


def main() -> None:
    """The `vca-patch` process: signals handled, streams that print in any locale and bounded Hub timeouts (where the
    user set none), then the command."""
    from vca_patch.core.hub_access import set_hub_timeout_defaults

    prepare_process()
    set_hub_timeout_defaults()
    app()
