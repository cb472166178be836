"""One registry style for everything a plug-in adds: targets, families, checkpoint formats, plan spaces, MAC counts
and bench extras (docs/reference/registries.md lists them all).

A `Registry` is a read-mostly mapping name -> object with these rules, the same for every registry:

- `register(name, obj)` refuses a name another object holds (`RegistryError`); registering the same object again
  is a no-op, so importing a module twice, or discovering a built-in through its entry point, changes nothing.
  A subclass never inherits its parent's registration: it registers under a name of its own.
- `unregister(name)` removes one (tests, replacing a plug-in); `registered(name, obj)` does both around a block.
- A registry with an entry-point `group` (`vca_patch.targets`, `vca_patch.families`) loads the installed
  plug-ins' entry points once, lazily, on its first read (lookup, `in`, listing). A plug-in that fails to import or
  to register is reported in one logged line naming the entry point and its distribution, and is skipped: the
  other plug-ins and the built-ins keep working; `failures` keeps the reasons for later error messages.
  So no module of vca-patch reads a registry with a group while it is imported (`holds` checks without discovery).

Only the standard library is imported here, so every layer can own a registry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, MutableMapping
from contextlib import contextmanager
from importlib.metadata import EntryPoint, entry_points, packages_distributions
from typing import Generic, TypeVar

T = TypeVar("T")
PLUGIN_LOGGER = logging.getLogger("vca_patch.plugins")  # one warning line per plug-in that fails to load


class RegistryError(ValueError):
    """A name is taken by another object, unknown, or an object is not what the registry holds."""


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def entry_point_source(ep: EntryPoint) -> str:
    """`NAME = VALUE` of `ep` and its distribution ("NAME = mod:Obj of toy-plugin 0.1"), for messages."""
    dist = ep.dist
    where = f" of {dist.name} {dist.version}" if dist is not None else ""
    return f"{ep.name} = {ep.value}{where}"


class Registry(MutableMapping[str, T], Generic[T]):
    """Name -> object, with the registration rules above (`self[name] = obj` is `register`, `del` `unregister`).

    `kind` names the registry in messages ("target"); `check(name, obj)` raises `RegistryError` (or `TypeError`)
    for an object this registry cannot hold; `default_before` is where a new name goes in the order (None: last),
    for registries whose order matters (families: before generic detection).
    """

    def __init__(
        self,
        kind: str,
        *,
        group: str | None = None,
        check: Callable[[str, T], None] | None = None,
        default_before: str | None = None,
    ) -> None:
        self.kind, self.group, self._check, self.default_before = kind, group, check, default_before
        self._items: dict[str, T] = {}
        self._discovered = group is None
        self.failures: dict[str, str] = {}  # entry-point name -> why it was skipped (one line)
        self.sources: dict[str, str] = {}  # name -> the distribution whose entry point registered it

    # ---- registration ----
    def register(self, name: str, obj: T, *, before: str | None = None) -> T:
        """Register `obj` under `name` (before the name `before`, or `default_before`); returns `obj`."""
        if not isinstance(name, str) or not name:
            raise RegistryError(f"a {self.kind} registers under a non-empty string name, got {name!r}")
        if self._check is not None:
            self._check(name, obj)
        held = self._items.get(name)
        if held is not None:
            if held is obj or held == obj:
                return obj
            raise RegistryError(
                f"{self.kind} {name!r} is already registered ({_describe(held)}); "
                f"unregister it first, or register {_describe(obj)} under a new name"
            )
        anchor = self.default_before if before is None else before
        if before is not None and before not in self._items:
            raise RegistryError(f"before={before!r} is not a registered {self.kind}; known: {list(self._items)}")
        if anchor is None or anchor not in self._items:
            self._items[name] = obj
        else:
            items = list(self._items.items())
            at = [key for key, _ in items].index(anchor)
            self._items = dict([*items[:at], (name, obj), *items[at:]])
        self._registered(name, obj)
        return obj

    def _registered(self, name: str, obj: T) -> None:
        """Hook for subclasses: `obj` was just registered under `name`."""

    def unregister(self, name: str) -> T:
        """Remove `name`; the object it held."""
        try:
            obj = self._items.pop(name)
        except KeyError:
            raise RegistryError(f"unknown {self.kind} {name!r}; known: {sorted(self._items)}") from None
        self.sources.pop(name, None)
        return obj

    @contextmanager
    def registered(self, name: str, obj: T, *, before: str | None = None) -> Iterator[T]:
        """`register` for the block, `unregister` after it (unless it was registered already): for tests."""
        was_there = self._items.get(name) is obj
        self.register(name, obj, before=before)
        try:
            yield obj
        finally:
            if not was_there and self._items.get(name) is obj:
                self.unregister(name)

    # ---- lookup ----
    def unknown(self, name: str) -> str:
        """The message for a lookup of `name` that failed: the known names, and why a plug-in by that name
        did not load."""
        failed = self.failures.get(name)
        reason = f"; its plug-in did not load: {failed}" if failed else ""
        return f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self)) or 'none'}{reason}"

    def distribution(self, name: str) -> str | None:
        """The installed distribution that provides `name` (its entry point's, else the one holding its module),
        or None where none is known (defined in a script or a test)."""
        self._ready()
        if name in self.sources:
            return self.sources[name]
        obj = self._items.get(name)
        module = getattr(obj, "__module__", None) or getattr(type(obj), "__module__", "")
        dists = packages_distributions().get(module.split(".")[0], [])
        return dists[0] if dists else None

    def holds(self, name: str) -> bool:
        """Whether `name` is registered now, without discovering entry points: for checks that run while modules are
        imported (a read there would import the plug-ins in the middle of importing vca-patch)."""
        return name in self._items

    def __getitem__(self, name: str) -> T:
        self._ready()
        return self._items[name]

    def __setitem__(self, name: str, obj: T) -> None:
        self.register(name, obj)

    def __delitem__(self, name: str) -> None:
        self._ready()
        if name not in self._items:
            raise KeyError(name)
        self.unregister(name)

    def __iter__(self) -> Iterator[str]:
        self._ready()
        return iter(list(self._items))

    def __len__(self) -> int:
        self._ready()
        return len(self._items)

    def __repr__(self) -> str:
        return f"<{self.kind} registry: {', '.join(self._items)}>"

    # ---- entry points ----
    def _ready(self) -> None:
        """Before every read: discover the entry points once."""
        if not self._discovered:
            self.discover()

    def discover(self) -> None:
        """Load every entry point of `group` (once; `discover` again re-reads them, e.g. after an install)."""
        if self.group is None:
            return
        self._discovered = True  # first: a plug-in that reads this registry while it loads sees no recursion
        for ep in entry_points(group=self.group):
            try:
                self.register(ep.name, ep.load())
            except Exception as exc:  # a broken plug-in is reported and skipped, never fatal to the others
                self.failures[ep.name] = _one_line(exc)
                PLUGIN_LOGGER.warning(
                    "warning: skipped vca-patch plug-in %s (group %s): %s",
                    entry_point_source(ep), self.group, self.failures[ep.name],
                )  # fmt: skip
            else:
                self.failures.pop(ep.name, None)
                if ep.dist is not None:
                    self.sources[ep.name] = ep.dist.name


def _describe(obj: object) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    module = getattr(obj, "__module__", None) or type(obj).__module__
    return f"{module}.{name}"
