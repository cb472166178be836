"""Errors every layer of vca-patch raises, defined below all of them."""


class ConfigError(ValueError):
    """A configuration value or key is invalid."""


class PatchError(ValueError):
    """The model cannot be patched as asked; nothing was changed."""


class NothingToPatchError(PatchError):
    """The model has no attention module that can be converted."""


class UnsafeConfigError(ValueError):
    """A checkpoint's config.json asks for something a checkpoint may not: code, files, attributes."""
