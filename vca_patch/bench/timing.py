"""Interleaved wall-clock timing: variants alternate run by run, so load drift hits all of them alike."""

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
    fns: dict[str, Callable[[], object]], device: torch.device, *, warmup: int = 1, repeats: int = 5
) -> dict[str, list[float]]:
    """Seconds per call of each fn: `warmup` untimed rounds, then `repeats` rounds in alternating order."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(_timed(fns[name], device))
    return times


def median(values: list[float]) -> float:
    return statistics.median(values)
