"""Reaching the Hugging Face Hub: whether it can be reached, and the errors that say it cannot."""

from __future__ import annotations

import os
import re
import socket
from typing import Any
from urllib.parse import urlparse

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class UnknownModelError(ValueError):
    """The model name is not a timm architecture."""


class HubUnavailableError(RuntimeError):
    """Weights or configs are needed from the Hugging Face Hub and it cannot be reached."""


def offline_error(what: str, reason: str) -> HubUnavailableError:
    """The loaders' error for something that must come from the Hub while it is unreachable (`reason`)."""
    return HubUnavailableError(
        f"{what} must come from the Hugging Face Hub, which is unreachable here ({reason}). "
        "Use --weights FILE for a local checkpoint, or --no-pretrained for random weights."
    )


def hub_offline_reason(timeout: float = 3.0) -> str | None:
    """Why the Hub cannot be reached (None when it can): offline mode or no TCP connection."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return None
    except OSError as exc:
        return f"cannot connect to {url.hostname}:{port} ({exc.strerror or exc})"


def is_path_like(text: str) -> bool:
    """True for a string that can only be a local path, not a model name or an 'org/name' Hub id: it starts with
    '.', '/', '~' or '\\', ends with '/', holds a backslash or more than one '/'."""
    return text.startswith((".", "/", "~", "\\")) or text.endswith("/") or "\\" in text or text.count("/") > 1


def is_hub_id(value: Any) -> bool:
    """True for an 'org/name' Hub model id (not a path: no leading '.', '/', '~', exactly one '/', no '..')."""
    return isinstance(value, str) and len(value) <= 96 and ".." not in value and bool(_HUB_ID.fullmatch(value))
