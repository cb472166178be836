"""Plan files: the chosen plan as a `MergeConfig` (what `patch_model` applies) plus what the planner measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vca_patch.core.atomic import atomic_write_text
from vca_patch.core.errors import ConfigError
from vca_patch.planner.model_info import PlanError
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.merge import MergeConfig

FORMAT = "vca-patch-plan"
VERSION = 1


def save_plan(path: str | Path, config: MergeConfig, details: dict[str, Any]) -> Path:
    """Write the plan atomically (a file that exists is whole); `details` is JSON-safe."""
    path = Path(path)
    if not path.parent.is_dir():
        raise PlanError(f"cannot write the plan to {path}: folder {path.parent} does not exist")
    text = json.dumps({"format": FORMAT, "version": VERSION, "config": config.to_dict(), **details}, indent=2)
    atomic_write_text(path, text + "\n")
    return path


def read_plan(path: str | Path) -> dict[str, Any]:
    """The whole plan file, checked to be one."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PlanError(f"plan file {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PlanError(f"{path} is not a readable plan file: {error}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or "config" not in data:
        raise PlanError(f"{path} is not a vca-patch plan (no \"format\": \"{FORMAT}\" with a config); make one with "
                        "`vca-patch plan`")  # fmt: skip
    if data.get("version") != VERSION:
        raise PlanError(f"{path} is plan format version {data.get('version')!r}; this vca-patch reads {VERSION}")
    return data


def load_plan(path: str | Path) -> MergeConfig:
    """The plan's config, for `patch_model(model, load_plan(path))`; it refuses a model the plan was not made for."""
    data = read_plan(path)
    try:
        config = TargetConfig.from_dict(data["config"])
    except (ConfigError, TypeError) as error:
        raise PlanError(f"{path}: invalid plan config: {error}") from None
    if not isinstance(config, MergeConfig):
        raise PlanError(f"{path}: a plan's config is a merge config (target 'merge'), got target {config.target!r}")
    return config
