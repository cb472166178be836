"""Interleaved wall-clock timing: variants alternate run by run, so load drift hits all of them alike.

Each round runs every variant once, in an order rotated by one place per round: over k rounds each variant holds
every position once and runs right after each of the others, so none is timed more often right after itself (warm
caches) than another. (Forward-then-reversed rounds would give the two ends a back-to-back run every other round
and never the middle ones.)

`time_ratios` times variants against a baseline and adds rounds until each variant's ratio is known well enough:
the ratio of a round is the variant's time over the baseline's in that same round (a paired ratio, so a load
change between rounds cancels), the estimate is the median of those ratios and its confidence interval the
distribution-free one of a median (order statistics of the binomial), narrowed until it is within a tolerance or
clear of a budget."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

Clock = Callable[[], float]
MIN_ROUNDS = 3  # the fewest rounds a ratio's interval rests on, however long they take


def _timed(fn: Callable[[], object], device: torch.device, clock: Clock = time.perf_counter) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = clock()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return clock() - start


def _rounds(
    fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, clock: Clock
) -> Iterator[dict[str, float]]:
    """Endless rounds of {name: seconds}, each in an order rotated by one place from the last, after `warmup`
    untimed rounds."""
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    shift = 0
    while True:
        yield {name: _timed(fns[name], device, clock) for name in names[shift:] + names[:shift]}
        shift = (shift + 1) % len(names)


def time_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    warmup: int = 1,
    repeats: int = 5,
    min_time: float = 0.0,
    max_rounds: int = 1000,
    clock: Clock = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per call of each fn: `warmup` untimed rounds, then rounds in rotating order — `repeats` at
    least, and more (up to `max_rounds`) until every fn has `min_time` seconds timed, as timeit's autorange
    does: a 10 ms call gets a hundred samples, so one slow round on a shared machine cannot move its median.
    `clock`: seconds now (a fake clock in tests)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for count, timed in enumerate(_rounds(fns, device, warmup, clock), 1):
        for name, seconds in timed.items():
            times[name].append(seconds)
        if count >= repeats and (count >= max_rounds or min(map(sum, times.values())) >= min_time):
            return times
    raise AssertionError("unreachable: the rounds never end")


def median(values: list[float]) -> float:
    return statistics.median(values)


def median_interval(values: list[float], confidence: float = 0.9) -> tuple[float, float]:
    """Distribution-free confidence interval of the median of `values`: the order statistics (j, n + 1 − j) with
    the largest j whose binomial(n, 1/2) tail stays within (1 − confidence) / 2 (the widest, min and max, when no j
    does: too few values for that confidence)."""
    ordered, n = sorted(values), len(values)
    if not ordered:
        raise ValueError("median_interval needs at least one value")
    tail, j, cumulative = (1 - confidence) / 2, 0, 0.0
    while j < n // 2:
        cumulative += math.comb(n, j) / 2**n  # P(fewer than j + 1 values below the median)
        if cumulative > tail:
            break
        j += 1
    j = max(j, 1)
    return ordered[j - 1], ordered[n - j]


@dataclass(frozen=True)
class RatioInterval:
    """A variant's latency over the baseline's: the median of the per-round paired ratios (`ratio`), its
    confidence interval (`low`, `high`) and the rounds it rests on."""

    ratio: float
    low: float
    high: float
    rounds: int

    @classmethod
    def exact(cls, ratio: float) -> RatioInterval:
        """A ratio known exactly (a stand-in timing, or one read from a file)."""
        return cls(ratio, ratio, ratio, 0)

    @classmethod
    def of(cls, ratios: list[float], confidence: float = 0.9) -> RatioInterval:
        return cls(median(ratios), *median_interval(ratios, confidence), len(ratios))

    def straddles(self, budget: float) -> bool:
        """The budget lies inside the interval: at this noise the ratio may be on either side of it."""
        return self.low <= budget <= self.high and self.low < self.high

    def describe(self) -> str:
        if self.low == self.high:
            return f"{self.ratio:.3f}x"
        return f"{self.ratio:.3f}x [{self.low:.3f}, {self.high:.3f}]"

    def to_dict(self) -> dict[str, float]:
        return {"ratio": self.ratio, "low": self.low, "high": self.high, "rounds": self.rounds}


@dataclass(frozen=True)
class RatioTiming:
    """When `time_ratios` stops adding rounds: at `max_rounds`, or after `max_seconds` (wall clock) with
    MIN_ROUNDS at least, or from `min_rounds` on once every interval (at `confidence`) is within ± `tolerance` of
    its ratio or, when `budget` is given, lies wholly on one side of it (more rounds would not change which side).
    """

    min_rounds: int = 5
    max_rounds: int = 40
    max_seconds: float = 60.0
    tolerance: float = 0.02
    confidence: float = 0.9
    budget: float | None = None

    def settled(self, interval: RatioInterval) -> bool:
        narrow = interval.high - interval.ratio <= self.tolerance and interval.ratio - interval.low <= self.tolerance
        return narrow or (self.budget is not None and not interval.low <= self.budget <= interval.high)


def time_ratios(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    baseline: str = "original",
    rule: RatioTiming = RatioTiming(),
    warmup: int = 1,
    min_time: float = 0.0,
    clock: Clock = time.perf_counter,
) -> dict[str, RatioInterval]:
    """Each fn's latency over `baseline`'s, timed interleaved until `rule` settles (and every fn has `min_time`
    seconds timed): {name: RatioInterval} for every fn but the baseline. Paired per-round ratios, not a ratio of
    medians: on a shared machine whose load drifts, a round's variant and baseline see the same load."""
    if baseline not in fns:
        raise ValueError(f"latency ratios need a baseline named {baseline!r}; got {sorted(fns)}")
    ratios: dict[str, list[float]] = {name: [] for name in fns if name != baseline}
    totals = dict.fromkeys(fns, 0.0)
    started = clock()
    for count, timed in enumerate(_rounds(fns, device, warmup, clock), 1):
        for name, seconds in timed.items():
            totals[name] += seconds
            if name != baseline:
                ratios[name].append(seconds / max(timed[baseline], 1e-12))
        intervals = {name: RatioInterval.of(values, rule.confidence) for name, values in ratios.items()}
        out_of_time = count >= MIN_ROUNDS and clock() - started >= rule.max_seconds
        settled = min(totals.values()) >= min_time and all(map(rule.settled, intervals.values()))
        if count >= rule.max_rounds or out_of_time or (count >= rule.min_rounds and settled):
            return intervals
    raise AssertionError("unreachable: the rounds never end")
