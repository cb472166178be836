"""`vca-patch push`: upload a converted checkpoint folder to the Hugging Face Hub in one commit."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vca_patch.cli.common import console
from vca_patch.hub import push_to_hub


def push(
    directory: Annotated[Path, typer.Argument(help="Checkpoint folder written by `vca-patch convert`")],
    repo_id: Annotated[str, typer.Argument(help="Hub repo to push to, e.g. ORG/NAME (created if missing)")],
    private: Annotated[bool, typer.Option("--private", help="Create the repo as private")] = False,
    revision: Annotated[str | None, typer.Option(help="Branch to commit to (created if missing; default main)")] = None,
    message: Annotated[str | None, typer.Option("--message", "-m", help="Commit message")] = None,
    token: Annotated[
        str | None, typer.Option(help="Hub token (default: HF_TOKEN or `hf auth login`)", show_default=False)
    ] = None,
) -> None:
    """Push DIRECTORY to the Hub as REPO_ID: config.json, weights and a generated model card.

    A LLaVA-SP folder (`convert --to llava-sp`) goes up whole: model, spatial tokens, processor and card.
    """
    with console.status(f"Pushing {directory} to {repo_id}..."):
        url = push_to_hub(directory, repo_id, private=private, token=token, revision=revision, commit_message=message)
    console.print(f"[bold green]Pushed[/] {directory}/ to {repo_id}")
    console.print(url, highlight=False, soft_wrap=True)
