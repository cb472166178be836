"""Weight-space interpolation between a recovery's start and end (WiSE-FT)."""

from __future__ import annotations

import pytest
import torch

from vca_patch.train.interpolate import interpolated_state


def _states():
    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(4, 3, generator=g, dtype=torch.float64), "n": torch.tensor(3)}
    end = {"w": torch.randn(4, 3, generator=g, dtype=torch.float64), "n": torch.tensor(7)}
    return start, end


@pytest.mark.parametrize("t", [0.0, 0.3, 1.0])
def test_interpolated_state_is_the_weighted_mean_and_keeps_integer_entries_from_the_end(t):
    start, end = _states()
    out = interpolated_state(start, end, t)
    expected = (1 - t) * start["w"] + t * end["w"]  # float64, the weighted mean written out
    torch.testing.assert_close(out["w"], expected, rtol=0, atol=1e-15)
    assert int(out["n"]) == 7


def test_mismatched_states_and_t_outside_the_segment_are_refused():
    start, end = _states()
    with pytest.raises(ValueError, match="only in the end"):
        interpolated_state({"w": start["w"]}, end, 0.5)
    with pytest.raises(ValueError, match=r"t must be in \[0, 1\]"):
        interpolated_state(start, end, 1.5)
