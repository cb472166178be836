"""Where a patched/original ratio falls below 1 along a sweep of sequence lengths."""

from __future__ import annotations

import math
from collections.abc import Sequence


def crossover(xs: Sequence[float], ratios: Sequence[float | None]) -> float | None:
    """The x at which `ratio` first drops below 1, interpolated linearly in log(x) between measurements.

    xs ascending (tokens or pixels). Returns xs[0] when the first ratio is already below 1, None when no
    ratio is (or every ratio is missing). A later rise above 1 is ignored: the first crossing counts.
    """
    points = [(x, r) for x, r in zip(xs, ratios, strict=True) if r is not None]
    for i, (x, r) in enumerate(points):
        if r < 1.0:
            if i == 0:
                return float(x)
            x0, r0 = points[i - 1]
            t = (r0 - 1.0) / (r0 - r)  # r0 >= 1 > r
            return math.exp(math.log(x0) + t * (math.log(x) - math.log(x0)))
    return None
