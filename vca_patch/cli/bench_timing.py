"""The `vca-patch bench` options that every sweep (ViT, hierarchical, diffusion) shares."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchTiming:
    """What a sweep runs on and how it times: batch size, device, dtype, repeats, minimum time per
    measurement (s), warm-up calls and CPU threads (None: torch's default)."""

    batch: int
    device: str
    dtype: str
    repeats: int
    min_time: float
    warmup: int
    threads: int | None
