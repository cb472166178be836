"""Checkpoint formats other than vca-patch's own folder (config.json + model.safetensors), registered by the package
that writes them (a target's, or `vca_patch.formats` for one that composes a target with surgery or a base model):
`hub/` recognises, loads, pushes and fetches such folders through this registry and names no target. LLaVA-SP's
folders (a transformers LLaVA plus spatial_tokens.json) are one."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vca_patch.core.registry import Registry


@dataclass(frozen=True)
class CheckpointFormat:
    """How one kind of saved folder is recognised, written, checked, loaded and described.

    Fields:
        name: shown in messages, e.g. "LLaVA-SP".
        marker: the file whose presence marks a folder of this format (also fetched first from the Hub).
        patterns: glob patterns of the files that belong to the model (pushed, and fetched); never pickles.
        owns: whether a model in memory is saved in this format (never raises).
        save: (model, folder, metadata) -> the folder written.
        read: folder -> its metadata (format and version checked); raises when the folder is not readable.
        load: (folder, device) -> the model, in eval mode on `device`.
        card: (metadata, repo id or None) -> the model card's text.
        commit_message: metadata -> the default commit message of a push.
        push_options: the `push_to_hub` options that apply to vca-patch folders only (refused when given).
    """

    name: str
    marker: str
    patterns: tuple[str, ...]
    owns: Callable[[Any], bool]
    save: Callable[[Any, Path, dict[str, Any] | None], Path]
    read: Callable[[Path], dict[str, Any]]
    load: Callable[[Path, Any], Any]
    card: Callable[[dict[str, Any], str | None], str]
    commit_message: Callable[[dict[str, Any]], str]
    push_options: tuple[str, ...] = ()

    def recognises(self, folder: str | Path) -> bool:
        """A local folder of this format (it holds the marker file)."""
        return (Path(folder).expanduser() / self.marker).is_file()

    def files(self, folder: Path) -> list[str]:
        """The folder's top-level files that belong to the model (`patterns`), sorted; hidden files never."""
        return sorted(
            p.name
            for p in folder.iterdir()
            if p.is_file() and not p.name.startswith(".") and any(fnmatch.fnmatch(p.name, pat) for pat in self.patterns)
        )


FORMATS: Registry[CheckpointFormat] = Registry("checkpoint format")


def register_format(fmt: CheckpointFormat) -> CheckpointFormat:
    """Register `fmt` by name and return it; a name another format holds is refused (`unregister_format` it first),
    the same format again is a no-op."""
    return FORMATS.register(fmt.name, fmt)


def unregister_format(name: str) -> CheckpointFormat:
    """Remove the format `name`; the format."""
    return FORMATS.unregister(name)


def format_of_folder(folder: str | Path) -> CheckpointFormat | None:
    """The registered format whose marker `folder` holds, or None (a vca-patch folder, or not a checkpoint)."""
    return next((fmt for fmt in FORMATS.values() if fmt.recognises(folder)), None)


def format_of_model(model: Any) -> CheckpointFormat | None:
    """The registered format that saves `model`, or None (a model vca-patch's own folder holds)."""
    return next((fmt for fmt in FORMATS.values() if fmt.owns(model)), None)
