"""Helpers shared by the config.json guards (checkpoint.config_guard and each family's own checks)."""

from __future__ import annotations

import re
from typing import Any

from vca_patch.core.errors import UnsafeConfigError

# Option names that name files, folders or URLs.
PATH_KEY = re.compile(r"(?:^|_)(?:path|paths|file|files|filename|url|urls|uri|dir|directory)$")


def unsafe(where: str, field: str, value: Any, why: str) -> UnsafeConfigError:
    """The guard's error: `where: field = value is not allowed: why` (long values shortened)."""
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return UnsafeConfigError(f"{where}: {field} = {shown} is not allowed: {why}")


def is_plain(value: Any) -> bool:
    """A JSON scalar, or a list/tuple of them."""
    scalar = (bool, int, float, str, type(None))
    return isinstance(value, scalar) or (isinstance(value, (list, tuple)) and all(isinstance(v, scalar) for v in value))
