"""YAML read within limits: safe tags only, and aliases that cannot blow up or loop.

PyYAML's `safe_load` shares an aliased node instead of copying it, so a "billion laughs" file (nine aliases of
nine aliases of ...) loads small but expands to billions of values in whatever walks it next, and an alias
inside its own anchor loads as a recursive list. This loader counts, for every node as it is composed, how many
values it expands to and how deep it nests once its aliases are expanded (from its children's counts, so the
count itself never expands anything), and refuses an alias to a node still being composed (a recursive alias),
more than `MAX_ALIASES` aliases, more than `MAX_VALUES` values or more than `MAX_DEPTH` levels; each refusal a
`YAMLLimitError` naming the line.
"""

from __future__ import annotations

from typing import Any

import yaml

MAX_ALIASES = 100  # alias uses (`*name`) in one document
MAX_VALUES = 100_000  # scalars, lists and mappings once every alias is expanded
MAX_DEPTH = 64  # nesting levels once every alias is expanded


class YAMLLimitError(yaml.YAMLError):
    """A YAML document that passes a limit of this loader (aliases, expanded values, nesting, recursion)."""


class BoundedSafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses recursive aliases and documents that expand past this module's limits."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._aliases = 0
        self._open = 0  # nesting of the nodes being composed
        self._sizes: dict[int, tuple[int, int]] = {}  # id(node) -> (values, depth) once expanded

    def compose_node(self, parent: Any, index: Any) -> Any:
        """The next node, with its expanded size checked (an alias: its target's, which must be complete)."""
        event = self.peek_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise YAMLLimitError(f"line {line}: more than {MAX_ALIASES} aliases (*{event.anchor})")
            node = super().compose_node(parent, index)
            if id(node) not in self._sizes:
                raise YAMLLimitError(f"line {line}: alias *{event.anchor} is inside its own anchor (a recursive alias)")
            return node
        self._open += 1
        if self._open > MAX_DEPTH:
            raise YAMLLimitError(f"line {line}: nested more than {MAX_DEPTH} levels deep")
        try:
            node = super().compose_node(parent, index)
        finally:
            self._open -= 1
        self._measure(node, line)
        return node

    def _measure(self, node: Any, line: int) -> None:
        """Record `node`'s expanded value count and depth from its (already measured) children; refuse past limits."""
        if isinstance(node, yaml.MappingNode):
            children = [child for pair in node.value for child in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        else:
            children = []
        measured = [self._sizes[id(child)] for child in children]
        values = 1 + sum(count for count, _ in measured)
        depth = 1 + max((d for _, d in measured), default=0)
        if values > MAX_VALUES:
            raise YAMLLimitError(
                f"line {line}: aliases expand to more than {MAX_VALUES} values (a 'billion laughs' file?)"
            )
        if depth > MAX_DEPTH:
            raise YAMLLimitError(f"line {line}: aliases nest more than {MAX_DEPTH} levels deep")
        self._sizes[id(node)] = (values, depth)


def bounded_safe_load(text: str) -> Any:
    """The one YAML document in `text`, loaded with safe tags within this module's limits (YAMLLimitError, a
    yaml.YAMLError, past them)."""
    loader = BoundedSafeLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
