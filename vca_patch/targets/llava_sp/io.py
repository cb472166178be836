"""The files of a saved LLaVA-SP folder and the check of its spatial_tokens.json.

Writing and loading the folder (`save_spatial_tokens`, `load_spatial_tokens`) re-applies a patch of the vision
tower, so it lives above surgery, in `vca_patch.formats.llava_sp`; what `vca-patch inspect` reads of a saved folder
(`plan.py`) needs only this.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vca_patch.targets.llava_sp.config import SpatialTokensConfig
from vca_patch.targets.llava_sp.model import SpatialTokensError

CONFIG_FILE = "spatial_tokens.json"
WEIGHTS_FILE = "spatial_tokens.safetensors"
VISION_PATCH_FILE = "vision_patch.safetensors"  # a VCA/MANO patch of the vision tower: its layers' own tensors
FORMAT_VERSION = 1


def read_spatial_tokens_config(path: str | Path) -> dict[str, Any]:
    """The spatial_tokens.json of a saved folder, checked."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise SpatialTokensError(f"{path} is not a LLaVA-SP folder: no {CONFIG_FILE} (save_spatial_tokens writes it)")
    meta = json.loads(file.read_text(encoding="utf-8"))
    if meta.get("format") != SpatialTokensConfig.format or meta.get("version") != FORMAT_VERSION:
        raise SpatialTokensError(
            f"{file}: format {meta.get('format')!r} version {meta.get('version')!r}, expected "
            f"{SpatialTokensConfig.format!r} version {FORMAT_VERSION}"
        )
    return meta
