"""Measurements a target adds to `vca-patch bench` beside the latency sweep (e.g. DIDB's binarised Linears in their
three forms), registered by the module that measures them, looked up by the variant's target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from vca_patch.core.registry import Registry


@dataclass(frozen=True)
class BenchExtra:
    """`measure(model, rows, warmup=, repeats=, min_time=)` -> JSON-able numbers, stored under `key`;
    `table(numbers)` -> what the CLI prints; `devices`: where it can run."""

    key: str
    measure: Callable[..., dict[str, Any]]
    table: Callable[[dict[str, Any]], Any]
    devices: tuple[str, ...] = ("cpu",)


BENCH_EXTRAS: Registry[BenchExtra] = Registry("bench extra")


def register_bench_extra(target: str, extra: BenchExtra) -> BenchExtra:
    """Add `extra` to every `bench` run of `target` (the variant named after it); a target holds one extra (another
    is refused: `unregister_bench_extra` it first), the same extra again is a no-op."""
    return BENCH_EXTRAS.register(target, extra)


def unregister_bench_extra(target: str) -> BenchExtra:
    """Remove the bench extra of `target`; the extra."""
    return BENCH_EXTRAS.unregister(target)


def run_extras(variants: list[Any], rows: int, device: str, **timing: Any) -> list[tuple[BenchExtra, dict[str, Any]]]:
    """Each registered extra for the variants that carry a target, where it can run: [(extra, numbers)]."""
    done = []
    for variant in variants:
        extra = BENCH_EXTRAS.get(variant.target or "")
        if extra is not None and variant.name == variant.target and device in extra.devices:
            model: nn.Module = variant.model
            done.append((extra, extra.measure(model, rows, **timing)))
    return done
