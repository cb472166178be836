"""The local term (`VCAConfig.local_window`) in the conversion planner: costs, sensitivity, search and plan files."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from tests.support.paths import BENCHMARKS
from tests.support.planner import RES, image_folder, synthetic_info, synthetic_measurements, tiny_dinov2
from vca_patch import patch_model, unpatch_model
from vca_patch.cli.app import app
from vca_patch.planner import (
    Candidate,
    PlanError,
    candidates,
    load_plan,
    model_info,
    plan_config,
    plan_model,
    save_plan,
)
from vca_patch.planner import costs as costs_module
from vca_patch.planner import planner as planner_module
from vca_patch.planner.costs import measure_latency_table, plan_macs
from vca_patch.planner.planner import apply_plan
from vca_patch.planner.sensitivity import measure_sensitivity
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.layer import VisualContrastAttention


def test_the_flop_model_counts_the_local_term_of_each_vca_block():
    info = synthetic_info()
    plain = plan_macs(info, RES, [0, 0, 3, 3], {0: 4, 1: 4})
    local = plan_macs(info, RES, [0, 0, 3, 3], {0: 4, 1: 4}, local_window=3)
    # per VCA block: every one of the 4x4 patches reads 1 prefix + 3x3 neighbour keys, logits and values (C = 64)
    assert local - plain == pytest.approx(2 * (2 * 16 * (1 + 9) * 64))
    assert plan_macs(info, RES, [0] * 4, {}, local_window=3) == plan_macs(info, RES, [0] * 4, {})  # no VCA: nothing


def test_sensitivity_measures_vca_with_the_local_term():
    """On a 4x4 grid a 7x7 window covers every patch: calibrated, the term can carry the whole attention, so each
    block's loss all but vanishes where VCA alone loses about 1e-4 of patch-token cosine."""
    torch.manual_seed(0)
    model = tiny_dinov2()
    info = model_info(model)
    images = torch.randn(6, 3, RES, RES)
    kwargs = {"contrast_tokens": [4], "merge_starts": [], "merge_fractions": []}
    plain = measure_sensitivity(model, info, images, RES, **kwargs)
    local = measure_sensitivity(model, info, images, RES, local_window=7, **kwargs)
    assert local.local_window == 7 and plain.local_window == 0
    assert local.to_dict()["vca_local_window"] == 7
    for block in range(4):
        assert plain.vca[(block, 4)].patch > 2e-5
        assert local.vca[(block, 4)].patch < 0.05 * plain.vca[(block, 4)].patch
    assert not hasattr(model, "vca_patch_state")  # left as it came


def test_the_latency_table_times_vca_blocks_with_the_term(monkeypatch):
    model = tiny_dinov2()
    seen = []

    def recording(net, config, *args, **kwargs):
        seen.append(config)
        return patch_model(net, config, *args, **kwargs)

    monkeypatch.setattr(costs_module, "patch_model", recording)
    table = measure_latency_table(model, model_info(model), RES, [4], repeats=1, local_window=3)
    assert [c.local_window for c in seen if isinstance(c, VCAConfig)] == [3]
    assert table.local_window == 3 and table.vca_s[4] > 0 and table.to_dict()["vca_local_window"] == 3


def test_the_search_carries_the_term_into_candidates_and_plan_configs():
    info, table, sens = synthetic_measurements()
    table.local_window = sens.local_window = 3
    cands = candidates(info, RES, table, sens, "both")
    with_vca = [c for c in cands if c.vca_layers]
    assert with_vca and all(c.local_window == 3 and "VCA (local 3x3)" in c.describe() for c in with_vca)
    assert all(c.local_window == 0 for c in cands if not c.vca_layers)
    base = plan_macs(info, RES, [], {})
    for cand in with_vca:
        macs = plan_macs(info, RES, cand.schedule, cand.vca_layers, local_window=3)
        assert cand.macs_ratio == pytest.approx(macs / base)
        assert plan_config(cand, info).vca == {"token_magnitude": True, "local_window": 3}
        assert plan_config(cand, info, calibrate=False).vca == {"local_window": 3}
        assert cand.to_dict()["local_window"] == 3
    merging = next(c for c in cands if c.merging_only and any(c.schedule))
    assert plan_config(merging, info).vca == {}
    table.local_window = 0
    with pytest.raises(PlanError, match="timed with local_window=0 but measured with local_window=3"):
        candidates(info, RES, table, sens, "both")


def test_a_plan_with_the_term_round_trips_applies_calibrated_and_unpatches(tmp_path):
    model = tiny_dinov2()
    info = model_info(model)
    images = torch.randn(4, 3, RES, RES)
    with torch.no_grad():
        reference = model.forward_features(images)
    config = plan_config(Candidate([0] * 4, {0: 4, 1: 4}, local_window=7), info)  # 7x7 covers the 4x4 grid
    path = save_plan(tmp_path / "plan.json", config, {})
    assert load_plan(path) == config and json.loads(path.read_text())["config"]["vca"]["local_window"] == 7
    raw = apply_plan(copy.deepcopy(model), load_plan(path))
    tuned = apply_plan(copy.deepcopy(model), load_plan(path), images)
    for net in (raw, tuned):
        layers = [m for m in net.modules() if isinstance(m, VisualContrastAttention)]
        assert len(layers) == 2 and all(layer.local_window == 7 for layer in layers)
    with torch.no_grad():
        error_raw = (raw.forward_features(images) - reference).norm()
        error_tuned = (tuned.forward_features(images) - reference).norm()
    assert error_tuned < 0.01 * error_raw  # calibration fits the term's mix (off until then), which can carry it all
    unpatch_model(tuned)
    with torch.no_grad():
        torch.testing.assert_close(tuned.forward_features(images), reference)


def test_plan_model_with_the_term_and_a_bad_window_refused_before_timing(monkeypatch):
    model = tiny_dinov2()
    images = torch.randn(4, 3, RES, RES)
    result = plan_model(
        model, images, budget=4.0, resolution=RES, contrast_tokens=(4,), merge_starts=(2,), merge_fractions=(0.5,),
        mano_windows=(), local_window=3, measure=False, repeats=1, min_time=0,
    )  # fmt: skip
    assert result.table.local_window == result.sensitivity.local_window == 3
    assert all(c.local_window == 3 for c in result.candidates if c.vca_layers)
    details = result.details("tiny")
    assert details["latency_table"]["vca_local_window"] == details["sensitivity"]["vca_local_window"] == 3
    if result.chosen.vca_layers:
        assert result.config.vca["local_window"] == 3
    monkeypatch.setattr(planner_module, "measure_latency_table", None)  # nothing is timed before the checks
    for bad in (4, -1, True):
        with pytest.raises(PlanError, match="local_window must be 0 \\(none\\) or an odd window side"):
            plan_model(model, images, budget=0.5, resolution=RES, local_window=bad)


def test_cli_plan_takes_a_local_window_and_refuses_an_even_one(tmp_path):
    image_folder(tmp_path / "images", 2)
    out = tmp_path / "plan.json"
    args = [
        "plan", "vit_tiny_patch16_224", "--no-pretrained", "--calibration-data", str(tmp_path / "images"),
        "--resolution", "64", "--budget", "2.0", "--images", "2", "--contrast-tokens", "4", "--mano-windows", "none",
        "--merge-fractions", "0.5", "--repeats", "1", "--min-time", "0", "-o", str(out),
    ]  # fmt: skip
    bad = CliRunner().invoke(app, [*args, "--local-window", "4"])
    assert bad.exit_code == 2 and "local_window must be 0 (none) or an odd window side" in bad.output
    assert not out.exists()
    good = CliRunner().invoke(app, [*args, "--local-window", "3"])
    assert good.exit_code == 0, good.output
    data = json.loads(out.read_text())
    assert data["latency_table"]["vca_local_window"] == 3
    if data["config"]["vca_layers"]:
        assert data["config"]["vca"]["local_window"] == 3


def test_planner_benchmark_quick_mode_with_the_term(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_bench", BENCHMARKS / "planner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    with pytest.raises(SystemExit) as refused:
        bench.main(["--quick", "--local-window", "4", "--results", str(tmp_path)])
    assert refused.value.code == 2 and not list(tmp_path.iterdir())
    assert bench.main(["--quick", "--threads", "1", "--local-window", "3", "--results", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "planner_quick_local3.json").read_text())
    assert results["settings"]["local_window"] == 3
    size = results["sizes"]["56"]
    assert size["latency_table"]["vca_local_window"] == size["sensitivity"]["vca_local_window"] == 3
    assert len(size["sensitivity"]["vca"]) == 4  # VCA(4) with the term, measured in each of the 4 blocks
    for name, row in size["rows"].items():  # at 56 px the plans it picks are usually merging-only
        if row["config"]["vca_layers"]:
            assert row["config"]["vca"]["local_window"] == 3 and "local 3x3" in name
    assert (tmp_path / "planner_quick_local3.md").exists()
