"""The keys registered targets add to recovery recipes (`TargetConfig.recipe_options`), read from the registry.

The recipe schema (recipe.py) accepts, beside its own keys, every key a registered target declares for a section
("train" or "stage"), typed and validated by the declaring target's dataclass; the recipe engine then hands each
target its own keys (`target_options`) and trains each declared parameter group at its stage key's learning rate
(`group_learning_rates`). Read when a recipe is read, so a target registered later brings its keys too."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any

import vca_patch.targets  # noqa: F401  (registers the built-in targets)
from vca_patch.core.errors import ConfigError
from vca_patch.targets.base import CONFIG_TYPES, TargetConfig

SECTIONS = ("train", "stage")


@dataclass(frozen=True)
class TargetKey:
    """One recipe key a target declares: the dataclass declaring it, its type and default, and (stage keys) the
    parameter group whose learning rate it is."""

    owner: type
    hint: Any
    default: Any
    group: str | None


def _owners(section: str) -> list[type]:
    """The dataclasses the registered targets declare for `section`, each once, in registration order."""
    if section not in SECTIONS:
        raise ValueError(f"recipe section must be one of {SECTIONS}, got {section!r}")
    owners: list[type] = []
    for config_cls in CONFIG_TYPES.values():
        owner = getattr(config_cls.recipe_options, section)
        if owner is not None and owner not in owners:
            owners.append(owner)
    return owners


def declared(section: str) -> dict[str, TargetKey]:
    """{key: TargetKey} over every registered target's keys of `section`; two declarations of one key must agree."""
    keys: dict[str, TargetKey] = {}
    for owner in _owners(section):
        hints = typing.get_type_hints(owner)
        for f in dataclasses.fields(owner):
            key = TargetKey(owner, hints[f.name], f.default, f.metadata.get("group"))
            seen = keys.setdefault(f.name, key)
            if (seen.hint, seen.default, seen.group) != (key.hint, key.default, key.group):
                raise TypeError(f"recipe key {f.name!r} is declared differently by {seen.owner} and {owner}")
    return keys


def validate(section: str, values: dict[str, Any]) -> None:
    """Build each declaring dataclass from its keys of `values` (typed already), raising its ConfigError."""
    keys = declared(section)
    with_defaults(section, values)  # refuses unknown keys
    for owner in _owners(section):
        owner(**{k: v for k, v in values.items() if keys[k].owner is owner})


def with_defaults(section: str, values: dict[str, Any]) -> dict[str, Any]:
    """`values` over every declared key's default (what a recipe records); a key no registered target declares is
    refused (ConfigError naming the known ones)."""
    keys = declared(section)
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise ConfigError(f"{unknown[0]} is not a recipe key any registered target declares (known: {sorted(keys)})")
    return {key: declared_key.default for key, declared_key in keys.items()} | values


def target_options(config: TargetConfig | None, section: str, values: dict[str, Any]) -> Any:
    """The patched target's dataclass of `section` from `values` (its other keys at their defaults), or None
    where it declares none."""
    owner = getattr(config.recipe_options, section) if config is not None else None
    if owner is None:
        return None
    names = {f.name for f in dataclasses.fields(owner)}
    return owner(**{k: v for k, v in values.items() if k in names})


def parameter_group_names() -> list[str]:
    """Every parameter group a registered target declares a stage learning rate for, in registration order."""
    return list(dict.fromkeys(key.group for key in declared("stage").values() if key.group is not None))


def group_learning_rates(values: dict[str, Any]) -> dict[str, float]:
    """{group: learning rate} of every declared parameter group, from a stage's target keys `values`."""
    rates = with_defaults("stage", values)
    return {key.group: rates[name] for name, key in declared("stage").items() if key.group is not None}
