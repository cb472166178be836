"""`from_pretrained(repo_id_or_dir, revision=None)`: one call from a folder or a Hub repo to a model."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..io import checkpoint
from .errors import InvalidRepoIdError, RepoNotFoundError
from .resolve import fetch_checkpoint, is_local


def from_pretrained(
    repo_id_or_dir: str | Path,
    revision: str | None = None,
    *,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    token: str | None = None,
) -> nn.Module:
    """Rebuild a converted model, in eval mode, from a `save_pretrained` folder or a Hub repo id.

    A repo id is fetched into the Hugging Face cache (config.json, then the weights file it names, at
    `revision`: a branch, tag or commit); a cached repo loads offline. Delta checkpoints also fetch
    their base weights.
    """
    if is_local(repo_id_or_dir):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos; {repo_id_or_dir} is a local folder")
        return checkpoint.from_pretrained(Path(repo_id_or_dir).expanduser(), device=device)
    try:
        folder, _ = fetch_checkpoint(str(repo_id_or_dir), revision, cache_dir=cache_dir, token=token)
    except (InvalidRepoIdError, RepoNotFoundError) as exc:
        raise type(exc)(f"{exc} (and there is no local folder {repo_id_or_dir})") from None
    return checkpoint.from_pretrained(folder, device=device)
