"""The one exception a benchmark raises for inputs it cannot measure (the CLI prints it as one line)."""

from __future__ import annotations


class BenchError(ValueError):
    """A model, setting or resolution the benchmark cannot measure; the message says what to pass instead."""
