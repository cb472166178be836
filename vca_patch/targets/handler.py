"""A target's behaviour, beside its config: `TargetHandler`, and the registry of handlers by config type.

A target's config is plain data (a `TargetConfig` dataclass); what surgery, calibration, checkpoints, training and
bench do with it lives in a stateless handler registered for the config's type:

    @register_handler(VCAConfig)
    class VCAHandler(TargetHandler):
        def build_layer(self, config, carried, layer_index): ...

Shared code asks `handler_for(config).hook(config, ...)` (the config class, for the hooks in
`protocols.CLASS_HOOKS`). `handler_for` walks the config class's MRO, so a subclass that only changes a default
gets its parent's handler. `TargetHandler` holds every hook's default (`vca_patch.targets.protocols` groups the hooks
and documents them).

Deprecated: a config class that still defines hooks itself, as configs did before handlers, and registers no
handler gets a `LegacyConfigHandler` that calls them (the hooks it does not define fall back to the handler found
further up its MRO, else `TargetHandler`'s defaults), with one DeprecationWarning per class.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.core.registry import Registry, RegistryError
from vca_patch.layers.carried import CarriedAttention
from vca_patch.targets.base import TargetConfig, target_display_name
from vca_patch.targets.forwarders import use_handler_lookup
from vca_patch.targets.protocols import HOOKS, PACKED_FORM_HOOKS

_SELECTION_FIELDS = {"target", "layers", "include", "exclude", "seed"}  # TargetConfig's own fields (and the key)


class TargetHandler:
    """The behaviour of a target, every hook with its default (see `vca_patch.targets.protocols`).

    Stateless: one instance serves every config of its type, and each hook takes the config (or, for the class
    hooks `builds_variant`, `card_section`, `calibration_settings` and `cpu_kernel`, the config class) as its first
    argument. Subclass it, override the hooks the target needs (`build_layer` at least) and register the subclass
    with `register_handler`.
    Two instances of one handler class are equal, so registering the same class again is a no-op.
    """

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other)

    def __hash__(self) -> int:
        return hash(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}()"

    # ---- Surgery (SurgeryHooks) ----
    def build_layer(self, config: TargetConfig, carried: CarriedAttention, layer_index: int) -> nn.Module:
        """The replacement for one attention module, reusing `carried` and initialised. Required."""
        raise NotImplementedError

    def builds_variant(self, config_cls: type[TargetConfig], carried: CarriedAttention) -> bool:
        """Whether `build_layer` builds a variant of its own for `carried`, a carry that refuses a generic layer
        (`layers.carried.VariantRequired`: PVT spatial reduction, Swin windows, joint image + text streams). When
        a target is refused one, surgery names the registered targets for which this says yes. Default: no."""
        return False

    def layer_settings(self, config: TargetConfig, layer: nn.Module) -> dict[str, Any]:
        """JSON-safe per-layer facts recorded in reports and checkpoints."""
        return {}

    def as_built(self, config: TargetConfig, model: nn.Module) -> TargetConfig:
        """`config` with its automatic choices replaced by what `model`'s patched layers got, as saved in a
        checkpoint: reloading then rebuilds the same layers whatever a later version's automatic rule picks.
        Default: the config itself (no automatic choices)."""
        return config

    def block_edits(
        self, config: TargetConfig, block: nn.Module, attention_name: str, layer_index: int
    ) -> dict[str, nn.Module]:
        """Replacements for other modules of the site's block (the module holding the attention, under
        `attention_name`): {path inside `block`: new module}, built without changing `block`. Surgery swaps them
        in with the attention and `unpatch_model` restores the originals (see layers/carried_module.py).
        Default: none."""
        return {}

    def block_forwards(self, config: TargetConfig, blocks: dict[int, tuple[nn.Module, str]]) -> dict[int, Any]:
        """Replacement forwards for whole blocks, {block index: callable}, given every patched site's
        {block index: (block, attention name)}: surgery sets each as its block's `forward` (an instance attribute,
        no module or state-dict key changes) and `unpatch_model` removes it. Default: none (token merging uses it)."""
        return {}

    # ---- Model card (CardHooks) ----
    def card_section(self, config_cls: type[TargetConfig], data: dict[str, Any]) -> tuple[str, str, str]:
        """(attention name, one-paragraph description, conversion-table rows) of a checkpoint's model card, from
        its config.json `config` block `data`. Default: the config class's summary line and every non-selection
        setting."""
        doc = config_cls.__doc__
        summary = doc.strip().splitlines()[0].rstrip(".") if config_cls.target and doc else ""
        name = target_display_name(str(data.get("target", config_cls.target)))
        intro = f"vca-patch's {name} target" + (f" ({summary})." if summary else ".")
        rows = "\n".join(f"| {key} | {value} |" for key, value in data.items() if key not in _SELECTION_FIELDS)
        return name, intro, rows

    # ---- Packed checkpoint form (PackingHooks; a handler with one also implements protocols.PackedForm) ----
    def is_packed(self, config: TargetConfig, model: nn.Module) -> bool:
        """Whether `model` (patched with `config`) is held in the target's packed form, which then is the only form
        it saves (`save_pretrained(..., packed=True)`). Default: no packed form."""
        return False

    # ---- Calibration (CalibrationHooks): recovery/calibrate.py's driver calls these ----
    def calibration_settings(self, config_cls: type[TargetConfig], options: dict[str, Any]) -> Any:
        """`options` (keywords given to `vca_patch.calibrate`) as the target's validated calibration options: an
        instance of the config class's `calibration_options` with the others at their defaults. Checked before any
        work, so a bad key or value is one ConfigError naming it; None for a target that declares none (and was
        given none)."""
        options_cls = config_cls.calibration_options
        name = target_display_name(config_cls.target)
        if options_cls is None:
            if options:
                raise ConfigError(f"{name} layers take no calibration options; drop {sorted(options)}")
            return None
        known = sorted(f.name for f in dataclasses.fields(options_cls))
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"unknown {name} calibration options {unknown}; valid: {known}")
        return options_cls(**options)

    def calibrates(self, config: TargetConfig, layer: nn.Module) -> bool:
        """Whether `layer` (one of the layers `config` patched in) has a closed-form calibration,
        `calibrate_layer`. Default: no; `vca_patch.calibrate` leaves the target's layers at their own init."""
        return False

    def calibrate_layer(
        self, config: TargetConfig, layer: nn.Module, capture: Any, teacher: Any, measure: Any, options: Any
    ) -> dict:
        """Fit `layer` in place, teacher-forced: `capture` holds its `inputs`, the original's `outputs` and the
        `layout`; `teacher` is the original attention's input to the output projection on `capture.inputs`;
        `measure(step)` records the layer's error after each step; `options` is `calibration_settings`' result.
        Returns the report's facts for the layer: {"contrast_tokens": int, "temperature": list | None}."""
        raise ConfigError(f"target {config.target!r} ({type(config).__name__}) has no closed-form calibration")

    def grown_tokens(self, config: TargetConfig, tokens: int, num_patches: int) -> int:
        """The next token count for a calibrated layer with `tokens` whose error stays above `grow_tokens`, on a
        grid of `num_patches` (the same count: it cannot grow). Default: no growth."""
        return tokens

    def with_more_tokens(self, config: TargetConfig, grow: dict[int, int]) -> TargetConfig:
        """`config` with the token counts of `grow` ({block index: count}) to re-patch those blocks with."""
        raise ConfigError(f"target {config.target!r} ({type(config).__name__}) cannot grow tokens")

    # ---- Compute kernel (KernelHooks): bench/ and the CLI call it ----
    def cpu_kernel(self, config_cls: type[TargetConfig]) -> Any:
        """The target's compute kernel for reports and A/B runs, or None (default): an object with `available()`
        (builds it on first use, never raises), `status()` (one report line, no build), `use(enabled)` (context
        manager forcing it off inside the block when False)."""
        return None

    # ---- Recovery training (RecipeHooks): train/params.py and the recipe engine call these ----
    def check_stage_state(self, config: TargetConfig, state: dict[str, Any]) -> None:
        """Refuse a recipe stage's `target_state` this target cannot apply (default: any non-empty one)."""
        if state:
            raise ConfigError(
                f"target {config.target!r} ({type(config).__name__}) has no per-stage state to switch; a recipe "
                f"stage's target_state must be empty for it, got keys {sorted(state)}"
            )

    def apply_stage_state(self, config: TargetConfig, model: nn.Module, state: dict[str, Any]) -> None:
        """Put `model` (patched with `config`) into `state` at a recipe stage's start (the recipe engine calls
        this with the stage's `target_state`, merged over the earlier stages'). Default: only an empty state."""
        self.check_stage_state(config, state)

    def parameter_groups(self, config: TargetConfig, model: nn.Module) -> dict[str, list[nn.Parameter]]:
        """The target's parameters of `model` (patched with `config`) that the recipe engine trains in a group of
        their own, by group name; each group's learning rate is the stage key that `recipe_options.stage` declares
        for it (VCA: "lambda", `lambda_lr`). Default: none (all the target's new parameters train at the stage's
        `lr`)."""
        return {}

    def guard_parameters(self, config: TargetConfig, model: nn.Module, options: Any) -> int:
        """Project constrained parameters of `model` back into range after an optimizer step, as the recipe's train
        options for this target say (`options`: an instance of `recipe_options.train`, None where the target
        declares none; VCA: `lambda_guard: clamp` with bound `lambda_max`); returns how many moved. Default: nothing
        to guard."""
        return 0

    def parameter_trace(self, config: TargetConfig, model: nn.Module) -> dict[str, Any]:
        """Health values of the target's parameters, recorded in each evaluation of metrics.json (VCA:
        {"lambda": [[λ₁, λ₂] per layer]}). Default: none."""
        return {}


DEFAULT_HANDLER = TargetHandler()  # the handler of a config class with no handler and no hooks of its own


class LegacyConfigHandler(TargetHandler):
    """Deprecated: the handler of a config class that defines hooks itself and registers no handler.

    `handler_for` makes one subclass per such config class, whose methods call the config's own hooks
    (`overrides`); the others come from the class it also derives from, the handler found further up the config's
    MRO (else `TargetHandler`): the defaults, which call back into the config's own hooks (a default
    `apply_stage_state` checks with the config's `check_stage_state`).
    """

    overrides: ClassVar[frozenset[str]] = frozenset()

    def inherited(self) -> TargetHandler:
        """This handler without the config's own hooks: what a config's hook reaches through `super()` (the
        deprecated forwarders), which would otherwise call that same hook again."""
        return super()  # type: ignore[return-value]


def _config_hook(name: str) -> Callable[..., Any]:
    """A handler method that calls the config's (or config class's) own hook `name`."""

    def hook(self: LegacyConfigHandler, owner: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(owner, name)(*args, **kwargs)

    hook.__name__ = hook.__qualname__ = name
    hook.__doc__ = f"The config's own `{name}` (deprecated: move it into a handler registered with register_handler)."
    return hook


def _own_hooks(classes: list[type]) -> frozenset[str]:
    """The hooks (and packed-form methods) that `classes` (a config class and its bases up to TargetConfig or a
    class with a registered handler) define in their own bodies."""
    return frozenset(name for klass in classes for name in (*HOOKS, *PACKED_FORM_HOOKS) if name in vars(klass))


def _legacy_handler(config_cls: type, base: TargetHandler, overrides: frozenset[str]) -> LegacyConfigHandler:
    """A `LegacyConfigHandler` for `config_cls` over `base`, the config's own `overrides` called on the config."""
    methods: dict[str, Any] = {name: _config_hook(name) for name in overrides}
    bases = (LegacyConfigHandler,) if type(base) is TargetHandler else (LegacyConfigHandler, type(base))
    handler_cls = type(f"Legacy{config_cls.__name__}Handler", bases, {**methods, "overrides": overrides})
    return handler_cls()


def config_key(config_cls: type) -> str:
    """The name a config class's handler registers under: its module and qualified name."""
    return f"{config_cls.__module__}.{config_cls.__qualname__}"


def _check_handler(name: str, handler: Any) -> None:
    if not isinstance(handler, TargetHandler):
        raise RegistryError(f"target handler {name!r}: expected a TargetHandler instance, got {handler!r}")


class HandlerRegistry(Registry[TargetHandler]):
    """Config class (under `config_key`) -> its handler, with the registry rules of `core/registry.py`; `lookup`
    walks a config class's MRO and remembers the answer until the next registration change."""

    def __init__(self) -> None:
        super().__init__("target handler", check=_check_handler)
        self.config_types: dict[str, type] = {}  # name -> the config class registered under it
        self._resolved: weakref.WeakKeyDictionary[type, TargetHandler] = weakref.WeakKeyDictionary()
        self._warned: weakref.WeakSet[type] = weakref.WeakSet()  # legacy config classes already warned about

    def add(self, config_cls: type, handler: TargetHandler) -> TargetHandler:
        """Register `handler` for `config_cls`; another handler (or another class of the same name) is refused."""
        name = config_key(config_cls)
        if self.config_types.get(name, config_cls) is not config_cls:
            raise RegistryError(
                f"target handler {name!r} is already registered for another class of that name; "
                "unregister_handler it first"
            )
        self.register(name, handler)
        self.config_types[name] = config_cls
        return handler

    def _registered(self, name: str, obj: TargetHandler) -> None:
        self._resolved.clear()

    def unregister(self, name: str) -> TargetHandler:
        handler = super().unregister(name)
        self.config_types.pop(name, None)
        self._resolved.clear()
        return handler

    def registered_for(self, klass: type) -> TargetHandler | None:
        """The handler registered for exactly `klass`, or None."""
        name = config_key(klass)
        return self._items.get(name) if self.config_types.get(name) is klass else None

    def lookup(self, config_cls: type) -> TargetHandler:
        """The handler of `config_cls` (see `handler_for`)."""
        found = self._resolved.get(config_cls)
        if found is None:
            found = self._resolved[config_cls] = self._resolve(config_cls)
        return found

    def _resolve(self, config_cls: type) -> TargetHandler:
        own: list[type] = []  # the classes of the MRO below the first one with a handler (or TargetConfig)
        base = None
        for klass in config_cls.__mro__:
            base = self.registered_for(klass)
            if base is not None or klass is TargetConfig:
                break
            own.append(klass)
        base = base or DEFAULT_HANDLER
        overrides = _own_hooks(own)
        if not overrides:
            return base
        self._warn_legacy(config_cls, overrides)
        return _legacy_handler(config_cls, base, overrides)

    def _warn_legacy(self, config_cls: type, overrides: frozenset[str]) -> None:
        if config_cls in self._warned:
            return
        self._warned.add(config_cls)
        warnings.warn(
            f"{config_cls.__qualname__} defines target hooks on its config class ({', '.join(sorted(overrides))}): "
            f"deprecated; move them into a TargetHandler subclass registered with "
            f"vca_patch.targets.register_handler({config_cls.__name__}) (docs/extending.md)",
            DeprecationWarning,
            stacklevel=5,  # handler_for's caller
        )


HANDLERS: HandlerRegistry = HandlerRegistry()

H = TypeVar("H", bound=type[TargetHandler])


def register_handler(config_cls: type[TargetConfig]) -> Callable[[H], H]:
    """Class decorator: register the decorated `TargetHandler` subclass (one instance of it) as the handler of
    `config_cls` and its subclasses. Another handler class for the same config class is refused (`RegistryError`);
    the same class again is a no-op."""

    def decorate(handler_cls: H) -> H:
        if not (isinstance(handler_cls, type) and issubclass(handler_cls, TargetHandler)):
            raise RegistryError(f"register_handler decorates a TargetHandler subclass, got {handler_cls!r}")
        HANDLERS.add(config_cls, handler_cls())
        return handler_cls

    return decorate


def unregister_handler(config_cls: type[TargetConfig]) -> TargetHandler:
    """Remove the handler registered for `config_cls` (e.g. at a test's teardown); the handler."""
    return HANDLERS.unregister(config_key(config_cls))


def handler_for(config: TargetConfig | type[TargetConfig]) -> TargetHandler:
    """The handler of a config (instance or class): the one registered for the nearest class of its MRO; a
    `LegacyConfigHandler` where the config class defines hooks itself (deprecated); else `TargetHandler`'s
    defaults."""
    return HANDLERS.lookup(config if isinstance(config, type) else type(config))


def inherited_handler(config: TargetConfig | type[TargetConfig]) -> TargetHandler:
    """`handler_for(config)`, but past a legacy config's own hooks: what the deprecated forwarders on
    `TargetConfig` call, so that a config's own hook that calls `super()` reaches the defaults, not itself."""
    handler = handler_for(config)
    return handler.inherited() if isinstance(handler, LegacyConfigHandler) else handler


use_handler_lookup(inherited_handler)  # the deprecated forwarders on TargetConfig call handlers through it
