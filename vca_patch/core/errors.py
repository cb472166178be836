"""Errors every layer of vca-patch raises, defined below all of them."""


class ConfigError(ValueError):
    """A configuration value or key is invalid."""


class PatchError(ValueError):
    """The model cannot be patched as asked; nothing was changed."""


class NothingToPatchError(PatchError):
    """The model has no attention module that can be converted; nothing was changed.

    `skipped` lists every candidate the adapter found, each with why it was skipped (empty when no adapter knows the
    model, e.g. a CNN): raised rather than returning an empty report, so that a model that was not converted is never
    mistaken for one that was.
    """

    def __init__(self, message: str, skipped: list | None = None) -> None:
        super().__init__(message)
        self.skipped = list(skipped or [])


class UnsafeConfigError(ValueError):
    """A checkpoint's config.json asks for something a checkpoint may not: code, files, attributes."""
