"""The level hierarchy of Multipole Attention: grid sides, windows and padding per level, V-cycle weights.

Level ℓ + 1 coarsens level ℓ by `rate` r with ceiling division (a partial r×r cell at the bottom/right
edge is still one coarse cell). Each level is cut into k×k windows, clipped to the level's side where
the side is smaller than k (so a window ≥ grid is one global window) and padded up to a multiple of k
where the side is larger but not divisible. All integer arithmetic (docs/mano.md §3.2).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    """One level: its real grid, the window used on it, and the grid padded to whole windows."""

    grid: tuple[int, int]
    window: tuple[int, int]
    padded: tuple[int, int]

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    @property
    def num_windows(self) -> int:
        return (self.padded[0] // self.window[0]) * (self.padded[1] // self.window[1])

    @property
    def window_tokens(self) -> int:
        return self.window[0] * self.window[1]


def auto_num_levels(grid: tuple[int, int], window: int, rate: int) -> int:
    """Fewest levels whose coarsest grid fits in one window (global receptive field in one layer)."""
    if rate < 2:
        raise ValueError(f"rate must be an integer ≥ 2, got {rate}")
    H, W = grid
    levels = 1
    while max(H, W) > window:
        H, W = -(-H // rate), -(-W // rate)
        levels += 1
    return levels


def plan_levels(
    grid: tuple[int, int], window: int, rate: int, levels: int | None = None, pad: bool = True
) -> list[Level]:
    """The levels for a grid (H ≠ W allowed); `levels=None` picks `auto_num_levels`.

    Raises ValueError when the configuration cannot work: rate < 2, window < 1, a level count that
    coarsens past a 1×1 grid, or (with pad=False) a side that the rate or the window does not divide.
    """
    if rate < 2:
        raise ValueError(f"rate must be an integer ≥ 2, got {rate}")
    if window < 1:
        raise ValueError(f"window must be a positive integer, got {window}")
    if min(grid) < 1:
        raise ValueError(f"grid must be positive, got {grid}")
    num_levels = auto_num_levels(grid, window, rate) if levels is None else levels
    if num_levels < 1:
        raise ValueError(f"levels must be ≥ 1 (or None for auto), got {levels}")
    plan: list[Level] = []
    H, W = grid
    for index in range(num_levels):
        if index:
            if (H, W) == (1, 1):
                raise ValueError(
                    f"levels={num_levels} coarsens the {grid[0]}x{grid[1]} grid past 1x1 at level {index} "
                    f"(rate {rate}); use at most {index} levels or levels=None"
                )
            if not pad and (H % rate or W % rate):
                raise ValueError(
                    f"level {index - 1} grid {H}x{W} is not divisible by rate {rate}; enable padding (pad=True) "
                    "or choose a rate/levels that divide the grid"
                )
            H, W = -(-H // rate), -(-W // rate)
        kh, kw = min(window, H), min(window, W)
        padded = (-(-H // kh) * kh, -(-W // kw) * kw)  # integer ceil: traced sizes stay SymInts (export)
        if not pad and padded != (H, W):
            raise ValueError(
                f"level {index} grid {H}x{W} is not divisible by window {window}; enable padding (pad=True) "
                "or choose a window that divides every level"
            )
        plan.append(Level((H, W), (kh, kw), padded))
    return plan


def vcycle_weights(num_levels: int) -> list[float]:
    """w_ℓ = 1/(L−1−ℓ) for ℓ = 0..L−2: Z^ℓ = Y^ℓ + w_ℓ·U(Z^{ℓ+1}) (docs/mano.md §2.2)."""
    return [1.0 / (num_levels - 1 - level) for level in range(num_levels - 1)]


def vcycle_coefficients(num_levels: int) -> list[float]:
    """c_ℓ of the unrolled V-cycle Z⁰ = Σ_ℓ c_ℓ·U^ℓ(Y^ℓ): c_ℓ = (L−1−ℓ)!/(L−1)!."""
    top = math.factorial(num_levels - 1)
    return [math.factorial(num_levels - 1 - level) / top for level in range(num_levels)]
