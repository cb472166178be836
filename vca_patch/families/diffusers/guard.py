"""The diffusers family's config guard: a checkpoint's base description may name only a supported model class,
plain folder and revision names and plain constructor options (no code, files or URLs)."""

from __future__ import annotations

import re
from typing import Any

from vca_patch.core.errors import UnsafeConfigError

ARCHITECTURES = ("DiTTransformer2DModel", "PixArtTransformer2DModel", "SD3Transformer2DModel", "FluxTransformer2DModel")
_CONFIG_KEY = re.compile(r"[a-z][a-z0-9_]*")
_SUBFOLDER = re.compile(r"[A-Za-z0-9][\w.-]*")  # one folder level: "transformer"
_REVISION = re.compile(r"[A-Za-z0-9][\w.-]{0,254}")


def check_diffusers_base(base: dict[str, Any], where: str) -> None:
    """Refuse a diffusers base description that names anything but a supported model class and plain options
    (the diffusers library's `check_base`, families/diffusers/library.py)."""

    architecture = base.get("architecture")
    if architecture not in ARCHITECTURES:
        raise UnsafeConfigError(
            f"{where}: base.architecture = {architecture!r} is not allowed: expected one of {', '.join(ARCHITECTURES)}"
        )
    for key, pattern in (("subfolder", _SUBFOLDER), ("revision", _REVISION)):
        value = base.get(key)
        if value is not None and (not isinstance(value, str) or not pattern.fullmatch(value) or ".." in value):
            raise UnsafeConfigError(
                f"{where}: base.{key} = {value!r:.80} is not allowed: expected null or a plain name"
            )
    config = base.get("config")
    if not isinstance(config, dict):
        raise UnsafeConfigError(f"{where}: base.config must be an object of {architecture} constructor options")
    scalar = (bool, int, float, str, type(None))
    for key, value in config.items():
        plain = isinstance(value, scalar) or (isinstance(value, list) and all(isinstance(v, scalar) for v in value))
        if not isinstance(key, str) or not _CONFIG_KEY.fullmatch(key) or not plain:
            raise UnsafeConfigError(
                f"{where}: base.config.{key} = {value!r:.80} is not allowed: expected plain constructor options"
            )
        if re.search(r"(?:^|_)(?:path|file|url|dir|directory)$", key) and value not in (None, ""):
            raise UnsafeConfigError(f"{where}: base.config.{key} names a file or URL; not allowed")
