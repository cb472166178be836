"""The Hub side of a push: the token, the Hub's reachability before anything is staged, and one commit of a staged
folder with the Hub's errors turned into vca-patch's."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from vca_patch.core.hub_access import bound_hub_timeouts, network_failure
from vca_patch.hub.errors import LOGIN_HINT, HubAuthError, HubError, HubUnavailableError
from vca_patch.hub.resolve import hub_unreachable


def resolve_token(token: str | None) -> str:
    """The token to push with: `token`, else HF_TOKEN or the stored login; raise HubAuthError if none."""
    from huggingface_hub import get_token

    token = token or get_token()
    if not token:
        raise HubAuthError(f"pushing to the Hub needs a token with write access: {LOGIN_HINT}")
    return token


def upload_stage(
    stage: Path,
    repo_id: str,
    *,
    token: str,
    private: bool,
    revision: str | None,
    commit_message: str,
    delete_patterns: Sequence[str] = (),
) -> str:
    """Upload the staged folder to `repo_id` (created if needed, on branch `revision`) in one commit that also
    deletes the repo's files matching `delete_patterns`; the commit URL. Hub errors become HubError subclasses."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    bound_hub_timeouts()  # create_repo and upload_folder send no timeout of their own
    api = HfApi(token=token)
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=stage,
            revision=revision,
            commit_message=commit_message,
            delete_patterns=list(delete_patterns),
        )
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubAuthError(
                f"the Hub refused the token (HTTP {status}): it needs write access to {repo_id}; {LOGIN_HINT}"
            ) from None
        raise HubError(f"push to {repo_id} failed: {exc}") from exc
    except OfflineModeIsEnabled as exc:
        raise HubUnavailableError(f"push to {repo_id} failed: {exc}; nothing local was changed") from exc
    except httpx2.TransportError as exc:  # a connection refused or lost, a timeout
        why = network_failure(exc) or f"the Hub is unreachable ({exc})"
        raise HubUnavailableError(f"push to {repo_id} failed: {why}; nothing local was changed") from exc
    return info.commit_url


def require_hub(repo_id: str, folder: Path | None) -> None:
    """HubUnavailableError, before anything is saved or staged, when the Hub cannot be reached (offline mode too)."""
    reason = hub_unreachable()
    if reason:
        raise HubUnavailableError(
            f"cannot push to {repo_id}: the Hugging Face Hub is unreachable ({reason}); nothing was uploaded"
            + (f" and {folder} is unchanged" if folder else "")
        )
