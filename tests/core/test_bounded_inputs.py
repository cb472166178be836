"""Untrusted text inputs are bounded before use, each refusal one error naming the file and the field: recipe YAML
(aliases that expand without end or loop, nesting, size, a FIFO), recipe numbers (steps, seeds, ratios, batch,
temperatures), JSON files (size, nesting, a FIFO) and a model's own config.json sizes (before the model is built)."""

from __future__ import annotations

import json
import os

import pytest

import vca_patch
from tests.support.cli import one_error_line, run_unchanged, runner
from tests.support.models import tiny
from vca_patch import VCAConfig, patch_model
from vca_patch.checkpoint.folder import CheckpointError
from vca_patch.cli.app import app
from vca_patch.core import bounded
from vca_patch.core.bounded import read_json
from vca_patch.core.errors import ConfigError
from vca_patch.core.sizes import SizeError, check_model_config
from vca_patch.train.recipe import RecipeError, load_recipe, recipe_from_dict

MINIMAL = "name: r\nstages:\n  - {name: a, kind: distill, steps: 2}\n"
LAUGHS = "\n".join(
    ["name: r", 'a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
)


def _recipe(tmp_path, text: str, name: str = "r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# --- recipe YAML -------------------------------------------------------------------------------------------------


def test_billion_laughs_is_refused_while_loading(tmp_path):
    path = _recipe(tmp_path, LAUGHS)
    with pytest.raises(RecipeError, match=r"r\.yaml: line \d+: aliases expand to more than 100000 values"):
        load_recipe(path)


def test_billion_laughs_is_one_line_through_the_cli(tmp_path):
    path = _recipe(tmp_path, LAUGHS)
    result = run_unchanged(["finetune", str(tmp_path / "ckpt"), "--recipe", str(path), "-o", str(tmp_path / "out")],
                           [path])  # fmt: skip
    one_error_line(result, 2, "r.yaml: line", "aliases expand to more than 100000 values")
    assert not (tmp_path / "out").exists()


def test_a_recursive_alias_is_refused(tmp_path):
    path = _recipe(tmp_path, "name: &n [1, *n]\nstages: []\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: line 1: alias \*n is inside its own anchor"):
        load_recipe(path)


def test_too_many_aliases_are_refused(tmp_path):
    aliases = ", ".join(["*x"] * 101)
    path = _recipe(tmp_path, f"x: &x 1\nname: r\ny: [{aliases}]\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: line 3: more than 100 aliases"):
        load_recipe(path)


def test_deep_nesting_is_refused_without_exhausting_the_stack(tmp_path):
    path = _recipe(tmp_path, "name: " + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: line 1: nested more than 64 levels deep"):
        load_recipe(path)


def test_aliases_that_nest_deep_once_expanded_are_refused(tmp_path):
    lines = ["a0: &a0 [1]"] + [f"a{i}: &a{i} [*a{i - 1}]" for i in range(1, 70)]  # each alias one level deeper
    path = _recipe(tmp_path, "\n".join(["name: r", *lines]))
    with pytest.raises(RecipeError, match=r"aliases nest more than 64 levels deep"):
        load_recipe(path)


def test_a_few_plain_aliases_still_load(tmp_path):
    text = "name: r\ndescription: &d shared\nbudget: *d\nstages:\n  - &s {name: a, kind: distill, steps: 2}\n"
    recipe = load_recipe(_recipe(tmp_path, text + "  - {<<: *s, name: b}\n"))
    assert recipe.budget == "shared" and [s.name for s in recipe.stages] == ["a", "b"]


def test_a_recipe_larger_than_the_cap_is_refused(tmp_path):
    path = _recipe(tmp_path, MINIMAL + "#" * (1 << 20))
    with pytest.raises(RecipeError, match=r"recipe file .*r\.yaml is larger than 1\.0 MiB"):
        load_recipe(path)


def test_a_fifo_recipe_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "r.yaml")
    with pytest.raises(RecipeError, match=r"recipe file .*r\.yaml is a FIFO \(named pipe\), not a regular file"):
        load_recipe(tmp_path / "r.yaml")


# --- recipe numbers ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("stage", "steps", 10**30, r"stages\[0\]\.steps must be >= 1 and <= 10000000 for a distill stage"),
        ("stage", "warmup_steps", 10**12, r"stages\[0\]\.warmup_steps must be >= 0 and <= 10000000"),
        ("train", "seed", -1, r"train\.seed must be >= 0 and <= 4294967295, got -1"),
        ("train", "seed", 2**40, r"train\.seed must be >= 0 and <= 4294967295"),
        ("stage", "min_lr_ratio", -0.5, r"stages\[0\]\.min_lr_ratio must be >= 0\.0 and <= 1\.0"),
        ("stage", "min_lr_ratio", 2.0, r"stages\[0\]\.min_lr_ratio must be >= 0\.0 and <= 1\.0"),
        ("stage", "kd_temperature", -2.0, r"stages\[0\]\.kd_temperature must be > 0 and <= 100\.0, got -2\.0"),
        ("stage", "kd_temperature", 0.0, r"stages\[0\]\.kd_temperature must be > 0"),
        ("train", "batch_size", 10**9, r"train\.batch_size must be >= 1 and <= 65536"),
        ("train", "grad_accum", 10**6, r"train\.grad_accum must be >= 1 and <= 4096"),
        ("train", "eval_every", 10**9, r"train\.eval_every must be >= 1 and <= 10000000"),
        ("train", "grad_clip", -1.0, r"train\.grad_clip must be >= 0"),
        ("stage", "calibration_images", 10**10, r"stages\[0\]\.calibration_images must be >= 1 and <= 100000000"),
        ("data", "num_workers", 10**6, r"data\.num_workers must be >= 0 and <= 256"),
    ],
)
def test_recipe_numbers_out_of_range_are_refused_on_load(tmp_path, section, key, value, message):
    stage = {"name": "a", "kind": "distill", "steps": 10}
    data = {"name": "r", "stages": [stage], "data": {}, "train": {}}
    (stage if section == "stage" else data[section])[key] = value
    path = _recipe(tmp_path, json.dumps(data))  # JSON is YAML
    with pytest.raises(RecipeError, match=r"^r\.yaml: " + message):
        load_recipe(path)


def test_recipe_numbers_at_their_bounds_load():
    stage = {"name": "a", "kind": "distill", "steps": 10_000_000, "min_lr_ratio": 1.0, "kd_temperature": 100.0}
    recipe = recipe_from_dict({"name": "r", "stages": [stage], "train": {"seed": 2**32 - 1, "batch_size": 65536}})
    assert recipe.total_steps == 10_000_000


def test_a_diffusion_seed_out_of_range_is_refused():
    stage = {"name": "a", "kind": "distill_diffusion", "steps": 2}
    with pytest.raises(RecipeError, match=r"recipe: diffusion\.seed must be >= 0 and <= 4294967295, got -3"):
        recipe_from_dict({"name": "r", "stages": [stage], "diffusion": {"seed": -3}})


def test_a_huge_step_count_is_one_line_through_the_cli(tmp_path):
    path = _recipe(tmp_path, MINIMAL.replace("steps: 2", "steps: 100000000000000000000000000"))
    result = runner.invoke(app, ["finetune", str(tmp_path / "c"), "--recipe", str(path), "-o", str(tmp_path / "o")])
    one_error_line(result, 2, "r.yaml: stages[0].steps must be >= 1 and <= 10000000")
    assert not (tmp_path / "o").exists()


# --- JSON --------------------------------------------------------------------------------------------------------


def test_json_nested_100k_deep_is_refused(tmp_path):
    (tmp_path / "c.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConfigError, match=r"c\.json is nested more than 64 levels deep"):
        read_json(tmp_path / "c.json")


def test_json_nested_past_the_limit_names_the_field(tmp_path):
    value: object = 1
    for _ in range(70):
        value = {"k": value}
    (tmp_path / "c.json").write_text(json.dumps({"vision_config": value}))
    with pytest.raises(ConfigError, match=r"c\.json: vision_config\.k\.k\..*\.k is nested more than 64 levels deep"):
        read_json(tmp_path / "c.json")


def test_json_larger_than_the_cap_is_refused_before_parsing(tmp_path, monkeypatch):
    (tmp_path / "c.json").write_text(json.dumps({"pad": "x" * 5000}))
    monkeypatch.setattr(bounded, "MAX_JSON_BYTES", 4096)  # the real cap is 16 MiB
    with pytest.raises(CheckpointError, match=r"config .*c\.json is larger than 4\.0 KiB"):
        read_json(tmp_path / "c.json", "config", error=CheckpointError)


def test_a_fifo_json_file_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "c.json")
    with pytest.raises(ConfigError, match=r"c\.json is a FIFO \(named pipe\), not a regular file"):
        read_json(tmp_path / "c.json")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    model, args = tiny(depth=1, img_size=32, patch_size=8, embed_dim=16, num_heads=2, num_classes=3)
    patch_model(model, VCAConfig(contrast_tokens=4))
    return vca_patch.save_pretrained(model, tmp_path_factory.mktemp("ckpt") / "ckpt", model_args=args)


def _copy(ckpt, folder):
    folder.mkdir()
    for f in ckpt.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    return folder


@pytest.mark.parametrize("command", [["fidelity", "{x}", "--device", "cpu"], ["export", "{x}"]])
def test_a_deeply_nested_checkpoint_config_is_one_line(ckpt, tmp_path, command):
    folder = _copy(ckpt, tmp_path / "deep")
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    args = [a.replace("{x}", str(folder)) for a in command]
    one_error_line(run_unchanged(args, [folder]), 2, "config.json is nested more than 64 levels deep")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deep"]  # no export file, nothing else


def test_a_fifo_checkpoint_config_is_refused(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path / "fifo")
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")
    with pytest.raises(CheckpointError, match=r"config\.json is a FIFO \(named pipe\), not a regular file"):
        vca_patch.from_pretrained(folder)


def test_a_checkpoint_whose_heads_do_not_divide_the_width_is_one_line(ckpt, tmp_path):
    folder = _copy(ckpt, tmp_path / "heads")
    meta = json.loads((folder / "config.json").read_text())
    meta["base"]["model_args"]["num_heads"] = meta["model_args"]["num_heads"] = 3
    (folder / "config.json").write_text(json.dumps(meta))
    result = run_unchanged(["fidelity", str(folder), "--device", "cpu"], [folder])
    one_error_line(result, 2, "config.json: base.model_args.num_heads = 3 does not divide base.model_args.embed_dim")


# --- a model's own config.json sizes -----------------------------------------------------------------------------

VIT = {"model_type": "vit", "architectures": ["ViTModel"], "hidden_size": 16, "num_hidden_layers": 1,
       "num_attention_heads": 2, "intermediate_size": 16, "image_size": 32, "patch_size": 8}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"image_size": 65536}, "image_size = 65536 is out of bounds: expected an integer from 1 to 16384"),
        ({"patch_size": 0}, "patch_size = 0 is out of bounds: expected an integer from 1 to 16384"),
        ({"num_attention_heads": 3}, "num_attention_heads = 3 does not divide hidden_size = 16"),
        ({"patch_size": 64}, "patch_size = 64 is larger than image_size = 32"),
    ],
    ids=["image-65536", "patch-0", "heads", "patch-over-image"],
)
def test_a_transformers_folders_config_sizes_are_checked_before_building(tmp_path, change, message):
    pytest.importorskip("transformers")
    folder = tmp_path / "vit"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**VIT, **change}))
    args = ["convert", f"{folder}/", "--no-pretrained", "-o", str(tmp_path / "out")]
    one_error_line(run_unchanged(args, [folder]), 2, "vit/config.json: " + message)
    assert not (tmp_path / "out").exists()


def test_nested_configs_are_checked_too():
    with pytest.raises(SizeError, match=r"config\.json: vision_config\.image_size = 65536 is out of bounds"):
        check_model_config({"vision_config": {**VIT, "image_size": 65536}}, "config.json")


def test_a_config_whose_weights_do_not_fit_in_memory_is_refused():
    config = {**VIT, "hidden_size": 4096, "num_attention_heads": 32, "num_hidden_layers": 48}
    with pytest.raises(SizeError, match=r"config\.json needs about 36\.0 GiB of weights, more than the 1\.0 GiB"):
        check_model_config(config, "config.json", available=1 << 30)
    check_model_config(VIT, "config.json", available=1 << 30)


def test_convert_of_a_folder_whose_config_json_nests_too_deep_is_one_line(tmp_path):
    """`convert FOLDER` reads the folder's config.json bounded (it was 'internal error: RecursionError')."""
    from typer.testing import CliRunner

    from vca_patch.cli.app import app

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    result = CliRunner().invoke(app, ["convert", str(folder), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    assert "nested more than 64 levels deep" in result.output and "internal error" not in result.output
