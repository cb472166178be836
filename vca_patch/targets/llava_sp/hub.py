"""LLaVA-SP folders on the Hugging Face Hub: push one (checked to load first) and fetch one for loading.

`vca_patch.push_to_hub` and `vca_patch.from_pretrained` hand LLaVA-SP models and folders (those with a
spatial_tokens.json) to these functions; the upload and the error handling are the Hub layer's own.
"""

from __future__ import annotations

import fnmatch
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.targets.llava_sp.card import render_card
from vca_patch.targets.llava_sp.io import (
    CONFIG_FILE,
    load_spatial_tokens,
    read_spatial_tokens_config,
    save_spatial_tokens,
)
from vca_patch.targets.llava_sp.model import SpatialTokensError, get_spatial_projector

# What a LLaVA-SP folder holds (save_pretrained's model, spatial tokens, processor and tokenizer files, card):
# pushed, and fetched. Never pickles.
FOLDER_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.jinja", "*.model", "README.md")


def is_spatial_folder(path: str | Path) -> bool:
    """A folder written by save_spatial_tokens (it has spatial_tokens.json)."""
    return (Path(path).expanduser() / CONFIG_FILE).is_file()


def has_spatial_tokens(model: nn.Module) -> bool:
    """True for a LLaVA model with spatial tokens; False for anything else (never raises)."""
    try:
        return get_spatial_projector(model) is not None
    except SpatialTokensError:
        return False


def folder_files(folder: Path) -> list[str]:
    """The folder's top-level files that belong to the model (FOLDER_PATTERNS), sorted."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and any(fnmatch.fnmatch(p.name, pat) for pat in FOLDER_PATTERNS)
    )


def check_spatial_folder_loads(folder: Path) -> dict[str, Any]:
    """spatial_tokens.json of `folder`, after loading the folder as users will; CheckpointError otherwise."""
    from safetensors import SafetensorError

    from vca_patch.checkpoint.folder import CheckpointError

    try:
        meta = read_spatial_tokens_config(folder)
        load_spatial_tokens(folder)
    except (SpatialTokensError, SafetensorError, OSError, ValueError, RuntimeError, KeyError) as exc:
        raise CheckpointError(f"{folder} does not load, so nothing was pushed: {exc}") from None
    return meta


def _stage(folder: Path, meta: dict[str, Any], repo_id: str, stage: Path) -> list[str]:
    """Link the folder's files into `stage`; a generated card is regenerated for `repo_id`, an edited one kept."""
    from vca_patch.hub.staging import stage_folder

    generated = (render_card(meta), render_card(meta, repo_id))
    return stage_folder(folder, folder_files(folder), stage, render_card(meta, repo_id), generated)


def push_spatial_tokens(
    model_or_dir: nn.Module | str | Path,
    repo_id: str,
    *,
    private: bool,
    token: str | None,
    revision: str | None,
    commit_message: str | None,
    metadata: dict[str, Any] | None = None,
    vca_only: dict[str, bool] | None = None,
) -> str:
    """Push a LLaVA-SP model (saved first, without a processor) or folder (loaded first) in one commit.

    `vca_only` names push_to_hub's options that were given but apply to VCA checkpoints only (refused)."""
    given = [name for name, used in (vca_only or {}).items() if used]
    if given:
        raise ValueError(f"{', '.join(given)}: for vca-patch checkpoints, not LLaVA-SP models; drop them")
    from vca_patch.hub.push import require_hub, resolve_token, upload_stage

    folder = None if isinstance(model_or_dir, nn.Module) else Path(model_or_dir).expanduser()
    meta = check_spatial_folder_loads(folder) if folder is not None else None
    token = resolve_token(token)
    require_hub(repo_id, folder)
    with tempfile.TemporaryDirectory(prefix="vca-patch-push-") as tmp:
        if folder is None:
            folder = save_spatial_tokens(model_or_dir, Path(tmp) / "checkpoint", metadata=metadata)
            meta = read_spatial_tokens_config(folder)
        stage = Path(tmp) / "upload"
        stage.mkdir()
        _stage(folder, meta, repo_id, stage)
        config = meta["config"]
        message = commit_message or (
            f"Upload LLaVA-SP ({config['variant']}, {config['num_tokens']} spatial tokens, "
            f"+{meta['parameters']:,} parameters)"
        )
        return upload_stage(stage, repo_id, token=token, private=private, revision=revision, commit_message=message)


def fetch_spatial_folder(
    repo_id: str, revision: str | None, *, cache_dir: str | Path | None, token: str | None
) -> Path | None:
    """The cached snapshot folder of a LLaVA-SP Hub repo (fetched if needed, pinned to one commit), or None when
    the repo has no spatial_tokens.json."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from vca_patch.checkpoint.folder import CheckpointError
    from vca_patch.hub.errors import HubUnavailableError
    from vca_patch.hub.resolve import download_file, hub_unreachable

    reason = hub_unreachable()
    try:
        config = download_file(repo_id, CONFIG_FILE, revision, cache_dir=cache_dir, token=token, reason=reason)
    except CheckpointError:  # no spatial_tokens.json in the repo
        return None
    folder = config.parent  # <cache>/models--org--name/snapshots/<commit>/
    read_spatial_tokens_config(folder)  # format and version, before the weights move
    try:
        snapshot_download(
            repo_id,
            revision=folder.name,
            cache_dir=cache_dir,
            token=token,
            allow_patterns=list(FOLDER_PATTERNS),
            local_files_only=reason is not None,
        )
    except LocalEntryNotFoundError:
        raise HubUnavailableError(
            f"{repo_id} is only partly in the local Hugging Face cache and the Hub is unreachable ({reason}); "
            "run once online to cache it"
        ) from None
    return folder


def load_spatial_folder(folder: Path, device: str | torch.device = "cpu") -> nn.Module:
    """A LLaVA-SP folder as `from_pretrained` returns models: on `device`, in eval mode."""
    return load_spatial_tokens(folder).to(device).eval()
