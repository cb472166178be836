"""`from_pretrained(repo_id_or_dir, revision=None)`: one call from a folder or a Hub repo to a model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.checkpoint import folder as checkpoint
from vca_patch.hub.errors import HubUnavailableError, InvalidRepoIdError, RepoNotFoundError
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
    followed by itself. A LLaVA-SP folder or repo (spatial_tokens.json) loads with its spatial tokens.
    """
    from vca_patch.targets.llava_sp.hub import fetch_spatial_folder, is_spatial_folder, load_spatial_folder

    base = {"base_weights": base_weights, "base_state_dict": base_state_dict}
    if is_local(repo_id_or_dir):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos; {repo_id_or_dir} is a local folder")
        if is_spatial_folder(repo_id_or_dir) and base_weights is None and base_state_dict is None:
            return load_spatial_folder(Path(repo_id_or_dir).expanduser(), device)  # a LLaVA-SP folder
        return checkpoint.from_pretrained(Path(repo_id_or_dir).expanduser(), device=device, **base)
    try:
        folder, _ = fetch_checkpoint(str(repo_id_or_dir), revision, cache_dir=cache_dir, token=token)
    except (InvalidRepoIdError, RepoNotFoundError, HubUnavailableError) as exc:
        raise type(exc)(f"no local folder {repo_id_or_dir}, and as a Hub repo id: {exc}") from None
    except checkpoint.CheckpointError:  # not a vca-patch config.json: a LLaVA-SP repo (spatial_tokens.json)?
        if base_weights is not None or base_state_dict is not None:
            raise
        spatial = fetch_spatial_folder(str(repo_id_or_dir), revision, cache_dir=cache_dir, token=token)
        if spatial is None:
            raise
        return load_spatial_folder(spatial, device)
    return checkpoint.from_pretrained(folder, device=device, **base)
