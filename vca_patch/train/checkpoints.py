"""Training-state checkpoints: written atomically (temp file + rename), the last few kept."""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

_NAME = re.compile(r"^step_(\d+)\.pt$")


def checkpoint_dir(output: Path) -> Path:
    return Path(output) / "checkpoints"


def save_training_state(output: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write `state` as checkpoints/step_{step}.pt in one rename; prune older ones beyond `keep`."""
    folder = checkpoint_dir(output)
    folder.mkdir(parents=True, exist_ok=True)
    final = folder / f"step_{step:07d}.pt"
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-", suffix=".pt")
    os.close(fd)
    try:
        torch.save(state, tmp)
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for old in list_checkpoints(output)[:-keep]:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(output: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    folder = checkpoint_dir(output)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output: Path) -> Path | None:
    found = list_checkpoints(output)
    return found[-1] if found else None


def load_training_state(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
