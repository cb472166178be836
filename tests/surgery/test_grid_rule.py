"""One rule for the patch grid, stated once in the target (`TargetConfig.fit_grid`) and applied alike by the
Python API (`patch_model`, `inspect_model`) and the CLI: contrast tokens the user chose past the grid are refused
in the same words before anything changes; the default count is fitted to a small grid and said."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support.cli import one_error_line, runner
from tests.support.models import tiny
from vca_patch import MergeConfig, VCAConfig, patch_model
from vca_patch.cli import app
from vca_patch.core.patch_state import get_patch_state
from vca_patch.core.sizes import SizeError
from vca_patch.surgery import inspect_model

GRID_4X4 = {"depth": 2, "img_size": 32, "patch_size": 8, "embed_dim": 16, "num_heads": 2, "num_classes": 3}
REFUSAL = "contrast_tokens (--contrast-tokens) 25 is more than the 4×4 patch grid's 16 patches; use 16 (4×4) or fewer"


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("call", [patch_model, inspect_model], ids=["patch_model", "inspect_model"])
def test_the_api_refuses_contrast_tokens_past_the_grid_and_changes_nothing(call):
    model, _ = tiny(**GRID_4X4)
    before = _state(model)
    with pytest.raises(SizeError) as error:
        call(model, VCAConfig(contrast_tokens=25))
    assert REFUSAL in str(error.value)
    with pytest.raises(SizeError, match=r"vca_layers 25 is more than the 4×4 patch grid"):
        call(model, MergeConfig(schedule=[0, 1], vca_layers={0: 25}))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and get_patch_state(model) is None
    call(model, VCAConfig(contrast_tokens=16))  # the whole grid fits


def test_the_cli_refuses_the_same_count_in_the_same_words(tmp_path):
    args = ["convert", "deit_tiny_patch16_224", "--no-pretrained", "--img-size", "64", "--contrast-tokens", "25"]
    result = runner.invoke(app, [*args, "--device", "cpu", "--probe-size", "1", "-o", str(tmp_path / "out")])
    assert REFUSAL in one_error_line(result, 2)
    assert not (tmp_path / "out").exists()


def test_the_default_count_is_fitted_to_a_small_grid_and_said():
    model, _ = tiny(**GRID_4X4)
    with pytest.warns(UserWarning, match=r"the default 49 contrast tokens do not fit the 4×4 patch grid; using 16"):
        report = patch_model(model, VCAConfig())
    assert {site.settings["contrast_tokens"] for site in report.patched} == {16}
    assert model.vca_patch_state.config.contrast_tokens == 16  # what a checkpoint saves: the layers as built
    big, _ = tiny(**{**GRID_4X4, "img_size": 64})  # 8×8 = 64 patches: 49 fits, nothing to say
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report = patch_model(big, VCAConfig())
    assert {site.settings["contrast_tokens"] for site in report.patched} == {49}
    assert not [w for w in seen if "contrast tokens" in str(w.message)]
