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
    if not isinstance(repo_id_or_dir, (str, Path)) or not str(repo_id_or_dir).strip():
        raise checkpoint.CheckpointError(
            f"the checkpoint path is empty or not a path ({type(repo_id_or_dir).__name__} {repo_id_or_dir!r}); pass "
            "the folder save_pretrained wrote, or a Hub repo id ORG/NAME"
        )
    if is_local(repo_id_or_dir):
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hub repos; {repo_id_or_dir} is a local folder")
        fmt = format_of_folder(repo_id_or_dir)
        if fmt is not None and base_weights is None and base_state_dict is None:  # e.g. a LLaVA-SP folder
            return fmt.load(Path(repo_id_or_dir).expanduser(), device)
        return checkpoint.from_pretrained(Path(repo_id_or_dir).expanduser(), device=device, **base)
    try:
        folder, _ = fetch_checkpoint(str(repo_id_or_dir), revision, cache_dir=cache_dir, token=token)
    except (InvalidRepoIdError, RepoNotFoundError) as exc:
        raise _as_repo_id(exc, repo_id_or_dir) from None
    except (checkpoint.CheckpointError, HubUnavailableError) as exc:  # no vca-patch config.json (offline: none cached)
        if base_weights is not None or base_state_dict is not None:  # a base is for vca-patch checkpoints only
            raise _as_repo_id(exc, repo_id_or_dir) from None
        return _from_format_repo(str(repo_id_or_dir), revision, exc, device=device, cache_dir=cache_dir, token=token)
    return checkpoint.from_pretrained(folder, device=device, **base)


def _as_repo_id(exc: Exception, repo_id: str | Path) -> Exception:
    """`exc`, saying for a Hub error that no local folder of that name exists either (a CheckpointError as it is)."""
    if isinstance(exc, checkpoint.CheckpointError):
        return exc
    return type(exc)(f"no local folder {repo_id}, and as a Hub repo id: {exc}")


def _from_format_repo(
    repo_id: str,
    revision: str | None,
    not_vca_patch: Exception,
    *,
    device: str | torch.device,
    cache_dir: str | Path | None,
    token: str | None,
) -> nn.Module:
    """The model of a Hub repo of the first registered format whose marker file it holds; else `not_vca_patch`, why
    it is no vca-patch checkpoint, is raised."""
    try:
        for fmt in FORMATS.values():
            found = fetch_format_folder(fmt, repo_id, revision, cache_dir=cache_dir, token=token)
            if found is not None:
                return fmt.load(found, device)
    except HubUnavailableError as exc:  # online, yet a format's files could not be fetched
        raise _as_repo_id(exc, repo_id) from None
    raise _as_repo_id(not_vca_patch, repo_id) from None
