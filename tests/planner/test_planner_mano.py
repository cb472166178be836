"""MANO(k) as a per-block choice of the conversion planner: MergeConfig.mano_layers, costs, sensitivity, search."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from tests.support.merging import hf_dinov2, reference_image, timm_parts, timm_reference, timm_vit
from vca_patch import from_pretrained, patch_model, unpatch_model
from vca_patch.cli.app import app
from vca_patch.core.errors import ConfigError
from vca_patch.planner import (
    Candidate,
    ModelInfo,
    PlanError,
    candidates,
    load_plan,
    model_info,
    plan_config,
    plan_model,
    save_plan,
)
from vca_patch.planner.costs import LatencyTable, measure_latency_table, plan_macs, token_counts
from vca_patch.planner.planner import MIN_SAVING
from vca_patch.planner.sensitivity import Loss, Sensitivity, measure_sensitivity
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.mano.layer import MultipoleAttention
from vca_patch.targets.mano.macs import mano_attention_macs
from vca_patch.targets.merge import MergeConfig, MergingAttention
from vca_patch.targets.vca.layer import VisualContrastAttention

RES = 56  # 4x4 patches of 14 px + CLS


def _windowed_block(block: torch.nn.Module, x: torch.Tensor, grid: tuple[int, int], window: int) -> torch.Tensor:
    """A timm block whose attention is k×k-windowed (prefix keys in every window, prefix queries global), float64:
    what MANO's preserving init computes, written as one masked softmax."""
    p = timm_parts(block)
    _, N, C = x.shape
    prefix = N - grid[0] * grid[1]
    cell = [(i // grid[1]) // window * 1000 + (i % grid[1]) // window for i in range(grid[0] * grid[1])]
    allowed = torch.ones(N, N, dtype=torch.bool)
    for i in range(N - prefix):
        for j in range(N - prefix):
            allowed[prefix + i, prefix + j] = cell[i] == cell[j]
    h = p["norm1"](x)
    q, k, v = p["qkv"](h).chunk(3, dim=-1)
    heads, d = p["heads"], C // p["heads"]
    out = []
    for head in range(heads):
        s = slice(head * d, (head + 1) * d)
        logits = (q[..., s] @ k[..., s].transpose(-1, -2) / math.sqrt(d)).masked_fill(~allowed, float("-inf"))
        out.append(torch.softmax(logits, dim=-1) @ v[..., s])
    x = x + p["ls1"](p["proj"](torch.cat(out, dim=-1)))
    return x + p["ls2"](p["mlp"](p["norm2"](x)))


def test_mano_blocks_before_the_first_merge_match_the_float64_reference_and_unpatch():
    model = timm_vit()
    images = torch.randn(2, 3, RES, RES, dtype=torch.float64)
    schedule = [0, 0, 3, 2]
    with torch.no_grad():
        original = model.forward_features(images)
        covering = timm_reference(model, images, schedule)  # a window covering the 4x4 grid is softmax exactly
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, MergeConfig(schedule=schedule, mano_layers={0: 4, 1: 4}))
    assert [type(b.attn) for b in model.blocks] == [MultipoleAttention] * 2 + [MergingAttention] * 2
    with torch.no_grad():
        error = (model.forward_features(images) - covering).abs().max().item()
    assert error < 1e-10, error  # measured ~1e-15
    unpatch_model(model)

    config = MergeConfig(schedule=schedule, mano_layers={0: 2}, vca_layers={1: 4})
    report = patch_model(model, config)
    assert isinstance(model.blocks[0].attn, MultipoleAttention) and model.blocks[0].attn.window == 2
    assert isinstance(model.blocks[1].attn, VisualContrastAttention)
    assert report.patched[0].settings["attention"] == "mano" and report.patched[0].settings["window"] == 2
    assert set(state) <= set(model.state_dict())  # q/k/v/proj carried under the original names
    with torch.no_grad():
        x = model.norm_pre(model._pos_embed(model.patch_embed(images)))
        x = model.blocks[1](_windowed_block(model.blocks[0], x, (4, 4), 2))  # VCA itself is tested elsewhere
        parts = [timm_parts(b) for b in model.blocks[2:]]
        reference = model.norm(torch.stack([reference_image(t, parts, schedule[2:], 1) for t in x]))
        got = model.forward_features(images)
    error = (got - reference).abs().max().item()
    assert error < 1e-10, error  # measured ~1e-15
    assert (got - covering).abs().max() > 1e-3  # the 2x2 windows really cut the attention
    unpatch_model(model)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model.forward_features(images), original)


def test_a_plan_with_mano_layers_saves_reloads_applies_and_unpatches_on_dinov2(tmp_path):
    model = hf_dinov2(depth=3)
    info = model_info(model)
    images = torch.randn(2, 3, RES, RES, dtype=torch.float64)
    with torch.no_grad():
        original = model(pixel_values=images).last_hidden_state
    cand = Candidate([0, 0, 4], {1: 4}, mano_layers={0: 2})
    assert cand.describe() == "VCA 1:n=4; MANO 0:k=2; merge r=4 from block 2" and not cand.merging_only
    assert cand.to_dict()["mano_layers"] == {0: 2}
    config = plan_config(cand, info)
    assert config.mano_layers == {0: 2} and config.vca_layers == {1: 4}
    path = save_plan(tmp_path / "plan.json", config, {"chosen": cand.to_dict()})
    assert json.loads(path.read_text())["config"]["mano_layers"] == {"0": 2}
    again = load_plan(path)
    assert again == config
    patch_model(model, again)
    kinds = [type(layer.attention) for layer in model.encoder.layer]
    assert kinds == [MultipoleAttention, VisualContrastAttention, MergingAttention]
    with torch.no_grad():
        out = model(pixel_values=images).last_hidden_state
    assert out.shape == original.shape and torch.isfinite(out).all()
    assert 1e-4 < (out - original).abs().max().item() < 10
    unpatch_model(model)
    with torch.no_grad():
        assert torch.equal(model(pixel_values=images).last_hidden_state, original)


def test_convert_applies_a_plan_file_with_mano_layers(tmp_path):
    plan = MergeConfig(schedule=[0, 0] + [1] * 10, mano_layers={0: 2, 1: 3}, expect={"depth": 12, "dim": 192,
                       "num_heads": 3})  # fmt: skip
    path = save_plan(tmp_path / "plan.json", plan, {})
    args = ["convert", "vit_tiny_patch16_224", "--no-pretrained", "--img-size", "64", "--plan", str(path)]
    result = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "converted")])
    assert result.exit_code == 0, result.output
    converted = from_pretrained(tmp_path / "converted")
    assert [type(b.attn) for b in converted.blocks[:3]] == [MultipoleAttention, MultipoleAttention, MergingAttention]
    assert [b.attn.window for b in converted.blocks[:2]] == [2, 3]
    with torch.no_grad():
        assert torch.isfinite(converted.forward_features(torch.randn(1, 3, 64, 64))).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"vca_layers": {0: 4, 1: 4}, "mano_layers": {1: 7, 2: 7}}, r"blocks \[1\] are in both vca_layers and mano"),
        ({"schedule": [0, 2, 2], "mano_layers": {0: 7, 2: 7}}, r"MANO needs the patch grid.*block 1.*\[2\]"),
        ({"schedule": None, "r": 2, "mano_layers": {0: 7}}, r"block 0\), but mano_layers asks for blocks \[0\]"),
        ({"mano_layers": {0: 0}}, r"mano_layers\[0\] must be a positive window side k, got 0"),
        ({"mano_layers": {"x": 7}}, "mano_layers key 'x' is not a block index"),
        ({"mano_layers": [7]}, "mano_layers must map block index"),
        ({"mano": {"window": 5}}, r"mano takes MANOConfig options .*\['window'\]"),
        ({"mano": {"rate": 1}}, "rate must be an integer"),
    ],
)
def test_mano_settings_are_validated_with_clear_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        MergeConfig(**{"schedule": [0, 0, 0], **kwargs})


def test_mano_config_round_trips_and_refuses_blocks_the_model_lacks():
    config = MergeConfig(schedule=[0, 0, 3], mano_layers={"1": 5, 0: 3}, mano={"down": "avg", "up": "nearest"})
    assert config.mano_layers == {0: 3, 1: 5}
    again = TargetConfig.from_json(config.to_json())
    assert again == config and again.mano == {"down": "avg", "up": "nearest"}
    model = timm_vit(depth=2)
    with pytest.raises(ConfigError, match=r"mano_layers names blocks \[3\]"):
        patch_model(model, MergeConfig(schedule=[0, 0], mano_layers={3: 7}))
    assert type(model.blocks[0].attn).__name__ == "Attention" and "forward" not in model.blocks[0].__dict__
    patch_model(model, MergeConfig(schedule=[0, 0], mano_layers={1: 2}, mano={"down": "avg", "up": "nearest"}))
    assert model.blocks[1].attn.down_mode == "avg" and model.blocks[1].attn.up_mode == "nearest"
    unpatch_model(model)


def _info(depth: int = 4) -> ModelInfo:
    return ModelInfo(depth, 64, 4, 1, 14, 12.0 * 64 * 64, tuple(f"blocks.{i}" for i in range(depth)), "norm")


def test_costs_count_and_time_mano_blocks():
    info = _info()
    counts = token_counts(info, RES, [0, 0, 3, 3])
    softmax = sum(n * 12 * 64 * 64 + 2 * n * n * 64 for n in counts)
    mano = mano_attention_macs(1, (4, 4), 64, window=2, coarse=False)  # training-free: U = 0, no coarse levels
    expected = softmax - 2 * 17 * 17 * 64 + mano
    assert plan_macs(info, RES, [0, 0, 3, 3], {}, {1: 2}) == pytest.approx(expected)
    table = LatencyTable(1.0, 0.2, [3, 17], [0.05, 0.2], vca_s={4: 0.1}, mano_s={2: 0.12})
    assert table.ratio(info, RES, [0] * 4, {0: 4}, {1: 2}) == pytest.approx(0.2 + 0.1 + 0.12 + 0.2 + 0.2)
    assert table.to_dict()["mano_block_ms"] == {2: pytest.approx(120.0)}


def test_only_mano_windows_faster_than_a_full_grid_softmax_block_are_options():
    table = LatencyTable(1.0, 0.2, [3, 17], [0.05, 0.2], mano_s={2: 0.1, 3: 0.2, 4: 0.3})
    assert table.faster_mano_windows() == [2]
    with pytest.raises(PlanError, match=r"MANO windows must be positive integers .*\[0\]"):
        plan_model(timm_vit(depth=2), torch.randn(1, 3, RES, RES), budget=0.5, resolution=RES, mano_windows=[0])


def _synthetic(mano_cls: list[float]) -> tuple[ModelInfo, LatencyTable, Sensitivity]:
    info = _info()
    table = LatencyTable(1.0, 0.2, [3, 17], [0.05, 0.2], vca_s={4: 0.1}, mano_s={2: 0.1})
    sens = Sensitivity()
    for block in range(4):
        sens.vca[(block, 4)] = Loss(0.02, 0.02)
        sens.mano[(block, 2)] = Loss(mano_cls[block], mano_cls[block])
    return info, table, sens


def test_the_search_picks_mano_where_its_measured_loss_is_lower():
    info, table, sens = _synthetic([0.005, 0.05, 0.005, 0.05])  # MANO beats VCA in blocks 0 and 2 only
    cands = candidates(info, RES, table, sens, "both")
    assert cands[0].describe() == "original (softmax everywhere)"
    full = min(cands, key=lambda c: c.latency)  # every block converted, each with its better option
    assert full.mano_layers == {0: 2, 2: 2} and full.vca_layers == {1: 4, 3: 4}
    assert full.cls == pytest.approx(1 - 0.005 * 2 - 0.02 * 2)
    assert [sorted(c.mano_layers) for c in cands[1:3]] == [[0], [0, 2]]  # the cheaper losses are taken first
    assert full.macs_ratio == pytest.approx(
        plan_macs(info, RES, [0] * 4, {1: 4, 3: 4}, {0: 2, 2: 2}) / plan_macs(info, RES, [0] * 4, {})
    )
    slower = LatencyTable(1.0, 0.2, [3, 17], [0.05, 0.2], vca_s={4: 0.1}, mano_s={2: 0.25})
    assert all(not c.mano_layers for c in candidates(info, RES, slower, sens, "both"))  # MANO slower than softmax


def test_a_vca_block_switches_to_mano_when_that_saves_latency():
    info, _, sens = _synthetic([0.01] * 4)
    table = LatencyTable(1.0, 0.2, [3, 17], [0.05, 0.2], vca_s={4: 0.18}, mano_s={2: 0.1})
    sens.vca = {(0, 4): Loss(0.001, 0.001)}  # VCA measured in block 0 only: nearly free there, but saves little
    cands = candidates(info, RES, table, sens, "cls")
    assert cands[1].vca_layers == {0: 4} and not cands[1].mano_layers  # 0.02 saved per 0.001 lost: first
    assert all(set(c.vca_layers).isdisjoint(c.mano_layers) for c in cands)
    fastest = min(cands, key=lambda c: c.latency)
    assert fastest.mano_layers == {0: 2, 1: 2, 2: 2, 3: 2} and not fastest.vca_layers  # block 0 moved on to MANO
    assert fastest.latency == pytest.approx(0.2 + 4 * 0.1) and fastest.cls == pytest.approx(1 - 4 * 0.01)
    # with no MANO measured the search is the VCA-only one
    sens.mano = {}
    assert all(not c.mano_layers for c in candidates(info, RES, table, sens, "cls"))


def test_sensitivity_and_latency_table_measure_mano_on_a_tiny_vit():
    model = timm_vit(depth=3).float()
    info = model_info(model)
    images = torch.randn(2, 3, RES, RES)
    sens = measure_sensitivity(
        model, info, images, RES, contrast_tokens=(), merge_starts=(), merge_fractions=(), mano_windows=(2, 4)
    )
    assert sorted(sens.mano) == [(b, k) for b in range(3) for k in (2, 4)] and not sens.vca
    for block in range(3):
        assert abs(sens.mano[(block, 4)].cls) < 1e-5 and abs(sens.mano[(block, 4)].patch) < 1e-5  # covers the grid
        assert sens.mano[(block, 2)].patch > 1e-4  # 2x2 windows lose something
    assert sens.to_dict()["mano"][0] == {"block": 0, "window": 2, **sens.mano[(0, 2)].to_dict()}
    assert not hasattr(model, "vca_patch_state")
    table = measure_latency_table(model, info, RES, (), mano_windows=(2,), repeats=1)
    assert set(table.mano_s) == {2} and table.mano_s[2] > 0 and not table.vca_s


def test_cli_plan_measures_mano_windows_and_the_plan_table_shows_mano_blocks(tmp_path):
    from types import SimpleNamespace

    from tests.support.planner import image_folder
    from vca_patch.cli.plan import plan_table

    image_folder(tmp_path / "images", 2)
    out = tmp_path / "plan.json"
    args = [
        "plan", "vit_tiny_patch16_224", "--no-pretrained", "--no-calibrate", "--calibration-data",
        str(tmp_path / "images"), "--resolution", "64", "--budget", "2.0", "--images", "2", "--contrast-tokens", "none",
        "--merge-fractions", "0.5", "--repeats", "3", "--min-time", "0.05", "-o", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, [*args, "--mano-windows", "2,4"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    timed = data["latency_table"]
    assert set(timed["mano_block_ms"]) == {"2", "4"} and "mano_layers" in data["chosen"]
    softmax = timed["softmax_block_ms"][max(timed["softmax_block_ms"], key=int)]
    # the others timed only (block times as the whole-model timing of MANO everywhere corrected them)
    faster = [int(k) for k, ms in sorted(timed["mano_block_ms"].items()) if ms < (1 - MIN_SAVING) * softmax]
    assert [(row["block"], row["window"]) for row in data["sensitivity"]["mano"]] == [
        (b, k) for k in faster for b in range(12)
    ]
    for k in {2, 4} - set(faster):
        assert f"MANO k={k}: a block takes" in result.output
    assert isinstance(load_plan(out), MergeConfig)
    chosen = Candidate([0, 0, 0, 5], {1: 4}, mano_layers={0: 2})
    config = MergeConfig(schedule=[0, 0, 0, 5], unmerge="residual")
    table = plan_table(SimpleNamespace(chosen=chosen, info=_info(), resolution=RES, config=config))
    assert list(table.columns[1].cells) == ["MANO k=2", "VCA n=4", "softmax", "softmax (proportional)"]
    assert "residual: plus what merging took from each" in table.caption
