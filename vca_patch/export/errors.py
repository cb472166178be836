"""The errors of an export: one line each, raised before anything is written."""

from __future__ import annotations

from vca_patch.core.errors import ConfigError


class ExportError(ConfigError):
    """The model cannot be exported as asked (format, dynamic sizes, a custom op left in the graph)."""


class FixedSizeError(ExportError):
    """A dynamic image size was asked of a model built for one image size."""
