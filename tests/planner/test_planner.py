"""The conversion planner: cost model, search, plan files, the CLI and the benchmark's quick mode (tiny models)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from tests.support.paths import BENCHMARKS
from tests.support.planner import RES, image_folder, synthetic_info, synthetic_measurements, tiny_dinov2
from vca_patch import patch_model, unpatch_model
from vca_patch.bench.timing import RatioInterval
from vca_patch.cli.app import app
from vca_patch.core.errors import ConfigError
from vca_patch.planner import (
    Candidate,
    PlanError,
    candidates,
    choose,
    choose_measured,
    load_plan,
    model_info,
    pareto,
    plan_config,
    plan_model,
    planned_unmerge,
    save_plan,
)
from vca_patch.planner.costs import LatencyTable, measure_latency_table, plan_macs, token_counts
from vca_patch.planner.planner import MIN_SAVING, apply_plan
from vca_patch.planner.sensitivity import Loss, MergeSchedule
from vca_patch.targets.merge import MergeConfig


def test_token_counts_and_the_flop_model_by_hand():
    info = synthetic_info()
    # 17 tokens, 1 prefix: a merge can take at most ceil(patches / 2)
    assert token_counts(info, RES, [0, 5, 3, 9]) == [17, 17, 12, 9]
    assert token_counts(info, RES, [20, 20, 20, 20]) == [17, 9, 5, 3]
    counts = token_counts(info, RES, [0, 5, 3, 0])
    expected = sum(n * 12 * 64 * 64 + 2 * n * n * 64 for n in counts)
    assert plan_macs(info, RES, [0, 5, 3, 0], {}) == pytest.approx(expected)
    vca = 8 * 4 * 17 * 64 + 9 * 16 * 64 + 2 * 1 * 17 * 64  # VCA(4) with the exact prefix read-out in block 0
    assert plan_macs(info, RES, [0, 5, 3, 0], {0: 4}) == pytest.approx(expected - 2 * 17 * 17 * 64 + vca)


def test_search_predicts_additively_and_chooses_the_best_plan_within_budget():
    info, table, sens = synthetic_measurements()
    cands = candidates(info, RES, table, sens, "both")
    for cand in cands:  # predicted fidelity adds the measured losses of the parts
        first = next((i for i, r in enumerate(cand.schedule) if r), None)
        merge = sens.merge[MergeSchedule(first, cand.schedule[first])] if first is not None else Loss(0, 0)
        assert all(block < (first if first is not None else 4) for block in cand.vca_layers)  # VCA before merging
        cls = 1 - merge.cls - sum(sens.vca[(b, n)].cls for b, n in cand.vca_layers.items())
        assert cand.cls == pytest.approx(cls)
        counts = token_counts(info, RES, cand.schedule)
        blocks = sum(table.vca_s[cand.vca_layers[i]] if i in cand.vca_layers else np.interp(t, [3, 17], [0.05, 0.2])
                     for i, t in enumerate(counts))  # fmt: skip
        assert cand.latency == pytest.approx(0.2 + blocks)
    best = choose(cands, 0.75, "both")
    fitting = [c for c in cands if c.latency <= 0.75]
    assert best.latency <= 0.75 and best.score("both") == max(c.score("both") for c in fitting)
    front = pareto(cands, "both")
    assert all(not (o.latency <= f.latency and o.score("both") > f.score("both")) for f in front for o in cands)
    merging_front = pareto([c for c in cands if c.merging_only], "both")
    for point in merging_front:  # the planner's front is never below merging alone
        assert max(f.score("both") for f in front if f.latency <= point.latency) >= point.score("both")


def test_an_impossible_budget_names_the_fastest_plan_measured_else_predicted():
    info, table, sens = synthetic_measurements()
    cands = candidates(info, RES, table, sens, "cls")
    fastest = min(cands, key=lambda c: c.latency)
    with pytest.raises(PlanError, match=rf"budget 0.10x: the fastest plan, {re.escape(fastest.describe())}, is "
                       rf"predicted at {fastest.latency:.2f}x \(not timed\)"):  # fmt: skip
        choose(cands, 0.1, "cls")
    # once plans are timed, the fastest *measured* one is named, with its measured ratio and interval
    merge = next(c for c in cands if c.merging_only and any(c.schedule))
    timed = [*cands, dataclasses.replace(merge, measured_latency=RatioInterval(0.52, 0.51, 0.53, 7))]
    with pytest.raises(PlanError) as error:
        choose(timed, 0.1, "cls", merge_fractions=(0.5, 2.0))
    message = str(error.value)
    assert f"the fastest measured plan, {merge.describe()}, runs 0.520x [0.510, 0.530]" in message
    assert "lower resolution" in message and "smaller model" in message and "\n" not in message
    assert "--merge-fractions" not in message  # the fractions already reach the largest merging there is
    with pytest.raises(PlanError, match=r"merge more \(--merge-fractions up to 2\)"):
        choose(timed, 0.1, "cls", merge_fractions=(0.5, 0.95))
    with pytest.raises(PlanError, match="positive latency ratio"):
        choose(cands, 0.0, "cls")


def test_the_search_scores_a_front_loaded_schedule_by_its_own_measured_loss():
    info, table, sens = synthetic_measurements()
    sens.merge[MergeSchedule(0, 1, 8)] = Loss(0.004, 0.05)  # measured alone, like every schedule
    cands = {c.describe(): c for c in candidates(info, RES, table, sens, "both")}
    front = cands["merge 8 in block 0, then r=1"]
    assert front.schedule == [8, 1, 1, 1] and (front.cls, front.patch) == pytest.approx((0.996, 0.95))
    counts = token_counts(info, RES, front.schedule)
    assert counts == [17, 9, 8, 7]
    assert front.latency == pytest.approx(0.2 + sum(np.interp(t, [3, 17], [0.05, 0.2]) for t in counts))


def test_nothing_is_faster_only_when_nothing_measured_is():
    slower = [
        Candidate([0, 0, 0, 0]),
        Candidate([0, 2, 2, 2], latency=1.04),
        Candidate([0, 0, 0, 0], {1: 4}, latency=1.2),
    ]
    nothing = "nothing measured is faster"
    with pytest.raises(PlanError, match=rf"original \(softmax everywhere\), is predicted at 1\.00x.*{nothing}"):
        choose(slower, 0.8, "cls")
    # predicted slower, but measured faster than the original: never "nothing measured is faster"
    slower[1] = dataclasses.replace(slower[1], measured_latency=RatioInterval(0.9, 0.88, 0.92, 6))
    with pytest.raises(PlanError) as error:
        choose(slower, 0.8, "cls")
    assert "merge r=2 from block 1, runs 0.900x" in str(error.value) and nothing not in str(error.value)
    slower[1] = dataclasses.replace(slower[1], measured_latency=RatioInterval(1.1, 1.05, 1.2, 6))
    with pytest.raises(PlanError, match=rf"runs 1\.100x \[1\.050, 1\.200\].*{nothing} than the original"):
        choose(slower, 0.8, "cls")
    slower[1] = dataclasses.replace(slower[1], measured_latency=RatioInterval(1.05, 0.7, 1.2, 6))  # a loaded machine
    with pytest.raises(PlanError) as error:
        choose(slower, 0.8, "cls")
    assert "its interval holds the budget" in str(error.value) and nothing not in str(error.value)


def test_plan_model_end_to_end_and_the_plan_file(tmp_path):
    model = tiny_dinov2()
    images = torch.randn(3, 3, RES, RES)
    with torch.no_grad():
        reference = model.forward_features(images)
    lines: list[str] = []
    result = plan_model(  # at 56 px merging costs more than it saves: a budget of 4x lets it be a finalist
        model, images, budget=4.0, resolution=RES, contrast_tokens=(4,), merge_starts=(0, 2), merge_fractions=(0.5,),
        calibrate=False, repeats=3, min_time=0.05, log=lines.append,
    )  # fmt: skip
    assert result.chosen.latency <= 4.0 * 1.05 and result.measured["latency_ratio"] > 0
    # the merge schedules whose plans the latency model puts within reach (which depends on this run's timings:
    # on a loaded machine one of the two read out of reach)
    # (16 patches: front-loaded leads of 0.25 and 0.33 of them merge 4 and 5 tokens in the first merging block)
    searched = {MergeSchedule(0, 2), MergeSchedule(0, 2, 4), MergeSchedule(0, 2, 5), MergeSchedule(2, 4)}
    assert set(result.sensitivity.merge) and set(result.sensitivity.merge) <= searched | {MergeSchedule(2, 4, 5)}
    pays = result.table.paying("vca", MIN_SAVING) == [4]  # at 17 tokens VCA(4) rarely saves time
    assert len(result.sensitivity.vca) == (4 if pays else 0)
    assert pays or any("VCA n=4: a block takes" in line and "does not pay here" in line for line in lines)
    assert set(result.timed.plans) >= {"merge r=2 from block 0"}  # an anchor: timed against the original first
    assert model_info(model).depth == 4 and not hasattr(model, "vca_patch_state")  # left as it came
    path = save_plan(tmp_path / "plan.json", result.config, result.details("tiny"))
    data = json.loads(path.read_text())
    tokens = result.info.tokens(RES)  # the resolution and token counts the plan was made for
    assert data["model"] == {"name": "tiny", "depth": 4, "dim": 64, "num_heads": 4, "resolution": RES,
                             "tokens": tokens, "patch_tokens": tokens - result.info.num_prefix_tokens}  # fmt: skip
    assert result.finalist["latency_ratio"] > 0 and "cls_per_image" in result.finalist  # timed and scored
    assert data["finalist"]["cls_cosine"] == result.finalist["cls_cosine"] and "cls_per_image" not in data["finalist"]
    interval = result.latency  # the chosen plan's timing, reused as its measured latency: timed once
    assert interval.low <= result.measured["latency_ratio"] == interval.ratio <= interval.high
    assert data["latency_interval"] == interval.to_dict() and data["timed"][result.chosen.describe()]["rounds"] >= 3
    config = load_plan(path)
    assert config == result.config and config.expect == {"depth": 4, "dim": 64, "num_heads": 4}
    assert config.unmerge == "residual"  # "auto" for the default objective (CLS and patch tokens)
    patch_model(model, config)
    with torch.no_grad():
        out = model.forward_features(images)
    scores = torch.nn.functional.cosine_similarity(out[:, 0], reference[:, 0])
    assert scores.mean().item() == pytest.approx(result.measured["cls_cosine"], abs=0.05)
    unpatch_model(model)


def test_a_residual_unmerge_plan_and_bad_options_failing_first(monkeypatch):
    from vca_patch.planner import planner as planner_module

    model = tiny_dinov2()
    images = torch.randn(3, 3, RES, RES)
    # a budget any plan meets: the check is the plan's unmerge, and a loaded 2-core machine timed this tiny model's
    # merge plan over 1.5x
    result = plan_model(
        model, images, budget=10.0, resolution=RES, contrast_tokens=(), merge_starts=(0,), merge_fractions=(0.5,),
        mano_windows=(), calibrate=False, unmerge="residual", measure=False, repeats=1, min_time=0,
    )  # fmt: skip
    assert result.chosen.measured_latency is not None or result.chosen.describe() == "original (softmax everywhere)"
    assert result.config.unmerge == "residual"
    for objective, unmerge, expected in [
        ("cls", "auto", "copy"),
        ("patch", "auto", "residual"),
        ("cls", "residual", "residual"),
    ]:
        assert planned_unmerge(objective, unmerge) == expected
    monkeypatch.setattr(planner_module, "measure_latency_table", None)  # nothing is timed before the checks
    with pytest.raises(PlanError, match="objective must be one of"):
        plan_model(model, images, budget=0.5, resolution=RES, objective="dense")
    with pytest.raises(PlanError, match="unmerge must be one of"):
        plan_model(model, images, budget=0.5, resolution=RES, unmerge="average")


def test_a_plan_for_another_model_or_a_bad_file_is_refused(tmp_path):
    plan = MergeConfig(r=2, expect={"depth": 4, "dim": 64, "num_heads": 4})
    path = save_plan(tmp_path / "plan.json", plan, {})
    other = tiny_dinov2(depth=3)
    with pytest.raises(ConfigError, match="made for a model with"):
        patch_model(other, load_plan(path))
    assert not hasattr(other, "vca_patch_state") and type(other.blocks[0].attn).__name__ == "Attention"
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    with pytest.raises(PlanError, match="is not a vca-patch plan"):
        load_plan(tmp_path / "bad.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(PlanError, match=r"broken\.json is not valid JSON"):
        load_plan(tmp_path / "broken.json")
    with pytest.raises(PlanError, match="does not exist"):
        save_plan(tmp_path / "missing" / "plan.json", plan, {})


def test_calibrating_vca_blocks_of_a_merging_plan():
    model = tiny_dinov2()
    images = torch.randn(4, 3, RES, RES)
    with torch.no_grad():
        reference = model.forward_features(images)
    config = plan_config(Candidate([0, 0, 3, 3], {0: 4, 1: 4}), model_info(model), calibrate=True)
    raw = apply_plan(_copy(model), config)
    tuned = apply_plan(_copy(model), config, images)
    with torch.no_grad():
        error_raw = (raw.forward_features(images) - reference).norm()
        error_tuned = (tuned.forward_features(images) - reference).norm()
    assert error_tuned < error_raw


def _copy(model):
    import copy

    return copy.deepcopy(model)


def test_cli_plan_then_convert_with_the_plan(tmp_path):
    runner = CliRunner()
    image_folder(tmp_path / "images", 3)
    out = tmp_path / "plan.json"
    args = [
        "plan", "vit_tiny_patch16_224", "--no-pretrained", "--no-calibrate", "--calibration-data",
        str(tmp_path / "images"), "--resolution", "64", "--budget", "2.0", "--images", "2", "--eval-images", "1",
        "--contrast-tokens", "none", "--merge-fractions", "0.5", "--repeats", "3", "--min-time", "0.05",
        "-o", str(out),
    ]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "Predicted and measured" in result.output and out.with_suffix(".png").stat().st_size > 1000
    assert "as a finalist" in result.output  # the timing that chose the plan
    assert load_plan(out).expect == {"depth": 12, "dim": 192, "num_heads": 3}
    assert "--img-size 64" in " ".join(result.output.split())  # the next command, at the plan's resolution
    recorded = json.loads(out.read_text())["model"]
    assert (recorded["resolution"], recorded["tokens"], recorded["patch_tokens"]) == (64, 17, 16)
    bad = runner.invoke(app, [*args, "--force", "--unmerge", "average"])
    assert bad.exit_code == 2 and "--unmerge must be one of auto, copy, residual" in bad.output
    again = runner.invoke(app, args)
    assert again.exit_code == 2 and "exists; pass --force" in again.output

    def convert_with_the_plan(model_name: str, folder):
        return runner.invoke(
            app, ["convert", model_name, "--no-pretrained", "--img-size", "64", "--plan", str(out), "-o", str(folder)]
        )

    converted = convert_with_the_plan("vit_tiny_patch16_224", tmp_path / "converted")
    assert converted.exit_code == 0, converted.output
    config = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert "merge" in json.dumps(config)
    other = runner.invoke(app, ["convert", "vit_tiny_patch16_224", "--no-pretrained", "--plan", str(out), "-o",
                                str(tmp_path / "at224")])  # fmt: skip
    assert other.exit_code == 2 and "was made for 64 px, but the model takes 224×224 px" in other.output
    wrong = convert_with_the_plan("vit_small_patch16_224", tmp_path / "w")
    assert wrong.exit_code != 0 and "made for a model with" in wrong.output
    assert not (tmp_path / "w").exists()


def test_cli_refuses_unreadable_images_and_writes_nothing(tmp_path):
    image_folder(tmp_path / "images", 2)
    (tmp_path / "images" / "2.jpg").write_bytes(b"not an image")
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(
        app,
        [
            "plan",
            "vit_small_patch14_dinov2",
            "--no-pretrained",
            "--calibration-data",
            str(tmp_path / "images"),
            "--resolution",
            str(RES),
            "--images",
            "3",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 2 and "cannot read image" in result.output and "2.jpg" in result.output
    assert not out.exists() and not out.with_suffix(".png").exists()


def test_benchmark_quick_mode(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("planner_bench", BENCHMARKS / "planner.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--quick", "--threads", "1", "--results", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "planner_quick.json").read_text())
    rows = results["sizes"]["56"]["rows"]
    assert {r["kind"] for r in rows.values()} == {"merging", "residual", "planner"}
    for name, row in rows.items():  # ToMe's copy unmerge and the residual one, at the same r: the same CLS token
        if row["kind"] == "residual":
            assert rows[name.replace("residual", "merge")]["cls_cosine"] == row["cls_cosine"]
            assert row["config"]["unmerge"] == "residual"
    for row in rows.values():
        assert row["latency_ratio"] > 0 and -1 <= row["cls_cosine"] <= 1
    assert (tmp_path / "planner_quick.png").stat().st_size > 1000
    assert "| conversion |" in (tmp_path / "planner_quick.md").read_text()


def _planned_name(twin) -> str:
    return Candidate(twin.config.schedule, twin.config.vca_layers or {}).describe()


def _stand_in_twins(monkeypatch, ratios: dict[str, float]) -> None:
    """Planned copies that only carry their config, timed at `ratios` (plan description -> latency ratio)."""
    from types import SimpleNamespace

    from vca_patch.planner import planner as planner_module

    monkeypatch.setattr(
        planner_module, "apply_plan", lambda model, config, calibration=None: SimpleNamespace(config=config)
    )
    monkeypatch.setattr(
        planner_module, "time_plans", lambda model, twins, resolution, **timing: {n: ratios[n] for n in twins}
    )


def test_finalists_are_chosen_on_measured_latency_not_the_prediction(monkeypatch):
    """Predicted latency only shortlists (within the budget plus a slack): a plan predicted a little over the
    budget but measured within it can win, one predicted within but measured over cannot."""
    from vca_patch.planner import planner as planner_module

    model = tiny_dinov2()
    info = model_info(model)
    cands = [
        Candidate([0, 3, 3, 3], {}, latency=0.82, cls=0.99, patch=0.99),  # predicted over 0.8, measures 0.78
        Candidate([0, 4, 4, 4], {}, latency=0.79, cls=0.98, patch=0.98),  # predicted within, measures 0.83
        Candidate([0, 5, 5, 5], {}, latency=0.75, cls=0.95, patch=0.95),  # measures 0.74
        Candidate([0, 1, 1, 1], {}, latency=0.9, cls=1.0, patch=1.0),  # beyond the slack: never measured
    ]
    ratios = dict(zip([c.describe() for c in cands], [0.78, 0.83, 0.74, 0.85], strict=True))
    measured_names = []

    def fake_fidelity(twin, images, reference):
        name = _planned_name(twin)
        measured_names.append(name)
        score = {c.describe(): c.cls for c in cands}[name]
        return {"cls_cosine": score, "patch_token_cosine": score, "cls_per_image": [score], "patch_per_image": [score]}

    _stand_in_twins(monkeypatch, ratios)
    monkeypatch.setattr(planner_module, "plan_fidelity", fake_fidelity)
    images = torch.randn(2, 3, RES, RES)
    chosen, scores = choose_measured(model, info, cands, 0.8, "both", images)
    assert chosen.describe() == cands[0].describe() and scores["latency_ratio"] == 0.78
    assert chosen.measured_latency == RatioInterval.exact(0.78)  # the choice carries its measured latency
    assert cands[3].describe() not in measured_names
    chosen, _ = choose_measured(model, info, cands, 0.8, "both", images, slack=0.0)
    assert chosen.describe() == cands[2].describe()  # without the slack the 0.82 plan is out; 0.79 measures over
    ratios.update({c.describe(): 0.9 for c in cands})  # nothing measures within: the best predicted within is kept
    chosen, _ = choose_measured(model, info, cands, 0.8, "both", images)
    assert chosen.describe() == cands[1].describe()
    with pytest.raises(PlanError, match=r"fastest measured plan, merge r=3 from block 1, runs 0\.900x"):
        choose_measured(model, info, cands[:1], 0.8, "both", images)  # and none predicted within either
    with pytest.raises(PlanError, match="slack"):
        choose_measured(model, info, cands, 0.8, "both", images, slack=-0.1)


def test_the_choice_is_the_best_measured_finalist_never_worse_than_merging_alone(monkeypatch):
    """The additive prediction only ranks: the best predicted plans and the best merging-only one are measured,
    and the best measured within the budget wins (here the predicted favourite measures worst)."""
    from vca_patch.planner import planner as planner_module

    model = tiny_dinov2()
    info = model_info(model)
    schedule = [0, 2, 2, 2]
    cands = [
        Candidate([0, 0, 0, 0], {0: 4, 1: 4}, latency=0.6, cls=0.99, patch=0.99),  # favourite by prediction
        Candidate([0, 0, 0, 0], {0: 4}, latency=0.7, cls=0.98, patch=0.98),
        Candidate(schedule, {}, latency=0.65, cls=0.95, patch=0.95),  # merging only, predicted worst
        Candidate([0, 0, 0, 0], {}, latency=1.0, cls=1.0, patch=1.0),  # over the budget
    ]
    measured = {"VCA 0:n=4, 1:n=4": 0.90, "VCA 0:n=4": 0.93, "merge r=2 from block 1": 0.97}
    calls = []

    def fake_fidelity(twin, images, reference):
        name = _planned_name(twin)
        calls.append(name)
        score = measured[name]  # one scoring image (2 images, split with calibration)
        return {"cls_cosine": score, "patch_token_cosine": score, "cls_per_image": [score], "patch_per_image": [score]}

    _stand_in_twins(monkeypatch, {c.describe(): c.latency for c in cands})
    monkeypatch.setattr(planner_module, "plan_fidelity", fake_fidelity)
    images = torch.randn(2, 3, RES, RES)
    chosen, scores = choose_measured(model, info, cands, 0.8, "both", images, top=2)
    assert sorted(calls) == sorted(measured)  # the two best predicted + the best merging-only plan; nothing over budget
    assert chosen.describe() == cands[2].describe() and scores["cls_cosine"] == 0.97
    chosen, _ = choose_measured(model, info, cands, 0.8, "both", images, top=1)
    assert chosen.describe() == cands[2].describe()  # the merging-only plan is always a finalist
    with pytest.raises(PlanError, match=r"budget 0\.50x"):
        choose_measured(model, info, cands, 0.5, "both", images)
    calls.clear()
    kept: dict = {}
    for budget in (0.8, 0.75):  # measurements kept across budgets: each plan is applied and measured once
        chosen, _ = choose_measured(model, info, cands, budget, "both", images, top=2, measured=kept)
        assert chosen.describe() == cands[2].describe()
    assert sorted(calls) == sorted(measured) and sorted(kept) == sorted(measured)


@pytest.mark.parametrize(
    ("mixed", "merging", "wins"),
    [
        ([0.99, 0.99, 0.99, 0.93], [0.95, 0.95, 0.95, 0.95], "merge"),  # +0.015 mean, one image carries it: noise
        ([0.97, 0.98, 0.97, 0.98], [0.95, 0.96, 0.95, 0.96], "vca"),  # +0.02 on every image
    ],
    ids=["noisy-gain", "steady-gain"],
)
def test_a_mixed_plan_must_beat_merging_alone_beyond_noise(monkeypatch, mixed, merging, wins):
    from vca_patch.planner import planner as planner_module

    model = tiny_dinov2()
    cands = [
        Candidate([0, 0, 0, 0], {0: 4}, latency=0.7, cls=0.99, patch=0.99),
        Candidate([0, 2, 2, 2], {}, latency=0.65, cls=0.95, patch=0.95),
    ]
    per_image = {"VCA 0:n=4": mixed, "merge r=2 from block 1": merging}

    def fake_fidelity(twin, images, reference):
        values = per_image[_planned_name(twin)]
        mean = sum(values) / len(values)
        return {"cls_cosine": mean, "patch_token_cosine": mean, "cls_per_image": values, "patch_per_image": values}

    _stand_in_twins(monkeypatch, {c.describe(): c.latency for c in cands})
    monkeypatch.setattr(planner_module, "plan_fidelity", fake_fidelity)
    lines: list[str] = []
    chosen, _ = choose_measured(model, model_info(model), cands, 0.8, "both", torch.randn(8, 3, RES, RES),
                                log=lines.append)  # fmt: skip
    assert chosen.describe() == cands[0 if wins == "vca" else 1].describe()
    assert any("within noise" in line for line in lines) == (wins == "merge")


@pytest.mark.parametrize(("middle", "chosen"), [(0.9985, 1), (0.997, 0)], ids=["as-faithful", "less-faithful"])
def test_a_faster_plan_as_faithful_is_chosen(monkeypatch, middle, chosen):
    """Of two finalists within the budget whose measured objective differs by at most EQUAL_FIDELITY the faster
    wins (a user asked for speed within a budget); a loss of 0.0025 keeps the more faithful plan."""
    from vca_patch.planner import planner as planner_module

    model = tiny_dinov2()
    cands = [
        Candidate([0, 1, 1, 1], {}, latency=0.78, cls=1.0, patch=1.0),
        Candidate([0, 2, 2, 2], {}, latency=0.7, cls=0.99, patch=0.99),
        Candidate([2, 2, 2, 2], {}, latency=0.6, cls=0.95, patch=0.95),
    ]
    scores = dict(zip([c.describe() for c in cands], [0.9995, middle, 0.99], strict=True))

    def fake_fidelity(twin, images, reference):
        score = scores[_planned_name(twin)]
        return {"cls_cosine": score, "patch_token_cosine": score, "cls_per_image": [score], "patch_per_image": [score]}

    _stand_in_twins(monkeypatch, {c.describe(): c.latency for c in cands})
    monkeypatch.setattr(planner_module, "plan_fidelity", fake_fidelity)
    lines: list[str] = []
    best, _ = choose_measured(model, model_info(model), cands, 0.8, "both", torch.randn(2, 3, RES, RES),
                              log=lines.append)  # fmt: skip
    assert best.describe() == cands[chosen].describe()
    assert any("as faithful and faster" in line for line in lines) == (chosen == 1)


def test_with_a_recovery_given_vca_finalists_compete_recovered(monkeypatch):
    """`recover` runs on each finalist with VCA blocks (never on merging-only plans) before it is scored: a VCA plan
    that loses to merging training-free wins once recovered."""
    from vca_patch.planner import planner as planner_module

    model = tiny_dinov2()
    cands = [
        Candidate([0, 0, 0, 0], {0: 4}, latency=0.7, cls=0.99, patch=0.99),
        Candidate([0, 2, 2, 2], {}, latency=0.65, cls=0.95, patch=0.95),
    ]

    def fake_fidelity(twin, images, reference):
        name = _planned_name(twin)
        score = {"merge r=2 from block 1": 0.95}.get(name, 0.99 if getattr(twin, "recovered", False) else 0.9)
        return {"cls_cosine": score, "patch_token_cosine": score, "cls_per_image": [score], "patch_per_image": [score]}

    recovered: list[str] = []

    def recover(twin, original):
        recovered.append(_planned_name(twin))
        twin.recovered = True
        return "recovered"

    _stand_in_twins(monkeypatch, {c.describe(): c.latency for c in cands})
    monkeypatch.setattr(planner_module, "plan_fidelity", fake_fidelity)
    images, info = torch.randn(2, 3, RES, RES), model_info(model)
    plain, _ = choose_measured(model, info, cands, 0.8, "both", images)
    lines: list[str] = []
    chosen, scores = choose_measured(model, info, cands, 0.8, "both", images, recover=recover, log=lines.append)
    assert plain.describe() == cands[1].describe() and chosen.describe() == cands[0].describe()
    assert recovered == ["VCA 0:n=4"] and scores["cls_cosine"] == 0.99
    assert any("VCA 0:n=4: recovered" in line for line in lines)


def test_finalists_are_calibrated_and_measured_on_different_images(monkeypatch):
    """A plan's VCA blocks are never scored on the images they were calibrated on (that flatters VCA plans)."""
    from vca_patch.planner import planner as planner_module

    model = tiny_dinov2()
    info = model_info(model)
    cands = [
        Candidate([0, 0, 0, 0], {0: 4}, latency=0.6, cls=0.99, patch=0.99),
        Candidate([0, 2, 2, 2], {}, latency=0.65, cls=0.95, patch=0.95),
    ]
    seen = []
    real = planner_module.apply_plan

    def recording(model, config, calibration=None):
        seen.append(("calibrated", None if calibration is None else {t.sum().item() for t in calibration}))
        return real(model, config, calibration)

    monkeypatch.setattr(planner_module, "apply_plan", recording)
    measured_on = []
    real_fidelity = planner_module.fidelity
    monkeypatch.setattr(
        planner_module,
        "fidelity",
        lambda ref, got, **options: measured_on.append(len(ref)) or real_fidelity(ref, got, **options),
    )
    images = torch.randn(4, 3, RES, RES)
    choose_measured(model, info, cands, 0.8, "both", images)
    fit = {t.sum().item() for t in images[0::2]}
    assert ("calibrated", fit) in seen and ("calibrated", None) in seen  # the VCA plan on the even images only
    assert measured_on == [2, 2]  # both plans scored on the two odd images
    assert planner_module.split_for_measurement(images, calibrate=False)[1] is images
    one = images[:1]
    assert planner_module.split_for_measurement(one, calibrate=True) == (one, one)  # too few to split


def test_sensitivity_calibrates_vca_on_half_the_images_and_scores_every_candidate_on_the_other_half(monkeypatch):
    from vca_patch.planner import sensitivity as sensitivity_module

    model = tiny_dinov2(depth=2)
    info = model_info(model)
    images = torch.randn(4, 3, RES, RES)
    seen: dict[str, list] = {"captured": [], "scored": []}
    real_capture, real_inputs = sensitivity_module.capture_original_layers, sensitivity_module.block_inputs

    def capture(model, batches, *args, **kwargs):
        seen["captured"] += [b.sum().item() for batch in batches for b in batch]
        return real_capture(model, batches, *args, **kwargs)

    def inputs(model, info, x):
        seen["scored"] += [b.sum().item() for b in x]
        return real_inputs(model, info, x)

    monkeypatch.setattr(sensitivity_module, "capture_original_layers", capture)
    monkeypatch.setattr(sensitivity_module, "block_inputs", inputs)
    sens = sensitivity_module.measure_sensitivity(
        model, info, images, RES, contrast_tokens=[4], merge_starts=[0], merge_fractions=[0.5], mano_windows=[2]
    )
    assert seen["captured"] == [b.sum().item() for b in images[0::2]]
    assert seen["scored"] == [b.sum().item() for b in images[1::2]]
    assert set(sens.vca) == {(0, 4), (1, 4)} and set(sens.mano) == {(0, 2), (1, 2)} and sens.merge


def test_latency_model_charges_the_merging_overhead_to_merging_blocks_only():
    """A merging block costs a softmax block plus the matching's overhead at its token count (interpolated)."""
    info = model_info(tiny_dinov2())
    table = LatencyTable(1.0, 0.1, [5, 17], [0.04, 0.1], merge_overhead_s=[0.01, 0.03])
    counts = token_counts(info, RES, [0, 2, 2, 2])
    softmax = sum(float(np.interp(t, [5, 17], [0.04, 0.1])) for t in counts)
    overhead = sum(float(np.interp(t, [5, 17], [0.01, 0.03])) for t in counts[1:])  # blocks 1-3 merge
    assert table.ratio(info, RES, [0, 2, 2, 2], {}) == pytest.approx(0.1 + softmax + overhead)
    assert table.ratio(info, RES, [0] * 4, {}) == pytest.approx(0.1 + 4 * 0.1)  # nothing merges: no overhead
    plain = LatencyTable(1.0, 0.1, [5, 17], [0.04, 0.1])  # not measured: none counted
    assert plain.ratio(info, RES, [0, 2, 2, 2], {}) == pytest.approx(0.1 + softmax)
    assert table.to_dict()["merge_overhead_ms"] == {5: pytest.approx(10.0), 17: pytest.approx(30.0)}


def test_measured_table_has_a_merging_overhead_per_token_count():
    model = tiny_dinov2()
    info = model_info(model)
    table = measure_latency_table(model, info, RES, [4], repeats=1)
    assert len(table.merge_overhead_s) == len(table.softmax_tokens) and min(table.merge_overhead_s) >= 0
    assert type(info.blocks(model)[0].attn).__name__ == "Attention"  # the model itself is left as it came


def test_an_earlier_rounds_choice_carried_in_competes_though_off_the_shortlist(monkeypatch):
    """After a refit, the second round's shortlist may leave out the first round's choice: `carried` keeps it in the
    comparison (measured once), so a refit cannot swap a better measured plan for a worse one."""
    from vca_patch.planner import planner as planner_module

    model = tiny_dinov2()
    cands = [
        Candidate([0, 2, 2, 2], {}, latency=0.6, cls=0.99, patch=0.99),  # best predicted: the shortlist of one
        Candidate([0, 0, 2, 2], {}, latency=0.7, cls=0.98, patch=0.98),
    ]
    truth = {cands[0].describe(): 0.95, cands[1].describe(): 0.99}

    def fake_fidelity(twin, images, reference):
        score = truth[_planned_name(twin)]
        return {"cls_cosine": score, "patch_token_cosine": score, "cls_per_image": [score], "patch_per_image": [score]}

    _stand_in_twins(monkeypatch, {c.describe(): c.latency for c in cands})
    monkeypatch.setattr(planner_module, "plan_fidelity", fake_fidelity)
    images, info = torch.randn(2, 3, RES, RES), model_info(model)
    alone, _ = choose_measured(model, info, cands, 0.8, "both", images, top=1, slack=0.0)
    assert alone.describe() == cands[0].describe()  # its shortlist: the best predicted only, kept unmeasured
    measured: dict = {}
    chosen, scores = choose_measured(model, info, cands, 0.8, "both", images, top=1, slack=0.0, measured=measured,
                                     carried=[cands[1].describe()])  # fmt: skip
    assert chosen.describe() == cands[1].describe() and scores["cls_cosine"] == 0.99
    assert set(measured) == set(truth)  # both measured: the carried plan joined the comparison
