"""VCA's keys in recovery recipes (`VCAConfig.recipe_options`): the λ group's learning rate and the λ guard.

The recipe schema (train/recipe.py) reads them from here, so recipes keep `lambda_lr`, `lambda_guard` and
`lambda_max` while the schema names no target; the guard itself is `training.guard_lambdas`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from vca_patch.core.errors import ConfigError
from vca_patch.targets.base import RecipeOptions


@dataclass(frozen=True)
class VCARecipeTrain:
    """Keys of a recipe's `train` section for VCA: the λ guard after each optimizer update."""

    lambda_guard: Literal["clamp", "none"] = field(
        default="clamp", metadata={"help": "clamp: project every λ back into [0, lambda_max] after each update"}
    )
    lambda_max: float = field(default=0.95, metadata={"help": "upper bound of the λ guard, in (0, 1)"})

    def __post_init__(self) -> None:
        if self.lambda_guard not in ("clamp", "none"):
            raise ConfigError(f"lambda_guard must be 'clamp' or 'none', got {self.lambda_guard!r}")
        if not 0.0 < self.lambda_max < 1.0:
            raise ConfigError(f"lambda_max must be in (0, 1), got {self.lambda_max}")


@dataclass(frozen=True)
class VCARecipeStage:
    """Keys of a recipe stage for VCA: the learning rate of the λ vectors (`parameter_groups`' "lambda")."""

    lambda_lr: float = field(
        default=1e-4, metadata={"group": "lambda", "help": "learning rate of the λ vectors (0: frozen)"}
    )

    def __post_init__(self) -> None:
        if self.lambda_lr < 0:
            raise ConfigError(f"lambda_lr must be >= 0, got {self.lambda_lr}")


RECIPE_OPTIONS = RecipeOptions(train=VCARecipeTrain, stage=VCARecipeStage)
