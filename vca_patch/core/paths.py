"""The one rule every output path follows, checked before any work.

An output is never an input, never inside an input folder, never a file an input reads (compared as resolved real
paths, so a symlink to an input counts); a folder replaced as a whole never holds an input; its parent is an
existing, writable folder (missing parents are never created); a file is not written where a folder is, nor a
folder where a file is; a file output is never a symlink or a device, FIFO or socket (a write would replace the
node), and an existing file is replaced only with `force` (a command's --force). A folder replaced as a whole
follows `check_output_dir` too (never a link, the home or current folder, a Hub cache, nor anything but a vca-patch
output). Writes themselves are atomic (see `vca_patch.core.atomic`)."""

from __future__ import annotations

import os
from collections.abc import Collection, Iterator, Mapping
from pathlib import Path
from typing import Literal

from vca_patch.core.atomic import OutputExistsError, UnsafeOutputError, file_kind, physical, real_path


class OutputPathError(UnsafeOutputError):
    """The output path cannot be written: its parent is missing, not a folder or not writable, or it names a folder
    where a file is expected (or a file where a folder is)."""


_LINK_SCAN = 2000  # entries of an input folder looked at for links (two levels deep): bounded for data folders


def _links_inside(folder: Path) -> Iterator[Path]:
    """The symlinks in `folder` and its sub-folders (two levels, the first `_LINK_SCAN` entries): a Hub snapshot's
    files are links to the cache's blobs, and what they point to is what the input reads."""
    seen = 0
    level = [folder]
    for _ in range(2):
        below = []
        for parent in level:
            try:
                entries = list(os.scandir(parent))
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > _LINK_SCAN:
                    return
                if entry.is_symlink():
                    yield Path(entry.path)
                elif entry.is_dir(follow_symlinks=False):
                    below.append(Path(entry.path))
        level = below


def _resolved_inputs(
    inputs: Mapping[str, Path | str | None] | Collection[Path | str | None],
) -> Iterator[tuple[str, Path]]:
    """(how to name it, resolved real path) of each existing input, and of each link inside an input folder (an
    output onto a link's target changes the input as surely as one onto the input itself)."""
    named = inputs.items() if isinstance(inputs, Mapping) else (("input", p) for p in inputs)
    for name, src_path in named:
        if src_path is None or not os.path.lexists(src_path):
            continue
        yield f"{name} {src_path}", real_path(src_path)
        if os.path.isdir(src_path):
            for link in _links_inside(Path(src_path)):
                yield f"{name}'s {link.relative_to(src_path)} (a link to {real_path(link)})", real_path(link)


def _check_not_an_input(label: str, out: Path, inputs: Iterator[tuple[str, Path]], *, folder: bool,
                        replaces: bool, writes: Collection[str]) -> None:  # fmt: skip
    """Refuse an output (resolved: `out`) that is an input, inside one, or (a folder) holds one it would change."""
    for what, src in inputs:
        if out == src:
            raise UnsafeOutputError(f"{label} is the {what}: writing it would change the input; choose another path")
        if src in out.parents:
            raise UnsafeOutputError(f"{label} is inside the {what}: writing it would change the input; "
                                    "choose a path outside it")  # fmt: skip
        if folder and out in src.parents:
            first = src.relative_to(out).parts[0]
            if replaces or first in writes:
                verb = "replacing the folder would delete it" if replaces else f"{first} would be overwritten"
                raise UnsafeOutputError(f"{label} holds the {what}, which {verb}; choose an output "
                                        "folder that does not contain it")  # fmt: skip


def _first_missing(folder: Path) -> Path | None:
    """The first component of `folder` (as given, "..", links and all) that the file system cannot find."""
    walked = Path()
    for part in folder.parts:
        walked = walked / part
        if not os.path.exists(walked):
            return walked
    return None


def _check_parent(label: str, raw: Path) -> None:
    """The output's folder exists, is a folder and is writable (missing parents are never made). The path is
    resolved as the file system resolves it: "nosuch/../out" needs nosuch, and "link/../out" is beside the link's
    target."""
    missing = _first_missing(raw.parent)
    if missing is not None:  # through "..": the component that stops the walk; else the whole folder
        shown = missing if ".." in raw.parent.parts else Path(os.path.abspath(raw)).parent
        raise OutputPathError(f"cannot write {label}: folder {shown} does not exist (create it first)")
    parent = physical(raw).parent
    if not parent.is_dir():
        raise OutputPathError(f"cannot write {label}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"cannot write {label}: folder {parent} is not writable")


def _check_file(label: str, raw: Path, *, force: bool) -> None:
    """A file output: never a link (not followed, not replaced), a folder or a device, FIFO or socket (a file is
    written beside and renamed over it, which would replace the node); an existing file only with `force`."""
    kind = file_kind(raw)
    if kind == "a symbolic link":
        raise UnsafeOutputError(f"{label} is a symbolic link to {os.path.realpath(raw)}; vca-patch never writes "
                                "through a link or replaces one: name the file itself or a new path")  # fmt: skip
    if kind == "a folder":
        raise OutputPathError(f"{label} is a folder; name a file (e.g. {raw / 'result'}{raw.suffix or ''})")
    if kind not in (None, "a file"):
        raise UnsafeOutputError(f"{label} is {kind}, not a regular file; writing would replace it with a file: "
                                "name a regular file")  # fmt: skip
    if kind == "a file" and not force:
        raise OutputExistsError(f"{label} exists; pass --force to replace it")


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

    `inputs`: name -> path (or just paths) of everything the command reads; absent ones (a Hub name) are skipped,
    the rest compared resolved (symlinks, "..", and the targets of links inside an input folder: a Hub snapshot's
    blobs). `kind`: what is written. `force`: an existing regular file may be replaced (files only; a folder's own
    rules are `check_output_dir`'s). `replaces`: the folder is replaced as a whole, so it may not hold an input
    (default: True for a folder). `writes`: for a folder written into, the names it writes there; none of them
    may be an input. `option`: how the user named the output (e.g. "--json"), for the message."""
    raw = Path(path)
    label = f"{option} {raw}" if option else f"output {raw}"
    if replaces is None:
        replaces = kind == "folder"
    _check_not_an_input(label, real_path(raw), _resolved_inputs(inputs), folder=kind == "folder", replaces=replaces,
                        writes=writes)  # fmt: skip
    _check_parent(label, raw)
    if kind == "file":
        _check_file(label, raw, force=force)
    elif raw.exists() and not raw.is_dir():
        raise OutputPathError(f"{label} is {file_kind(raw)}, not a folder; choose a folder")
    return raw
