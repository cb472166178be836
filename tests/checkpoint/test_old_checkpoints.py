"""Checkpoints saved by the package before its restructure (commit 7c3e120) still load and give the same outputs.

The fixtures in fixtures/checkpoints_7c3e120/ were written by that commit's code
(fixtures/make_checkpoints_7c3e120.py, run against a worktree of it); each holds probe.safetensors: the probe
inputs and the old code's outputs on them. Today's loaders must reproduce those outputs bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import load_file
from typer.testing import CliRunner

import vca_patch
from tests.support.paths import FIXTURES
from vca_patch import DIDBConfig, MANOConfig, MergeConfig, VCAConfig
from vca_patch.checkpoint.delta import DeltaError
from vca_patch.cli.app import app

FIXTURES = FIXTURES / "checkpoints_7c3e120"
TIMM = {
    "vca": ("vca", VCAConfig),
    "mano": ("mano", MANOConfig),
    "didb_packed": ("didb_packed", DIDBConfig),
    "merge": ("merge/checkpoint", MergeConfig),
}


def _probe(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    tensors = load_file(str(folder / "probe.safetensors"))
    split = {kind: {k.split(".", 1)[1]: v for k, v in tensors.items() if k.startswith(kind + ".")}
             for kind in ("input", "output")}  # fmt: skip
    return split["input"], split["output"]


def _assert_same(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.shape == expected.shape and got.dtype == expected.dtype
    # float32 round-off only: MANO's level arithmetic was reordered for export (measured 3e-8); a real change of the
    # loaded weights or layers moves outputs by far more than 1e-6
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", sorted(TIMM))
def test_a_timm_checkpoint_loads_and_reproduces_the_old_outputs(name):
    path, config_type = TIMM[name]
    folder = FIXTURES / path
    model = vca_patch.from_pretrained(folder)
    assert not model.training
    assert isinstance(model.vca_patch_state.config, config_type)
    inputs, outputs = _probe(folder)
    with torch.no_grad():
        _assert_same(model(inputs["x"]), outputs["logits"])


def test_the_didb_checkpoint_loads_packed():
    from vca_patch.targets.didb import is_packed

    assert is_packed(vca_patch.from_pretrained(FIXTURES / "didb_packed"))


def test_the_old_plan_file_applied_today_takes_the_old_checkpoints_weights():
    """The plan, applied by today's patch_model to the base, builds the module tree the old checkpoint fills."""
    plan = vca_patch.load_plan(FIXTURES / "merge" / "plan.json")
    assert isinstance(plan, MergeConfig) and plan.schedule == [0, 0, 3, 2] and plan.vca_layers == {0: 4, 1: 4}
    folder = FIXTURES / "merge" / "checkpoint"
    base = json.loads((folder / "config.json").read_text())["base"]
    model = timm.create_model(base["architecture"], pretrained=False, **base["model_args"]).eval()
    vca_patch.patch_model(model, plan)
    model.load_state_dict(load_file(str(folder / "model.safetensors")))
    inputs, outputs = _probe(folder)
    with torch.no_grad():
        _assert_same(model(inputs["x"]), outputs["logits"])


def test_a_delta_checkpoint_loads_onto_its_local_base_file():
    folder = FIXTURES / "delta" / "checkpoint"
    with pytest.raises(DeltaError, match="not followed"):  # its recorded local path is not followed by itself
        vca_patch.from_pretrained(folder)
    model = vca_patch.from_pretrained(folder, base_weights=FIXTURES / "delta" / "base.safetensors")
    inputs, outputs = _probe(folder)
    with torch.no_grad():
        _assert_same(model(inputs["x"]), outputs["logits"])


def test_a_llava_sp_folder_loads_and_reproduces_the_old_logits():
    folder = FIXTURES / "llava_sp"
    model = vca_patch.load_spatial_tokens(folder)
    inputs, outputs = _probe(folder)
    assert vca_patch.image_token_count(model) == 36 + 3
    with torch.no_grad():
        _assert_same(
            model(input_ids=inputs["input_ids"], pixel_values=inputs["pixel_values"]).logits, outputs["logits"]
        )


def test_fidelity_runs_on_an_old_checkpoint_through_the_cli(tmp_path):
    rng = np.random.default_rng(0)
    for i in range(4):
        folder = tmp_path / "images" / "test" / f"class_{i % 2}"
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    data = ["--data", str(tmp_path / "images"), "--data-kind", "imagefolder", "--limit", "4", "--batch-size", "2"]
    args = ["fidelity", str(FIXTURES / "vca"), *data, "--device", "cpu", "--json", str(tmp_path / "report.json")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["num_images"] == 4 and len(report["layer_error"]) == 2


def test_inspect_reads_the_old_llava_sp_folder_through_the_cli():
    args = ["inspect", str(FIXTURES / "llava_sp"), "--contrast-tokens", "4"]  # its vision grid is 6×6
    result = CliRunner().invoke(app, args, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "added (spatial_tokens.json)" in " ".join(result.output.split())
    row = next(line.split() for line in result.output.splitlines() if "multi_modal_projector" in line)
    assert row[:3] == ["model.multi_modal_projector", "cropping", "3"] and row[4:7] == ["36", "→", "39"]
