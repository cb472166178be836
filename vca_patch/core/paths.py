"""The one rule every output path follows, checked before any work.

An output is never an input, never inside an input folder, never a file an input reads (compared as resolved real
paths, so a symlink to an input counts); a folder replaced as a whole never holds an input; its parent is an
existing, writable folder (missing parents are never created); and a file is not written where a folder is, nor a
folder where a file is. Writes themselves are atomic (see `vca_patch.core.atomic`)."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal

from vca_patch.core.atomic import OutputExistsError, UnsafeOutputError


class OutputPathError(UnsafeOutputError):
    """The output path cannot be written: its parent is missing, not a folder or not writable, or it names a folder
    where a file is expected (or a file where a folder is)."""


def _real(path: Path | str) -> Path:
    return Path(os.path.realpath(os.path.abspath(path)))


def check_output(
    path: Path | str,
    inputs: Mapping[str, Path | str | None] | Collection[Path | str | None] = (),
    *,
    kind: Literal["file", "folder"] = "file",
    force: bool = True,
    replaces: bool | None = None,
    writes: Collection[str] = (),
    option: str | None = None,
) -> Path:
    """Refuse `path` as an output before any work; returns it unchanged.

    `inputs`: name -> path (or just paths) of everything the command reads; absent ones (a Hub name) are skipped.
    `kind`: what is written. `force`: an existing file may be replaced (files only; a folder's own rules are the
    caller's). `replaces`: the folder is replaced as a whole, so it may not hold an input (default: True for a
    folder). `writes`: for a folder written into, the names it writes there; none of them may be an input.
    `option`: how the user named the output (e.g. "--json"), for the message."""
    raw = Path(path)
    label = f"{option} {raw}" if option else f"output {raw}"
    named = inputs.items() if isinstance(inputs, Mapping) else (("input", p) for p in inputs)
    out = _real(raw)
    if replaces is None:
        replaces = kind == "folder"
    for name, src_path in named:
        if src_path is None or not os.path.lexists(src_path):
            continue
        src = _real(src_path)
        if out == src:
            raise UnsafeOutputError(f"{label} is the {name} {src_path}: writing it would change the input; "
                                    "choose another path")  # fmt: skip
        if src in out.parents:
            raise UnsafeOutputError(f"{label} is inside the {name} {src_path}: writing it would change the input; "
                                    "choose a path outside it")  # fmt: skip
        if kind == "folder" and out in src.parents:
            first = src.relative_to(out).parts[0]
            if replaces or first in writes:
                what = "replacing the folder would delete it" if replaces else f"{first} would be overwritten"
                raise UnsafeOutputError(f"{label} holds the {name} {src_path}, which {what}; choose an output "
                                        "folder that does not contain it")  # fmt: skip
    parent = Path(os.path.abspath(raw)).parent
    if not parent.exists():
        raise OutputPathError(f"cannot write {label}: folder {parent} does not exist (create it first)")
    if not parent.is_dir():
        raise OutputPathError(f"cannot write {label}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write {label}: folder {parent} is not writable")
    if kind == "file":
        if raw.is_dir():
            raise OutputPathError(f"{label} is a folder; name a file (e.g. {raw / 'result'}{raw.suffix or ''})")
        if raw.exists() and not force:
            raise OutputExistsError(f"{label} exists; pass --force to replace it")
    elif raw.exists() and not raw.is_dir():
        raise OutputPathError(f"{label} is a file, not a folder; choose a folder")
    return raw
