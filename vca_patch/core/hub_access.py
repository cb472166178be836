"""Reaching the Hugging Face Hub: whether it can be reached, and the errors that say it cannot."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Iterator
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


# The Hub timeouts vca-patch's command sets when the user has not (seconds): huggingface_hub's own are 10 and 10, and
# its shared session waits for ever on calls made without one (create_repo, upload_folder, model_info).
HUB_TIMEOUT_DEFAULTS = {"HF_HUB_ETAG_TIMEOUT": 10, "HF_HUB_DOWNLOAD_TIMEOUT": 30}
_PROBE_TTL = 60.0  # seconds an endpoint's answer to the probe (or its silence) is remembered: one wait a command
_probed: dict[str, tuple[float, str | None]] = {}  # endpoint -> (when, why it is no use or None)


def set_hub_timeout_defaults() -> None:
    """For the `vca-patch` process: HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT get `HUB_TIMEOUT_DEFAULTS` where
    the user has not set them (in the environment, for child processes, and in huggingface_hub's constants, which
    it read when imported); values the user set are kept."""
    from huggingface_hub import constants

    for name, seconds in HUB_TIMEOUT_DEFAULTS.items():
        if os.environ.get(name, "").strip():
            continue
        os.environ[name] = str(seconds)
        setattr(constants, name, seconds)


def _hub_timeouts() -> tuple[float, float]:
    """(connect, longest wait) for one Hub request: HF_HUB_ETAG_TIMEOUT, and the larger of it and
    HF_HUB_DOWNLOAD_TIMEOUT, as huggingface_hub holds them now."""
    from huggingface_hub import constants

    connect = float(constants.HF_HUB_ETAG_TIMEOUT)
    return connect, max(connect, float(constants.HF_HUB_DOWNLOAD_TIMEOUT))


def _bound_request(request: Any) -> None:
    """A request hook: a request without a timeout gets the Hub's (`_hub_timeouts`), and none waits longer than
    that (huggingface_hub retries a failed metadata request with 60 s, five times)."""
    connect, longest = _hub_timeouts()
    given = dict(request.extensions.get("timeout") or {})
    bounded = {"connect": connect, "read": longest, "write": longest, "pool": longest}
    request.extensions["timeout"] = {
        key: limit if given.get(key) is None else min(float(given[key]), limit) for key, limit in bounded.items()
    }


def bound_hub_timeouts() -> None:
    """Give huggingface_hub's shared HTTP session (`get_session`, used by it, timm and transformers) a bounded timeout
    on every request (`_bound_request`); idempotent, and a session the user built keeps its own hooks."""
    from huggingface_hub.utils import get_session

    session = get_session()
    hooks = session.event_hooks
    if _bound_request not in hooks["request"]:
        session.event_hooks = {**hooks, "request": [*hooks["request"], _bound_request]}


def hub_endpoint() -> str:
    """The Hub endpoint in use, as a user would name it: `URL (HF_ENDPOINT)` when set, else the URL."""
    from huggingface_hub import constants

    return f"{constants.ENDPOINT} (HF_ENDPOINT)" if os.environ.get("HF_ENDPOINT") else constants.ENDPOINT


def unanswered(endpoint: str, what: str) -> str:
    """The line for an endpoint that did not answer: which one, what happened (`what`), and what to do."""
    return (
        f"the Hub endpoint {endpoint} {what}; check the network and HF_ENDPOINT, or set HF_HUB_OFFLINE=1 "
        "and use a local folder"
    )


_HTTP_LIBRARIES = ("httpx2", "httpx", "httpcore2", "httpcore", "requests", "urllib3")
# class names in those libraries' hierarchies that mean the request did not get through
_NETWORK_ERRORS = {"TransportError", "ConnectionError", "Timeout", "TimeoutError", "ProtocolError", "ProxyError"}


def network_failure(exc: BaseException) -> str | None:
    """The line (`unanswered`) for a connection error or timeout of an HTTP request (httpx2, requests, or a
    library's error raised from one), naming the endpoint it was sent to; None for any other error."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names = {cls.__name__ for cls in type(current).__mro__}
        if type(current).__module__.split(".")[0] in _HTTP_LIBRARIES and names & _NETWORK_ERRORS:
            timed_out = any("Timeout" in name for name in names)
            what = "did not answer in time" if timed_out else "could not be reached"
            return unanswered(_request_origin(current) or hub_endpoint(), f"{what} ({type(current).__name__})")
        current = current.__cause__ or current.__context__
    return None


def _request_origin(exc: BaseException) -> str | None:
    """scheme://host:port of the request an HTTP error was raised for, when it says."""
    try:
        url = str(exc.request.url)  # type: ignore[attr-defined]  (httpx2 raises RuntimeError when unset)
    except (AttributeError, RuntimeError):
        return None
    parsed = urlparse(url)
    return f"{parsed.scheme}://{parsed.netloc}" if parsed.scheme and parsed.netloc else None


def hub_offline_reason(timeout: float = 3.0) -> str | None:
    """Why the Hub cannot be reached (None when it can): offline mode, no TCP connection within `timeout`, or an
    endpoint that accepts the connection and does not answer (`_silent_endpoint`). Bounds the Hub session's
    timeouts first (`bound_hub_timeouts`)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    from huggingface_hub import constants

    bound_hub_timeouts()
    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            pass
    except OSError as exc:
        return f"cannot connect to {url.hostname}:{port} ({exc.strerror or exc})"
    return _silent_endpoint(constants.ENDPOINT)


def _silent_endpoint(endpoint: str) -> str | None:
    """Why `endpoint` is no use when it does not answer one small HTTP request (HEAD /, any status is an answer)
    within HF_HUB_ETAG_TIMEOUT, else None; remembered for `_PROBE_TTL` s, so a command waits for it once. The probe
    has a connection of its own: nothing it leaves unread can reach a later request of the shared session."""
    import httpx2
    from huggingface_hub import constants

    known = _probed.get(endpoint)
    if known is not None and time.monotonic() - known[0] < _PROBE_TTL:
        return known[1]
    wait = float(constants.HF_HUB_ETAG_TIMEOUT)
    reason = None
    try:
        with httpx2.Client(timeout=wait, follow_redirects=False) as client:
            client.head(endpoint)
    except httpx2.TimeoutException as exc:
        connecting = isinstance(exc, httpx2.ConnectTimeout)
        what = "did not accept a connection" if connecting else "accepted the connection but did not answer"
        reason = unanswered(hub_endpoint(), f"{what} within {wait:g} s")
    except httpx2.HTTPError:  # refused, TLS, a proxy: not this probe's to judge (the TCP check passed)
        pass
    _probed[endpoint] = (time.monotonic(), reason)
    return reason


@contextlib.contextmanager
def hub_cache_only() -> Iterator[None]:
    """huggingface_hub in offline mode for the block (its local cache only, no request), for a library call that
    takes no `local_files_only` (timm's create_model) while the Hub is unreachable."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def is_path_like(text: str) -> bool:
    """True for a string that can only be a local path, not a model name or an 'org/name' Hub id: it starts with
    '.', '/', '~' or '\\', ends with '/', holds a backslash or more than one '/'."""
    return text.startswith((".", "/", "~", "\\")) or text.endswith("/") or "\\" in text or text.count("/") > 1


def is_hub_id(value: Any) -> bool:
    """True for an 'org/name' Hub model id (not a path: no leading '.', '/', '~', exactly one '/', no '..')."""
    return isinstance(value, str) and len(value) <= 96 and ".." not in value and bool(_HUB_ID.fullmatch(value))
