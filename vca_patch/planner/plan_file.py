"""Plan files: the chosen plan as the plan space's config (token merging's: what `patch_model` applies) plus what
the planner measured."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vca_patch.core.atomic import atomic_write_text
from vca_patch.core.bounded import read_json
from vca_patch.core.errors import ConfigError
from vca_patch.planner.model_info import PlanError
from vca_patch.targets.base import TargetConfig, plan_space

FORMAT = "vca-patch-plan"
VERSION = 1


def save_plan(path: str | Path, config: TargetConfig, details: dict[str, Any]) -> Path:
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
    data = read_json(path, "plan file", error=PlanError)  # a regular file, bounded in size and nesting
    if not isinstance(data, dict) or data.get("format") != FORMAT or "config" not in data:
        raise PlanError(f"{path} is not a vca-patch plan (no \"format\": \"{FORMAT}\" with a config); make one with "
                        "`vca-patch plan`")  # fmt: skip
    if data.get("version") != VERSION:
        raise PlanError(f"{path} is plan format version {data.get('version')!r}; this vca-patch reads {VERSION}")
    return data


def load_plan(path: str | Path) -> TargetConfig:
    """The plan's config, for `patch_model(model, load_plan(path))`; it refuses a model the plan was not made for."""
    data = read_plan(path)
    try:
        config = TargetConfig.from_dict(data["config"])
    except (ConfigError, TypeError) as error:
        raise PlanError(f"{path}: invalid plan config: {error}") from None
    space = plan_space()
    if not isinstance(config, space.config_type):
        wanted = f"a {space.target} config (target {space.target!r})"
        raise PlanError(f"{path}: a plan's config is {wanted}, got target {config.target!r}")
    _check_recorded_sizes(config, data.get("model"), path)
    return config


def plan_sizes(config: TargetConfig, depth: int | None = None) -> tuple[int, int]:
    """(tokens the plan merges in all, its largest VCA contrast-token count n) (0 where none): the plan space's
    `plan_sizes`; `r` counts once per block of a `depth`-block model when no schedule is given."""
    return plan_space().plan_sizes(config, depth)


def _check_recorded_sizes(config: TargetConfig, model: Any, path: str | Path) -> None:
    """A plan's own numbers against the grid it records: no more tokens merged or contrast tokens pooled than
    the patches it was made for (an old plan without the record is checked against the model when applied)."""
    if not isinstance(model, dict):
        return
    patches, depth = model.get("patch_tokens"), model.get("depth")
    if not isinstance(patches, int) or isinstance(patches, bool):
        return
    merged, n = plan_sizes(config, depth if isinstance(depth, int) else None)
    where = f"{path} (made for {model.get('resolution', '?')} px, {patches} patch tokens)"
    if merged >= patches:
        raise PlanError(f"{where}: it merges {merged} tokens in all, more than the {patches - 1} that can merge; "
                        "make the plan again with `vca-patch plan`")  # fmt: skip
    if n > patches:
        raise PlanError(f"{where}: a VCA block pools {n} contrast tokens, more than its {patches} patches; make the "
                        "plan again with `vca-patch plan`")  # fmt: skip


def check_plan_fits(
    path: str | Path, config: TargetConfig, resolution: tuple[int, int], grid: tuple[int, int]
) -> str | None:
    """Refuse a plan applied at another resolution than it was made for, or that merges more tokens (or pools
    more contrast tokens) than the model's `grid` of patches has; a plan that does not record its resolution
    (older plan files) is applied with the warning returned (None when it does)."""
    model = read_plan(path).get("model")
    recorded = model.get("resolution") if isinstance(model, dict) else None
    height, width = resolution
    patches = grid[0] * grid[1]
    depth = model.get("depth") if isinstance(model, dict) else None
    if recorded is not None and (recorded, recorded) != (height, width):
        raise PlanError(f"{path} was made for {recorded} px, but the model takes {height}×{width} px; pass "
                        f"--img-size {recorded}, or make the plan at {height} px (vca-patch plan --resolution "
                        f"{height})")  # fmt: skip
    merged, n = plan_sizes(config, depth if isinstance(depth, int) else None)
    if merged >= patches:
        raise PlanError(f"{path} merges {merged} tokens in all; the model has {patches} patches at {height}×{width} "
                        "px (at most one fewer can merge): make the plan at this resolution")  # fmt: skip
    if n > patches:
        raise PlanError(f"{path} pools {n} contrast tokens in a VCA block; the model has {patches} patches at "
                        f"{height}×{width} px: make the plan at this resolution")  # fmt: skip
    if recorded is None:
        return f"{path} does not record the resolution it was made for; it is applied at {height}×{width} px unchecked"
    return None
