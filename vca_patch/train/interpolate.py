"""Weight-space interpolation between a recovery's start and its end (WiSE-FT: Wortsman et al., CVPR 2022).

θ(t) = (1 − t)·θ_start + t·θ_end. Recovery trains on the photos it has; the calibrated start was fitted in closed form
on others. On real DINOv2 weights the midpoint (t = 0.5, WiSE-FT's default) kept more of the original on held-out
images than either end (see the README). Choosing t on the calibration crops does not work there: the recovery
trained on their photos too, so they favour its end.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


def interpolated_state(
    start: Mapping[str, torch.Tensor], end: Mapping[str, torch.Tensor], t: float
) -> dict[str, torch.Tensor]:
    """(1 − t)·start + t·end for every floating-point entry (others from `end`); the keys must match."""
    if set(start) != set(end):
        missing, extra = sorted(set(end) - set(start)), sorted(set(start) - set(end))
        raise ValueError(f"the two states differ: only in the end {missing[:3]}, only in the start {extra[:3]}")
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"t must be in [0, 1], got {t}")
    out = {}
    for key, value in end.items():
        if value.is_floating_point():
            out[key] = torch.lerp(start[key].to(device=value.device, dtype=value.dtype), value, t)
        else:
            out[key] = value
    return out
