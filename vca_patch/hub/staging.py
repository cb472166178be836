"""Laying out a folder's files for one Hub commit, without copying the weights."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from vca_patch.checkpoint.folder import CARD_NAME
from vca_patch.core.atomic import atomic_write_text


def link_file(src: Path, dest: Path) -> None:
    """Put `src` at `dest` without copying when possible (the weights can be large)."""
    try:
        os.symlink(src.resolve(), dest)
    except OSError:
        shutil.copy2(src, dest)


def stage_folder(folder: Path, names: Sequence[str], stage: Path, card: str, generated: Sequence[str]) -> list[str]:
    """Link `folder`'s files `names` into `stage` and give it a model card: the folder's own README.md when it was
    edited by hand (it is none of the `generated` texts), else `card`. Returns the staged names, card included."""
    for name in names:
        if name != CARD_NAME:
            link_file(folder / name, stage / name)
    existing = folder / CARD_NAME
    text = existing.read_text(encoding="utf-8") if existing.is_file() else None
    if text is not None and text not in generated:
        link_file(existing, stage / CARD_NAME)
    else:
        atomic_write_text(stage / CARD_NAME, card)
    return sorted({*names, CARD_NAME})
