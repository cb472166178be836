"""`from_pretrained(repo_id_or_dir, revision=None)`: one call from a folder or a Hub repo to a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.checkpoint import folder as checkpoint
from vca_patch.core.formats import FORMATS, format_of_folder
from vca_patch.hub.errors import HubUnavailableError, InvalidRepoIdError, RepoNotFoundError
from vca_patch.hub.formats import fetch_format_folder
from vca_patch.hub.resolve import fetch_checkpoint, is_local


def from_pretrained(
    repo_id_or_dir: str | Path,
    revision: str | None = None,
    *,
    device: str | torch.device = "cpu",
    cache_dir: str | Path | None = None,
    token: str | None = None,
    base_weights: str | Path | dict[str, Any] | None = None,
    base_state_dict: dict[str, torch.Tensor] | None = None,
) -> nn.Module:
    """Rebuild a converted model, in eval mode, from a `save_pretrained` folder or a Hub repo id.

    A repo id is fetched into the Hugging Face cache (config.json, then the weights file it names, at
    `revision`: a branch, tag or commit); a cached repo loads offline. Delta checkpoints also fetch
    the Hub base weights their config.json names, or take `base_weights` (a local file or
    "org/name@revision") / `base_state_dict` from the caller; a local path written in config.json is never
    followed by itself. A folder or repo of a registered checkpoint format (e.g. LLaVA-SP's, with
    spatial_tokens.json) loads through its format.
    """
    base = {"base_weights": base_weights, "base_state_dict": base_state_dict}
    if is_local(repo_id_or_dir):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos; {repo_id_or_dir} is a local folder")
        fmt = format_of_folder(repo_id_or_dir)
        if fmt is not None and base_weights is None and base_state_dict is None:  # e.g. a LLaVA-SP folder
            return fmt.load(Path(repo_id_or_dir).expanduser(), device)
        return checkpoint.from_pretrained(Path(repo_id_or_dir).expanduser(), device=device, **base)
    try:
        folder, _ = fetch_checkpoint(str(repo_id_or_dir), revision, cache_dir=cache_dir, token=token)
    except (InvalidRepoIdError, RepoNotFoundError, HubUnavailableError) as exc:
        raise type(exc)(f"no local folder {repo_id_or_dir}, and as a Hub repo id: {exc}") from None
    except checkpoint.CheckpointError:  # not a vca-patch config.json: a repo of a registered format?
        if base_weights is not None or base_state_dict is not None:
            raise
        for fmt in FORMATS.values():
            found = fetch_format_folder(fmt, str(repo_id_or_dir), revision, cache_dir=cache_dir, token=token)
            if found is not None:
                return fmt.load(found, device)
        raise
    return checkpoint.from_pretrained(folder, device=device, **base)
