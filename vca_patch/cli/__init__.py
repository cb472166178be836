"""The `vca-patch` command line."""

from vca_patch.cli.app import app, main

__all__ = ["app", "main"]
