"""Data errors."""

from __future__ import annotations


class DatasetError(ValueError):
    """A dataset path is missing, unreadable or not in the expected format."""
