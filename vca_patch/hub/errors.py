"""Errors of the Hub layer, each with the fix in its message."""

from __future__ import annotations

from vca_patch.checkpoint.base_model import HubUnavailableError

LOGIN_HINT = "log in with `hf auth login` (formerly `huggingface-cli login`) or set the HF_TOKEN environment variable"


class HubError(RuntimeError):
    """A Hub operation failed."""


class InvalidRepoIdError(HubError, ValueError):
    """The repo id is not of the form `namespace/name` the Hub accepts."""


class HubAuthError(HubError):
    """No token, or the token may not do this."""


class RepoNotFoundError(HubError):
    """The repository or revision does not exist (or is private and the token cannot see it)."""


__all__ = [
    "LOGIN_HINT",
    "HubAuthError",
    "HubError",
    "HubUnavailableError",
    "InvalidRepoIdError",
    "RepoNotFoundError",
]
