"""Deprecated: the target hooks called on a config, `config.calibrates(layer)`, as configs took them before the hooks
moved to handlers (`vca_patch.targets.handler`).

`TargetConfig` derives from `DeprecatedHookForwarders`, so code written against the old API keeps working: each
forwarder warns (DeprecationWarning) and calls the config's handler. They live on this base of `TargetConfig`, not
on `TargetConfig` itself, so `handler_for` never takes them for a plug-in's own hooks (it looks for hooks defined
below `TargetConfig`). Shared code never calls them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

from vca_patch.targets.protocols import CLASS_HOOKS, HOOKS, PACKED_FORM_HOOKS

_HANDLER_LOOKUP: list[Callable[[Any], Any]] = []  # set by `targets.handler` when it loads (`use_handler_lookup`)


def use_handler_lookup(lookup: Callable[[Any], Any]) -> None:
    """Called once by `vca_patch.targets.handler`: how a forwarder finds its config's handler. Given, not imported:
    the handler module imports `targets.base`, whose `TargetConfig` derives from the class below."""
    _HANDLER_LOOKUP[:] = [lookup]


def _inherited_handler(owner: Any) -> Any:
    """The handler a forwarder calls (`handler.inherited_handler`)."""
    if not _HANDLER_LOOKUP:  # only before vca_patch.targets has finished loading
        raise RuntimeError("vca_patch.targets.handler is not loaded yet: import vca_patch.targets first")
    return _HANDLER_LOOKUP[0](owner)


def _warn(owner_cls: type, name: str, first: str) -> None:
    warnings.warn(
        f"{owner_cls.__name__}.{name}() is deprecated: a target's hooks moved from its config to its handler; call "
        f"vca_patch.targets.handler_for({first}).{name}({first}, ...)",
        DeprecationWarning,
        stacklevel=3,  # the forwarder's caller
    )


def _instance_forwarder(name: str) -> Callable[..., Any]:
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        _warn(type(self), name, "config")
        return getattr(_inherited_handler(self), name)(self, *args, **kwargs)

    return _described(forward, name, "config")


def _class_forwarder(name: str) -> classmethod:
    def forward(cls: type, *args: Any, **kwargs: Any) -> Any:
        _warn(cls, name, "config_cls")
        return getattr(_inherited_handler(cls), name)(cls, *args, **kwargs)

    return classmethod(_described(forward, name, "config_cls"))


def _described(forward: Callable[..., Any], name: str, first: str) -> Callable[..., Any]:
    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"Deprecated: `vca_patch.targets.handler_for({first}).{name}({first}, ...)`."
    forward.forwards_to_handler = True  # type: ignore[attr-defined]
    return forward


class DeprecatedHookForwarders:
    """A base of `TargetConfig`: a deprecated forwarder per target hook (`protocols.HOOKS`), and the packed-form
    methods (`pack`, `packed_state_dict`, `load_packed`) on a config whose handler has them, so that
    `hasattr(config, "pack")` still says whether a target has a packed form."""

    def __getattr__(self, name: str) -> Any:
        """The packed-form forwarders, where the handler implements them; any other missing name is missing."""
        if name in PACKED_FORM_HOOKS and hasattr(_inherited_handler(self), name):
            return functools.partial(_PACKED_FORWARDERS[name], self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


for _name in HOOKS:
    setattr(
        DeprecatedHookForwarders,
        _name,
        _class_forwarder(_name) if _name in CLASS_HOOKS else _instance_forwarder(_name),
    )
_PACKED_FORWARDERS = {name: _instance_forwarder(name) for name in PACKED_FORM_HOOKS}
