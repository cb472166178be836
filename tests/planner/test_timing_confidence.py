"""Paired, confidence-checked timing (`bench.timing.time_ratios`) on a deterministic fake clock: no wall clock."""

from __future__ import annotations

import itertools

import pytest
import torch

from vca_patch.bench.timing import RatioInterval, RatioTiming, median_interval, time_interleaved, time_ratios

CPU = torch.device("cpu")


class FakeClock:
    """A clock that only moves when a fake call runs: each call advances it by its scripted duration."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def call(self, durations):
        """A fn whose k-th call takes durations(k) seconds of fake time."""
        counter = itertools.count()

        def run() -> None:
            self.now += durations(next(counter))

        return run


def test_the_median_interval_is_the_binomial_order_statistics():
    values = list(range(1, 21))  # shuffled order must not matter
    assert median_interval(values[::-1], 0.9) == (6, 15)  # P(B <= 5) = 0.021 <= 0.05 < P(B <= 6) = 0.058
    assert median_interval(list(range(1, 11)), 0.9) == (2, 9)
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0], 0.9) == (1.0, 5.0)  # too few for better: the widest
    assert median_interval([7.0], 0.9) == (7.0, 7.0)
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_ratios_are_paired_per_round_so_a_drifting_load_cancels():
    clock = FakeClock()
    load = [1.0, 3.0, 1.5, 4.0, 2.0, 2.5, 1.2]  # the machine's load changes from round to round
    fns = {
        "original": clock.call(lambda k: 0.2 * load[k % len(load)]),
        "plan": clock.call(lambda k: 0.1 * load[k % len(load)]),  # half the original's time in every round
    }
    timed = time_ratios(fns, CPU, rule=RatioTiming(min_rounds=5), warmup=0, clock=clock)
    # every round's pair reads 0.5 however loaded the round: the interval is a point (pairing across rounds, or
    # timing the two apart, would read the load's swings as noise)
    assert timed["plan"] == RatioInterval(pytest.approx(0.5), pytest.approx(0.5), pytest.approx(0.5), 5)
    samples = time_interleaved(fns, CPU, warmup=0, repeats=7, clock=clock)
    assert max(samples["plan"]) > 2 * min(samples["plan"])  # the times alone swing with the load


def test_rounds_are_added_until_each_interval_is_narrow_or_clear_of_the_budget():
    clock = FakeClock()
    noisy = [0.40, 0.60, 0.45, 0.55, 0.50, 0.52, 0.48, 0.51, 0.49, 0.50, 0.50, 0.50]
    fns = {"original": clock.call(lambda k: 1.0), "plan": clock.call(lambda k: noisy[k % len(noisy)])}
    narrow = time_ratios(fns, CPU, rule=RatioTiming(min_rounds=5, max_rounds=40, tolerance=0.02), warmup=0,
                         clock=clock)  # fmt: skip
    assert narrow["plan"].rounds > 5 and narrow["plan"].high - narrow["plan"].low <= 0.04 + 1e-9
    clear = time_ratios(fns, CPU, rule=RatioTiming(min_rounds=5, tolerance=0.001, budget=0.7), warmup=0, clock=clock)
    assert clear["plan"].rounds == 5 and clear["plan"].high < 0.7  # [0.40, 0.60] is below 0.7 already: stop
    capped = time_ratios(fns, CPU, rule=RatioTiming(min_rounds=5, max_rounds=8, tolerance=0.0), warmup=0, clock=clock)
    assert capped["plan"].rounds == 8


def test_a_time_cap_stops_a_machine_too_noisy_to_settle_and_the_interval_says_so():
    clock = FakeClock()
    wild = [0.3, 0.9]
    fns = {"original": clock.call(lambda k: 1.0), "plan": clock.call(lambda k: wild[k % 2])}
    rule = RatioTiming(min_rounds=5, max_rounds=1000, max_seconds=20.0, tolerance=0.01, budget=0.5)
    timed = time_ratios(fns, CPU, rule=rule, warmup=0, clock=clock)
    assert timed["plan"].rounds == 13  # rounds take 1.3 s and 1.9 s in turn: past the 20 s cap after 13
    assert timed["plan"].straddles(0.5) and "[0.300, 0.900]" in timed["plan"].describe()
    assert not RatioInterval(0.45, 0.44, 0.46, 9).straddles(0.5) and not RatioInterval.exact(0.5).straddles(0.5)


def test_time_ratios_needs_its_baseline_and_honours_min_time():
    clock = FakeClock()
    fns = {"original": clock.call(lambda k: 1 / 64), "plan": clock.call(lambda k: 1 / 128)}
    with pytest.raises(ValueError, match="baseline named 'original'"):
        time_ratios({"plan": fns["plan"]}, CPU, clock=clock)
    timed = time_ratios(fns, CPU, rule=RatioTiming(min_rounds=5), warmup=0, min_time=0.125, clock=clock)
    assert timed["plan"].rounds == 16 and timed["plan"].ratio == 0.5  # the 1/128 s plan: 16 rounds for 0.125 s


def test_the_time_cap_stops_below_min_rounds_but_never_below_three():
    clock = FakeClock()
    fns = {"original": clock.call(lambda k: 10.0), "plan": clock.call(lambda k: 5.0 + k % 2)}
    rule = RatioTiming(min_rounds=5, max_seconds=1.0, tolerance=0.0)
    assert time_ratios(fns, CPU, rule=rule, warmup=0, clock=clock)["plan"].rounds == 3
