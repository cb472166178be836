"""Progress with a total and an ETA for every step of the CLI that can take more than a few seconds: a rich bar
on a terminal, plain lines with the total (and an ETA once one is known) when stderr is piped."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
PLAIN_EVERY_S = 10.0  # piped: one line at most this often (and the first and last)


def _eta(done: int, total: int, elapsed: float) -> str:
    if done <= 0 or total <= done:
        return ""
    left = elapsed / done * (total - done)
    return f", ETA {int(left // 60)}:{int(left % 60):02d}"


def track(items: Iterable[T], total: int, description: str, unit: str = "batches") -> Iterator[T]:
    """Yield `items`, showing `description`, how many of `total` are done and the time left."""
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
            TimeRemainingColumn(), console=console, transient=True,
        ) as bar:  # fmt: skip
            task = bar.add_task(description, total=total)
            for item in items:
                yield item
                bar.advance(task)
        return
    start = last = time.monotonic()
    print(f"{description}: 0/{total} {unit}", file=sys.stderr, flush=True)
    for done, item in enumerate(items, 1):
        yield item
        now = time.monotonic()
        if done == total or now - last >= PLAIN_EVERY_S:
            last = now
            print(f"{description}: {done}/{total} {unit}{_eta(done, total, now - start)}", file=sys.stderr, flush=True)
