"""Interleaved wall-clock timing: variants alternate run by run, so load drift hits all of them alike.

Each round runs every variant once, in an order rotated by one place per round: over k rounds each variant holds
every position once and runs right after each of the others, so none is timed more often right after itself (warm
caches) than another. (Forward-then-reversed rounds would give the two ends a back-to-back run every other round
and never the middle ones.)"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int = 1,
    repeats: int = 5,
    min_time: float = 0.0,
    max_rounds: int = 1000,
) -> dict[str, list[float]]:
    """Seconds per call of each fn: `warmup` untimed rounds, then rounds in rotating order — `repeats` at
    least, and more (up to `max_rounds`) until every fn has `min_time` seconds timed, as timeit's autorange
    does: a 10 ms call gets a hundred samples, so one slow round on a shared machine cannot move its median."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    totals = dict.fromkeys(names, 0.0)
    rounds = 0
    while rounds < repeats or (rounds < max_rounds and min(totals.values()) < min_time):
        shift = rounds % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(_timed(fns[name], device))
            totals[name] += times[name][-1]
        rounds += 1
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)
