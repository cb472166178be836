"""Options that conflict or would be ignored are refused before any work, never dropped silently; local paths in
any spelling (`./m`, `../m`, absolute, with spaces) are local folders; `-o nosuch/../out` is resolved as the file
system resolves it; `fidelity --json` and `bench --json` replace a file only with --force; plan files and Hub
configs are read bounded."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

import vca_patch
from tests.support.cli import one_error_line, run_unchanged, runner
from tests.support.models import tiny
from vca_patch import patch_model
from vca_patch.cli.app import app

CONVERT = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "32", "--contrast-tokens", "4"]
BENCH = ["bench", "deit_tiny_patch16_224", "--depth", "1", "--resolutions", "32", "--repeats", "1", "--warmup", "0",
         "--min-time", "0", "--no-memory", "--no-unfused"]  # fmt: skip


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    model, args = tiny(img_size=32)
    patch_model(model)
    return vca_patch.save_pretrained(model, tmp_path_factory.mktemp("conflicts") / "ckpt", model_args=args)


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--to", "mano"], "--to mano"), (["--layers", "0-3"], "--layers"), (["--window", "5"], "--window")],
)
def test_a_plan_with_options_it_would_ignore_is_refused(extra, named, tmp_path):
    plan = tmp_path / "p.json"
    plan.write_text(json.dumps({"format": "vca-patch-plan", "version": 1, "config": {}}))
    result = run_unchanged([*CONVERT, "--plan", str(plan), *extra, "-o", str(tmp_path / "out")], [plan])
    one_error_line(result, 2, f"--plan {plan} already says what each block becomes", named, "would be ignored")
    assert "Attention sites" not in result.output and sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_a_recipe_image_size_other_than_the_models_is_refused_before_training(ckpt, tmp_path):
    recipe = tmp_path / "r.yaml"
    (tmp_path / "images").mkdir()
    recipe.write_text(yaml.safe_dump({
        "name": "sized", "data": {"kind": "imagefolder", "path": str(tmp_path / "images"), "img_size": 64},
        "stages": [{"name": "distill", "kind": "distill", "steps": 2, "lr": 1e-3}],
    }))  # fmt: skip
    result = run_unchanged(["finetune", str(ckpt), "--recipe", str(recipe), "-o", str(tmp_path / "run"), "--device",
                            "cpu"], [ckpt, recipe])  # fmt: skip
    one_error_line(result, 2, "data.img_size is 64 px", "takes 32 px", "data.img_size: 32, or null")


@pytest.fixture(scope="module")
def local_vit(tmp_path_factory) -> Path:
    """A tiny transformers ViT saved in a folder whose parent name has a space."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("local") / "my models"
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                                    image_size=32, patch_size=8)  # fmt: skip
    transformers.ViTModel(config).save_pretrained(root / "m")
    return root / "m"


@pytest.mark.parametrize("spelling", ["./m", "../my models/m", "absolute"])
def test_a_local_transformers_folder_in_any_spelling_converts_and_saves(spelling, local_vit, tmp_path, monkeypatch):
    monkeypatch.chdir(local_vit.parent if spelling == "./m" else tmp_path)
    if spelling.startswith(".."):
        (tmp_path / "work").mkdir()
        monkeypatch.chdir(tmp_path / "work")
        os.symlink(local_vit.parent, tmp_path / "my models")
    model = str(local_vit) if spelling == "absolute" else spelling
    out = tmp_path / "out"
    result = run_unchanged(["convert", model, "-o", str(out)], [local_vit])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "config.json").read_text())
    assert meta["base"]["hf_hub_id"] is None  # a local folder, never written down as a Hub id
    assert type(vca_patch.from_pretrained(out)).__name__ == "ViTModel"


def test_an_output_through_a_missing_folder_and_dotdot_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = run_unchanged([*CONVERT, "-o", "nosuch/../out"], [])
    one_error_line(result, 2, "folder nosuch does not exist")
    assert list(tmp_path.iterdir()) == []


def test_an_output_through_a_link_and_dotdot_lands_where_the_file_system_puts_it(tmp_path, monkeypatch):
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "link").symlink_to(tmp_path / "elsewhere" / "deep")
    monkeypatch.chdir(tmp_path / "work")
    result = runner.invoke(app, [*CONVERT, "-o", "link/../out"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "elsewhere" / "out" / "model.safetensors").is_file()
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == ["link"]  # nothing written beside the link


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_fidelity_and_bench_replace_a_report_only_with_force(option, ckpt, tmp_path):
    kept = tmp_path / "report.out"
    kept.write_text("the user's")
    for args in (["fidelity", str(ckpt), "--device", "cpu"], BENCH):
        result = run_unchanged([*args, option, str(kept)], [kept])
        one_error_line(result, 2, f"{option} {kept} exists; pass --force to replace it")


def test_bench_with_force_replaces_its_json(tmp_path):
    out = tmp_path / "bench.json"
    out.write_text("{}")
    result = runner.invoke(app, [*BENCH, "--json", str(out), "--force"])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["meta"]["model"] == "deit_tiny_patch16_224"


def test_a_plan_file_nested_too_deep_is_one_line(tmp_path):
    from vca_patch.planner import load_plan
    from vca_patch.planner.model_info import PlanError

    plan = tmp_path / "deep.json"
    plan.write_text('{"format": "vca-patch-plan", "config": ' + "[" * 200 + "]" * 200 + "}")
    with pytest.raises(PlanError, match="nested more than 64 levels"):
        load_plan(plan)
