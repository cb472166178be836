"""The Hub layer, on top of io/: push checkpoints, load them by repo id, and the timm integration."""

from vca_patch.hub import timm_entrypoint
from vca_patch.hub.errors import HubAuthError, HubError, HubUnavailableError, InvalidRepoIdError, RepoNotFoundError
from vca_patch.hub.load import from_pretrained
from vca_patch.hub.push import push_to_hub
from vca_patch.hub.resolve import fetch_checkpoint, validate_repo_id

timm_entrypoint.register()

__all__ = [
    "HubAuthError",
    "HubError",
    "HubUnavailableError",
    "InvalidRepoIdError",
    "RepoNotFoundError",
    "fetch_checkpoint",
    "from_pretrained",
    "push_to_hub",
    "validate_repo_id",
]
