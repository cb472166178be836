"""The target interface: `TargetConfig` (a target's settings, plain data) and the target registry.

A target registers its config class with `register_target` (or, installed as a plug-in, through an entry point of
the group `vca_patch.targets`, found on the registry's first read), and its behaviour, a handler, with
`vca_patch.targets.handler.register_handler`; nothing here imports a target."""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.core.registry import Registry, RegistryError
from vca_patch.targets.forwarders import DeprecatedHookForwarders

TARGET_GROUP = "vca_patch.targets"  # entry-point group: NAME = "module:ConfigClass", NAME the class's `target`


def _check_target(name: str, config_cls: Any) -> None:
    if not (isinstance(config_cls, type) and issubclass(config_cls, TargetConfig)):
        raise RegistryError(f"target {name!r}: expected a TargetConfig subclass, got {config_cls!r}")
    if config_cls.target != name:
        raise RegistryError(
            f"target {name!r}: {config_cls.__qualname__}.target is {config_cls.target!r}; the name must match it"
        )


class TargetRegistry(Registry["type[TargetConfig]"]):
    """The target registry, plus the deprecated registration by subclassing: a `TargetConfig` subclass that declares
    a new `target` and was not registered is registered on the registry's next read, with a DeprecationWarning."""

    def __init__(self) -> None:
        super().__init__("target", group=TARGET_GROUP, check=_check_target)
        self.pending: dict[str, type[TargetConfig]] = {}  # subclasses declaring a `target`, not yet registered

    def _registered(self, name: str, obj: type[TargetConfig]) -> None:
        if self.pending.get(name) is obj:
            del self.pending[name]

    def _ready(self) -> None:
        super()._ready()
        while self.pending:
            name, config_cls = self.pending.popitem()
            held = self._items.get(name)
            if held is config_cls:
                continue
            if held is not None:
                warnings.warn(
                    f"{config_cls.__qualname__} declares target {name!r}, which {held.__qualname__} holds: it is not "
                    f"registered (a subclass does not take its parent's name); give it a new `target` and "
                    f"register_target it",
                    UserWarning,
                    stacklevel=3,
                )
                continue
            warnings.warn(
                f"target {name!r} ({config_cls.__qualname__}) registered by subclassing TargetConfig: deprecated; "
                f"decorate the class with vca_patch.targets.register_target, or declare it as an entry point of "
                f"the group {TARGET_GROUP!r} (docs/extending.md)",
                DeprecationWarning,
                stacklevel=3,
            )
            self.register(name, config_cls)


CONFIG_TYPES: TargetRegistry = TargetRegistry()


def register_target(config_cls: type[TargetConfig]) -> type[TargetConfig]:
    """Register `config_cls` under its `target` name (usable as a class decorator); returns it. A name another class
    holds is refused (`RegistryError`); the same class again is a no-op."""
    name = getattr(config_cls, "target", None)
    return CONFIG_TYPES.register(name if isinstance(name, str) else "", config_cls)


def unregister_target(name: str) -> type[TargetConfig]:
    """Remove the target `name` (e.g. at a test's teardown); its config class."""
    return CONFIG_TYPES.unregister(name)


@dataclass(frozen=True)
class RecipeOptions:
    """The keys a target adds to recovery recipes (`TargetConfig.recipe_options`), so that the recipe schema
    (train/recipe.py) stays generic: `train`, a frozen dataclass of keys of a recipe's `train` section; `stage`, one
    of keys of each stage (None: none). Their fields are typed, with defaults and metadata help; a stage field
    with metadata {"group": name} is the learning rate of the target's parameter group `name`
    (the handler's `parameter_groups`). Constructing either validates its values: a ConfigError whose message
    starts with the key (the schema puts where the key is in front)."""

    train: type | None = None
    stage: type | None = None


def _read_version(config_cls: type[TargetConfig], target: str, data: dict[str, Any]) -> dict[str, Any]:
    """`data` without its "version" (absent: 1, the checkpoints before versions were saved), upgraded by the
    config class when older than its own; a newer one is refused naming the distribution to upgrade."""
    version = data.pop("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"the {target!r} config's version must be a positive integer, got {version!r}")
    if version > config_cls.version:
        dist = CONFIG_TYPES.distribution(target) or config_cls.__module__.split(".")[0]
        raise ConfigError(
            f"the {target!r} config is version {version}, newer than this installation's {config_cls.__name__} "
            f"(version {config_cls.version}, from {dist}): upgrade {dist} (pip install -U {dist}) to read it"
        )
    return config_cls.upgrade(data, version) if version < config_cls.version else data


def target_display_name(target: str) -> str:
    """`"mano"` -> `"MANO"`: a registered target's `display_name`, else its upper-cased name."""
    config_cls = CONFIG_TYPES.get(target)
    return (config_cls.display_name if config_cls is not None else "") or target.upper()


@dataclass
class TargetConfig(DeprecatedHookForwarders):
    """Base of every target attention's config: plain data (layer selection, seed, JSON round trip) and the
    declarative class attributes shared code reads.

    Subclasses set `target`, add their fields (and `validate` them); the target's behaviour (`build_layer`,
    `layer_settings`, ...) lives in its handler, a `vca_patch.targets.handler.TargetHandler` subclass registered for
    the config class with `register_handler`. The hooks a config once took (`config.calibrates(layer)`) still answer,
    through its handler, with a DeprecationWarning (`forwarders.DeprecatedHookForwarders`).
    """

    target: ClassVar[str] = ""
    # Presentation hooks for reports and model cards (shared code reads these, never a target's name):
    display_name: ClassVar[str] = ""  # how reports and cards name the target; "" -> the upper-cased target name
    tags: ClassVar[tuple[str, ...]] = ()  # Hub model-card tags beside "vca-patch"; () -> just the target name
    citation: ClassVar[str] = ""  # BibTeX of the method's paper, for the model card; "" -> none recorded
    # The config's schema version, saved with it (`to_dict`): raise it when a change to the fields would make an
    # older reader misread a new checkpoint, and give `upgrade` the step from the old schema.
    version: ClassVar[int] = 1
    # The target's per-layer calibration options: a frozen dataclass whose fields (typed, with their defaults and
    # metadata help, written once) are `vca_patch.calibrate`'s keywords for this target and whose construction
    # validates them (ConfigError; the handler's `calibration_settings`). None: the target takes no calibration
    # options (VCA: `VCACalibration`).
    calibration_options: ClassVar[type | None] = None
    recipe_options: ClassVar[RecipeOptions] = RecipeOptions()  # the keys the target adds to recipes (default: none)

    layers: list[int] | None = field(default=None, kw_only=True)
    include: str | None = field(default=None, kw_only=True)  # regex: patch only matching module paths
    exclude: str | None = field(default=None, kw_only=True)  # regex: never patch matching module paths
    seed: int = field(default=0, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Deprecated registration by subclassing: a subclass that declares its own `target` and is not registered
        by then is registered on the registry's next read (with a DeprecationWarning). One that inherits its
        parent's `target` (changing a default, say) is never registered: it cannot take over the parent's name."""
        super().__init_subclass__(**kwargs)
        if "target" in cls.__dict__ and cls.target and CONFIG_TYPES._items.get(cls.target) is not cls:
            CONFIG_TYPES.pending[cls.target] = cls

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.layers is not None:
            if not isinstance(self.layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers
            ):
                raise ConfigError(f"layers must be a list of non-negative block indices or None, got {self.layers!r}")
            self.layers = sorted(set(self.layers))
        for name in ("include", "exclude"):
            pattern = getattr(self, name)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as exc:
                    raise ConfigError(
                        f"{name} must be a regular expression on module paths, got {pattern!r}: {exc}"
                    ) from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    def fit_grid(self, grid: tuple[int, int]) -> tuple[TargetConfig, list[str]]:
        """Hook: this config for a model whose patch grid at its input size is `grid` (rows, columns), with a note
        for each default it had to change. `patch_model`, `inspect_model` and the CLI all call it before building
        anything, so one rule holds for both: a setting the grid cannot take is refused (SizeError naming the
        field), a default it cannot take is fitted. Default: the config as it is, no notes."""
        return self, []

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "version": self.version, **dataclasses.asdict(self)}

    @classmethod
    def upgrade(cls, data: dict[str, Any], version: int) -> dict[str, Any]:
        """Hook: the fields of a config saved at an older schema `version` (< `cls.version`), as this version reads
        them. Default: unchanged (every change so far only added fields with defaults)."""
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetConfig:
        """Build the config named by data["target"] (or this class's), rejecting unknown keys. On a registered
        target's class (or a subclass of it, which keeps its parent's name) the target must be its own."""
        data = dict(data)
        target = data.pop("target", cls.target)
        if cls.target and target != cls.target:
            raise ConfigError(f"config is for target {target!r}, not {cls.target!r}")
        config_cls = cls if cls.target else CONFIG_TYPES.get(target)
        if config_cls is None:
            raise ConfigError(CONFIG_TYPES.unknown(str(target)))
        data = _read_version(config_cls, target, data)
        known = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown {config_cls.__name__} keys {unknown}; valid keys: {sorted(known)}")
        return config_cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> TargetConfig:
        return cls.from_dict(json.loads(text))


def is_int(value: Any) -> bool:
    """An int that is not a bool: what a config field typed `int` accepts from JSON."""
    return isinstance(value, int) and not isinstance(value, bool)


# ---- Planning hooks the latency-budget planner (planner/) searches a target's plan space ----
class BlockKind:
    """One per-block choice of a plan besides the original attention: blocks of this kind run the registered target
    `name` with one integer setting per block (VCA: contrast tokens n; MANO: window k). `name` is also the kind's
    key in the planner's records and plan files; `label` and `symbol` are how plans print it ("VCA", "n")."""

    name: str = ""
    label: str = ""
    symbol: str = ""
    shrinks: bool = False  # a block of this kind moves on only to smaller values of it (VCA: fewer contrast tokens)

    @property
    def calibrates(self) -> bool:
        """Whether blocks of this kind have a closed-form calibration (their target declares its options)."""
        return CONFIG_TYPES[self.name].calibration_options is not None

    def config(
        self, value: int, layers: list[int] | None, *, calibrate: bool | None, local_window: int
    ) -> TargetConfig:
        """The config that converts blocks `layers` (None: all) to this kind with `value`, to time or measure them
        alone; `calibrate`: whether they will be calibrated (None: the target's default); `local_window`: the
        plan's local term where the kind has one."""
        raise NotImplementedError

    def macs(self, shape: Any, value: int, *, local_window: int) -> float:
        """Analytic MACs of one such block's attention on `shape` (a `layers.macs.AttentionShape`), as planned
        (training-free)."""
        raise NotImplementedError


class PlanSpace:
    """What the planner searches, declared by the target whose config is the plan (`target`): a token-reducing
    schedule (r tokens removed after each block) and, in the blocks before the first reduction, one of `kinds` or
    the original attention. The planner builds no config itself: every config it times, measures or saves comes
    from here. Register one with `register_plan_space` from the target's package."""

    target: str = ""
    kinds: tuple[BlockKind, ...] = ()
    unmerge_modes: tuple[str, ...] = ()  # how reduced tokens return at the end (the planner's `unmerge`)

    def kind(self, name: str) -> BlockKind:
        """The block kind called `name`."""
        found = next((k for k in self.kinds if k.name == name), None)
        if found is None:
            raise ConfigError(f"{self.target}'s plan space has no block kind {name!r}; known: {self.kind_names}")
        return found

    @property
    def kind_names(self) -> list[str]:
        return [k.name for k in self.kinds]

    @property
    def config_type(self) -> type[TargetConfig]:
        """The plan's config class (what `load_plan` returns)."""
        return CONFIG_TYPES[self.target]

    def check_settings(self, *, local_window: int) -> None:
        """Refuse planner settings the space cannot plan with (ConfigError naming them); default: none."""

    def survey_config(self) -> TargetConfig:
        """The config whose dry run (`inspect_model`) lists the blocks a plan may convert."""
        raise NotImplementedError

    def tokens_removed(self, tokens: int, prefix: int, r: int) -> int:
        """Tokens one block removes from `tokens` (of which `prefix` never go) when asked for `r`."""
        raise NotImplementedError

    def schedule_config(self, schedule: list[int], *, unmerge: str) -> TargetConfig:
        """The config that removes schedule[i] tokens after block i and nothing else."""
        raise NotImplementedError

    def mark_timed_block(self, block: nn.Module) -> None:
        """Make the first block of a `schedule_config([1, 0, ...])` model, timed alone, also do the end-of-model
        work (the unmerge), so its overhead is timed whole. Default: nothing to do."""

    def plan_config(
        self,
        schedule: list[int],
        blocks: dict[str, dict[int, int]],
        *,
        calibrate: bool,
        local_window: int,
        expect: dict[str, int],
        unmerge: str,
    ) -> TargetConfig:
        """The plan as a config: `schedule`, {kind: {block: value}}, for a model with `expect` (depth, dim, heads)."""
        raise NotImplementedError

    def plan_sizes(self, config: TargetConfig, depth: int | None) -> tuple[int, int]:
        """(tokens the plan removes in all, the largest number of tokens one of its blocks pools) for its checks
        against a patch grid; `depth`: blocks of the model, where the plan gives no per-block schedule."""
        raise NotImplementedError


def _check_plan_space(name: str, space: Any) -> None:
    if not isinstance(space, PlanSpace) or space.target != name:
        raise RegistryError(f"plan space {name!r}: expected a PlanSpace whose target is {name!r}, got {space!r}")
    if not CONFIG_TYPES.holds(name):  # no discovery: plan spaces register while their package is imported
        raise ConfigError(f"plan space for unknown target {name!r}; known: {sorted(CONFIG_TYPES._items)}")


PLAN_SPACES: Registry[PlanSpace] = Registry("plan space", check=_check_plan_space)


def register_plan_space(space: PlanSpace) -> PlanSpace:
    """Register `space` (its `target` must be a registered target) as the planner's search space for that target;
    a target holds one plan space (`unregister_plan_space` it first to replace it)."""
    return PLAN_SPACES.register(space.target, space)


def unregister_plan_space(target: str) -> PlanSpace:
    """Remove the plan space of `target`; the space."""
    return PLAN_SPACES.unregister(target)


def plan_space(target: str | None = None) -> PlanSpace:
    """The plan space of `target`, or (None) the only registered one."""
    if target is None:
        if len(PLAN_SPACES) == 1:
            return next(iter(PLAN_SPACES.values()))
        raise ConfigError(f"{len(PLAN_SPACES)} plan spaces are registered ({sorted(PLAN_SPACES)}): name the target")
    if target in PLAN_SPACES:
        return PLAN_SPACES[target]
    raise ConfigError(f"no plan space for target {target!r}; registered: {sorted(PLAN_SPACES)}")
