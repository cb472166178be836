"""benchmarks/calibration_time.py: the real DINOv2 ViT-S/14 calibrated at a size, timed, with the load around it
and each layer's progress."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from tests.support.paths import BENCHMARKS

pytestmark = pytest.mark.e2e


def test_one_small_size_is_calibrated_and_timed(capsys):
    spec = importlib.util.spec_from_file_location("calibration_time", BENCHMARKS / "calibration_time.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    (row,) = module.main(["--sizes", "56", "--images", "2", "--threads", "1"])
    assert row["size"] == 56 and row["images"] == 2 and row["threads"] == 1 and row["seconds"] > 0
    assert len(row["load_before"]) == 3 and len(row["load_after"]) == 3
    assert "56 px: 12/12 blocks.11.attn" in capsys.readouterr().err  # progress after every layer, the last one too
