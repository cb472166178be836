"""Atomic file and folder writes: readers see the old content or the new, never half of it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputExistsError(FileExistsError):
    """The output folder exists and is not empty, and overwriting was not asked for."""


def check_output_dir(path: Path, *, overwrite: bool) -> None:
    """Refuse a non-empty existing folder (or a file) unless `overwrite`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"{path} exists and is not a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputExistsError(f"{path} is not empty; choose another folder or pass --force (overwrite=True)")


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def staged_directory(dest: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder; on success it replaces `dest` in one rename.

    On any error the temporary folder is removed and `dest` is left as it was.
    """
    dest = Path(dest)
    check_output_dir(dest, overwrite=overwrite)
    dest.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{dest.name}.staging-", dir=dest.parent))
    try:
        yield stage
        if dest.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, trash / dest.name)
            os.replace(stage, dest)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(stage, dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
