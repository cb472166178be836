"""benchmarks/merge_schedules.py: merge schedules of one shape each, at no more than constant r = N/12's cost."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.support.paths import BENCHMARKS


def _module():
    spec = importlib.util.spec_from_file_location("merge_schedules", BENCHMARKS / "merge_schedules.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_shape_is_the_cheapest_of_its_kind_within_constant_r_cost():
    def cost(schedule):  # tokens left entering each of 6 blocks, from 120 patches (a stand-in for the FLOP model)
        left, total = 120, 0
        for r in schedule:
            total += left
            left -= min(r, (left + 1) // 2)
        return total / 720

    shapes = _module().schedules(6, 120, cost)
    target = cost([10] * 6)
    assert shapes["10 in every block"] == [10] * 6
    assert all(cost(s) <= target + 1e-9 for s in shapes.values())
    # 20 then r: 120 + 100 + 4 blocks of (100 - k r) cost 620 - 10 r <= 570 (constant 10's) from r = 5 on
    assert shapes["20, then 5"] == [20, 5, 5, 5, 5, 5] and cost([20, 4, 4, 4, 4, 4]) > target
    assert shapes["40, then 0"] == [40, 0, 0, 0, 0, 0]  # 120 + 5 x 80 = 520: no r needed after it
    assert shapes["30 in blocks 0 and 1"][:2] == [30, 30]
    falling = next(s for label, s in shapes.items() if "falling" in label)
    assert falling[-1] == 0 and falling == sorted(falling, reverse=True)


@pytest.mark.e2e
def test_a_small_size_is_measured_on_the_calibration_crops(tmp_path):
    result = _module().main(["--size", "56", "--images", "2", "--results", str(tmp_path)])
    saved = json.loads((tmp_path / "merge_schedules_56.json").read_text())
    assert saved["rows"] and saved["calibration_crops"] == 2 and set(saved["rows"]) == set(result["rows"])
    assert all(0 < row["cls_cosine"] <= 1 + 1e-9 for row in saved["rows"].values())
