import pytest
import torch
from typer.testing import CliRunner

from tests.support.models import tiny
from vca_patch import ConfigError, PatchError, VCAConfig, patch_model
from vca_patch.cli import app
from vca_patch.surgery import get_patch_state, inspect_model


def test_include_and_exclude_select_by_module_path():
    model, _ = tiny(depth=4)
    report = patch_model(model, VCAConfig(include=r"blocks\.[0-2]\.", exclude=r"blocks\.1\."))
    assert [s.path for s in report.patched] == ["blocks.0.attn", "blocks.2.attn"]
    reasons = {s.path: s.reason for s in report.skipped}
    assert reasons["blocks.1.attn"].startswith("matches exclude")
    assert reasons["blocks.3.attn"].startswith("does not match include")


def test_selection_matching_nothing_lists_the_available_paths():
    model, _ = tiny()
    with pytest.raises(PatchError, match=r"matches no attention module; available: blocks\.0\.attn, blocks\.1\.attn"):
        patch_model(model, VCAConfig(include="decoder"))
    assert get_patch_state(model) is None


def test_invalid_regex_is_a_config_error():
    with pytest.raises(ConfigError, match="include must be a regular expression"):
        VCAConfig(include="blocks.(")


def test_inspect_changes_nothing_and_predicts_the_patch():
    model, _ = tiny("deit_tiny_distilled_patch16_224")
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    keys = list(model.state_dict())
    dry = inspect_model(model, VCAConfig(layers=[1]))
    assert get_patch_state(model) is None and list(model.state_dict()) == keys
    assert not model.patch_embed._forward_hooks
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert dry.layout.num_prefix_tokens == 2 and dry.layout.grid == (4, 4)
    real = patch_model(model, VCAConfig(layers=[1]))
    assert [s.path for s in dry.patched] == [s.path for s in real.patched]
    assert dry.params_after == real.params_after


def test_inspect_cli_prints_every_site_with_its_action():
    result = CliRunner().invoke(app, ["inspect", "deit_tiny_distilled_patch16_224", "--exclude", r"blocks\.11\."])
    assert result.exit_code == 0, result.output
    assert "dry run" in result.output and "2+14x14" in result.output
    assert "11 / 1" in result.output and "skip" in result.output


def test_inspect_cli_reports_bad_selection():
    result = CliRunner().invoke(app, ["inspect", "deit_tiny_patch16_224", "--include", "nothing-here"])
    assert result.exit_code == 1 and "available: blocks.0.attn" in result.output
