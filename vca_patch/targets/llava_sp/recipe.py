"""LLaVA-SP recipe files (recipes/llava_sp_*.yaml): one training stage each, validated, unknown keys named."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from vca_patch.core.errors import ConfigError
from vca_patch.targets.llava_sp.config import SpatialTokensConfig

STAGES = ("projector", "lora")


@dataclass
class LoraSettings:
    r: int = 128
    alpha: int = 256
    dropout: float = 0.05
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )


@dataclass
class OptimSettings:
    epochs: float = 1.0
    lr: float = 1e-3
    projector_lr: float | None = None  # stage 2: projector + spatial tokens (None: same as lr)
    weight_decay: float = 0.0
    warmup_ratio: float = 0.03
    schedule: str = "cosine"
    per_device_batch: int = 16
    grad_accum: int = 1
    gpus: int = 8
    mixed_precision: str = "bf16"
    gradient_checkpointing: bool = True
    max_length: int = 2048


@dataclass
class DataSettings:
    train_json: str = ""
    image_folder: str = ""


@dataclass
class SpatialTokensRecipe:
    name: str
    stage: str
    budget: str
    base_model: str
    description: str = ""
    init_from: str | None = None  # stage 2: the stage-1 output folder
    spatial_tokens: SpatialTokensConfig = field(default_factory=SpatialTokensConfig)
    data: DataSettings = field(default_factory=DataSettings)
    optim: OptimSettings = field(default_factory=OptimSettings)
    lora: LoraSettings | None = None

    @property
    def global_batch(self) -> int:
        return self.optim.per_device_batch * self.optim.grad_accum * self.optim.gpus


def _build(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in known:
            raise ConfigError(f"{where}: unknown key {key!r}; valid keys: {known}")
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def recipe_from_dict(data: dict[str, Any]) -> SpatialTokensRecipe:
    data = dict(data)
    nested = {
        "spatial_tokens": lambda v: SpatialTokensConfig.from_dict(v),
        "data": lambda v: _build(DataSettings, v, "recipe.data"),
        "optim": lambda v: _build(OptimSettings, v, "recipe.optim"),
        "lora": lambda v: _build(LoraSettings, v, "recipe.lora"),
    }
    for key, make in nested.items():
        if key in data and data[key] is not None:
            data[key] = make(data[key])
    recipe = _build(SpatialTokensRecipe, data, "recipe")
    if recipe.stage not in STAGES:
        raise ConfigError(f"recipe.stage must be one of {list(STAGES)}, got {recipe.stage!r}")
    if (recipe.stage == "lora") != (recipe.lora is not None):
        raise ConfigError("recipe.lora is required for stage 'lora' and not allowed for stage 'projector'")
    return recipe


def load_recipe(path: str | Path) -> SpatialTokensRecipe:
    return recipe_from_dict(yaml.safe_load(Path(path).read_text(encoding="utf-8")))
