"""Where a checkpoint lives: a local folder, or a Hub repo fetched into the Hugging Face cache.

Only the files a checkpoint needs are fetched: config.json first (its format and version are checked
before any weights move), then the weights file it names, pinned to the same commit. The Hub cache is
used as huggingface_hub uses it, so a cached repo loads with HF_HUB_OFFLINE=1 or without a network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vca_patch.checkpoint.base_model import hub_offline_reason
from vca_patch.checkpoint.folder import CONFIG_NAME, CheckpointError, check_checkpoint_config, weights_name
from vca_patch.core.bounded import read_json
from vca_patch.hub.errors import LOGIN_HINT, HubAuthError, HubUnavailableError, InvalidRepoIdError, RepoNotFoundError


def validate_repo_id(repo_id: Any) -> str:
    """`repo_id` if the Hub accepts it ('name' or 'namespace/name'), checked without any network."""
    from huggingface_hub.utils import HFValidationError
    from huggingface_hub.utils import validate_repo_id as hf_validate

    try:
        hf_validate(repo_id)
    except HFValidationError as exc:
        raise InvalidRepoIdError(f"{repo_id!r} is not a valid Hub repo id: {exc} Use 'namespace/name'.") from None
    if not repo_id:
        raise InvalidRepoIdError("the repo id is empty; use 'namespace/name'")
    return repo_id


def hub_unreachable() -> str | None:
    """Why the Hub cannot be used now (offline mode or no connection), or None."""
    from huggingface_hub import constants

    if constants.is_offline_mode():
        return "HF_HUB_OFFLINE is set"
    return hub_offline_reason()


def is_local(ref: str | Path) -> bool:
    """True when `ref` is a local path rather than a repo id: a Path, an existing path, or path-shaped.

    'org/name' that does not exist locally is a repo id; '/abs', './rel', '~/x' and 'a/b/c' are paths.
    """
    text = str(ref)
    return (
        isinstance(ref, Path)
        or Path(text).expanduser().exists()
        or text.startswith((".", "~", "/", "\\"))
        or text.count("/") > 1
        or "\\" in text
    )


def download_file(
    repo_id: str,
    filename: str,
    revision: str | None,
    *,
    cache_dir: str | Path | None,
    token: str | None,
    reason: str | None,
) -> Path:
    """`filename` of Hub repo `repo_id` at `revision`, downloaded or from the local cache (only the cache when
    `reason`, why the Hub is unreachable, is given); a HubError subclass or CheckpointError says why not."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}@{revision}" if revision else repo_id
    try:
        path = hf_hub_download(
            repo_id,
            filename,
            revision=revision,
            cache_dir=cache_dir,
            token=token,
            local_files_only=reason is not None,
            etag_timeout=5,
        )
    except LocalEntryNotFoundError:
        if reason is None:
            raise HubUnavailableError(f"could not fetch {filename} of {where} from the Hugging Face Hub") from None
        raise HubUnavailableError(
            f"{where} ({filename}) is not in the local Hugging Face cache and the Hub is unreachable ({reason}); "
            "run once online to cache it, or load a local folder"
        ) from None
    except GatedRepoError:
        raise HubAuthError(f"{repo_id} is gated: accept its terms on the Hub and {LOGIN_HINT}") from None
    except RevisionNotFoundError:
        raise RepoNotFoundError(f"{repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise RepoNotFoundError(f"{repo_id} does not exist on the Hub, or it is private (then {LOGIN_HINT})") from None
    except EntryNotFoundError:
        raise CheckpointError(f"{where} is not a vca-patch checkpoint: missing {filename}") from None
    except HfHubHTTPError as exc:
        if exc.response is not None and exc.response.status_code in (401, 403):
            raise HubAuthError(f"the Hub refused access to {repo_id}: {LOGIN_HINT}") from None
        raise
    return Path(path)


def fetch_checkpoint(
    repo_id: str,
    revision: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    token: str | None = None,
    config_only: bool = False,
) -> tuple[Path, dict[str, Any]]:
    """(snapshot folder, config) of a Hub checkpoint, fetched into (or found in) the Hub cache."""
    repo_id = validate_repo_id(repo_id)
    reason = hub_unreachable()
    config_path = download_file(repo_id, CONFIG_NAME, revision, cache_dir=cache_dir, token=token, reason=reason)
    where = f"{repo_id}@{revision}" if revision else repo_id
    meta = read_json(config_path, f"{CONFIG_NAME} of {where}", error=CheckpointError)  # bounded: size, nesting
    check_checkpoint_config(meta, f"{CONFIG_NAME} of {where}")
    folder = config_path.parent  # <cache>/models--org--name/snapshots/<commit>/
    if not config_only:
        download_file(repo_id, weights_name(meta), folder.name, cache_dir=cache_dir, token=token, reason=reason)
    return folder, meta
