"""Pushing and fetching folders of a registered checkpoint format (`core.formats`, e.g. LLaVA-SP's): the format says
which files, how to check and load them and what the card says; the upload, the cache and the errors are the Hub
layer's own, as for vca-patch folders."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from vca_patch.checkpoint.folder import CheckpointError
from vca_patch.core.formats import CheckpointFormat
from vca_patch.hub.errors import HubUnavailableError
from vca_patch.hub.resolve import download_file, hub_unreachable
from vca_patch.hub.staging import stage_folder
from vca_patch.hub.upload import require_hub, resolve_token, upload_stage


def checked_format_folder(fmt: CheckpointFormat, folder: Path) -> dict[str, Any]:
    """`folder`'s metadata after loading it as users will; CheckpointError (nothing pushed) otherwise."""
    try:
        meta = fmt.read(folder)
        fmt.load(folder, "cpu")
    except Exception as exc:  # the format's own loaders (transformers, safetensors) raise their own kinds
        raise CheckpointError(f"{folder} does not load, so nothing was pushed: {exc}") from None
    return meta


def push_format(
    fmt: CheckpointFormat,
    model_or_dir: Any,
    repo_id: str,
    *,
    private: bool,
    token: str | None,
    revision: str | None,
    commit_message: str | None,
    metadata: dict[str, Any] | None = None,
    given: dict[str, bool] | None = None,
) -> str:
    """Push a model of format `fmt` (saved first) or a folder of it (loaded first) in one commit.

    `given` names the push options that were passed; those the format marks vca-patch-only are refused."""
    refused = [name for name in fmt.push_options if (given or {}).get(name)]
    if refused:
        raise ValueError(f"{', '.join(refused)}: for vca-patch checkpoints, not {fmt.name} models; drop them")
    folder = None if fmt.owns(model_or_dir) else Path(model_or_dir).expanduser()
    meta = checked_format_folder(fmt, folder) if folder is not None else None
    token = resolve_token(token)
    require_hub(repo_id, folder)
    with tempfile.TemporaryDirectory(prefix="vca-patch-push-") as tmp:
        if folder is None:
            folder = fmt.save(model_or_dir, Path(tmp) / "checkpoint", metadata)
            meta = fmt.read(folder)
        stage = Path(tmp) / "upload"
        stage.mkdir()
        generated = (fmt.card(meta, None), fmt.card(meta, repo_id))
        stage_folder(folder, fmt.files(folder), stage, fmt.card(meta, repo_id), generated)
        message = commit_message or fmt.commit_message(meta)
        return upload_stage(stage, repo_id, token=token, private=private, revision=revision, commit_message=message)


def fetch_format_folder(
    fmt: CheckpointFormat, repo_id: str, revision: str | None, *, cache_dir: str | Path | None, token: str | None
) -> Path | None:
    """The cached snapshot folder of a Hub repo of format `fmt` (fetched if needed, pinned to one commit), or None
    when the repo has no `fmt.marker` file (offline: when the cache holds none)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    reason = hub_unreachable()
    try:
        marker = download_file(repo_id, fmt.marker, revision, cache_dir=cache_dir, token=token, reason=reason)
    except CheckpointError:  # the repo has no marker file: not this format
        return None
    except HubUnavailableError:
        if reason is None:  # online, and the fetch failed: say so
            raise
        return None  # offline, and no marker of this format in the cache
    folder = marker.parent  # <cache>/models--org--name/snapshots/<commit>/
    fmt.read(folder)  # format and version, before the weights move
    try:
        snapshot_download(
            repo_id,
            revision=folder.name,
            cache_dir=cache_dir,
            token=token,
            allow_patterns=list(fmt.patterns),
            local_files_only=reason is not None,
        )
    except LocalEntryNotFoundError:
        raise HubUnavailableError(
            f"{repo_id} is only partly in the local Hugging Face cache and the Hub is unreachable ({reason}); "
            "run once online to cache it"
        ) from None
    return folder
