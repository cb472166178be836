"""Reading untrusted input files within limits: a regular file (never a FIFO, device or socket, which would block
or never end), at most a size cap read, and JSON no deeper than a nesting limit.

Every refusal is one error of the caller's type naming the file (and, for nesting, the field where it goes too
deep), raised before anything is built from the file. YAML has its own bounded loader (`core.bounded_yaml`).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from vca_patch.core.errors import ConfigError
from vca_patch.core.sizes import format_bytes

MAX_JSON_BYTES = 16 << 20  # a config.json or plan file (a transformers config with 21k labels is ~1 MiB)
MAX_JSON_DEPTH = 64  # nested objects and lists (configs nest 3 to 4 levels)

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))  # fmt: skip


def not_regular(path: Path | str) -> str | None:
    """What `path` is in words when it exists but is no regular file (links followed: "a FIFO (named pipe)", "a
    folder", ...); None for a regular file or a path that does not exist (the reader names that itself)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    return next((words for test, words in _KINDS if test(mode)), "a special file")


def read_bounded(path: Path, max_bytes: int, what: str, error: type[Exception] = ConfigError) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them; `error` naming `what` and the file when it
    is missing, not a regular file, larger, or unreadable (the size is checked before and while reading, so a file
    that grows is cut off too)."""
    kind = not_regular(path)
    if kind is not None:
        raise error(f"{what} {path} is {kind}, not a regular file")
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise error(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise error(f"{what} {path} is larger than {format_bytes(max_bytes)}, more than any {what} needs")
    return data


def deeper_than(value: Any, limit: int) -> str | None:
    """The path (e.g. `a.b[0]`) of the first value nested more than `limit` levels deep in parsed JSON/YAML
    data, or None. Iterative: a deep document cannot exhaust Python's stack here."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        item, where, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        if depth >= limit:
            return where or "(top level)"
        children = item.items() if isinstance(item, dict) else enumerate(item)
        for key, child in children:
            name = f"{where}[{key}]" if isinstance(item, list) else (f"{where}.{key}" if where else str(key))
            stack.append((child, name, depth + 1))
    return None


def short_field(where: str, limit: int = 80) -> str:
    """A field path shortened for one line: its start and its end."""
    return where if len(where) <= limit else f"{where[:36]}...{where[-36:]}"


def parse_json(
    data: bytes, source: str, *, error: type[Exception] = ConfigError, max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """Parsed JSON `data` (UTF-8) from `source`, nested at most `max_depth` levels; else `error` naming `source`
    and the field where it nests too deep."""
    try:
        value = json.loads(data.decode("utf-8"))
    except RecursionError:  # nested deeper than the parser's own stack allows
        raise error(
            f"{source} is nested more than {max_depth} levels deep; it is not a config vca-patch wrote"
        ) from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise error(f"{source} is not valid JSON: {exc}") from None
    where = deeper_than(value, max_depth)
    if where is not None:
        raise error(f"{source}: {short_field(where)} is nested more than {max_depth} levels deep")
    return value


def read_json(
    path: Path | str,
    what: str = "JSON file",
    *,
    error: type[Exception] = ConfigError,
    max_bytes: int | None = None,
    max_depth: int | None = None,
) -> Any:
    """The parsed JSON file at `path`, read within `max_bytes` and `max_depth` (default MAX_JSON_BYTES and
    MAX_JSON_DEPTH, read when called; see `read_bounded`, `parse_json`)."""
    path = Path(path)
    max_bytes = MAX_JSON_BYTES if max_bytes is None else max_bytes
    max_depth = MAX_JSON_DEPTH if max_depth is None else max_depth
    return parse_json(read_bounded(path, max_bytes, what, error), str(path), error=error, max_depth=max_depth)
