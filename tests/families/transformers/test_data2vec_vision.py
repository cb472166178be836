"""transformers Data2VecVisionModel: BEiT-style relative-position bias in the split layout (query/key/value, the
output projection in `attention.output.dense`), converted as approximate with the bias named, and verified
against softmax attention that adds the bias."""

from __future__ import annotations

import functools

import pytest
import torch
import transformers

import vca_patch
from vca_patch import VCAConfig, patch_model, unpatch_model
from vca_patch.families.transformers.vision import HFVisionAdapter
from vca_patch.surgery import inspect_model

BIAS_KINDS = [{"use_relative_position_bias": True}, {"use_shared_relative_position_bias": True}]
VERIFY_TOLERANCE = 1e-5  # float32 SDPA against the written-out reference (measured ~1e-7)


def _model(bias: dict) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.Data2VecVisionConfig(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, **bias,
    )  # fmt: skip
    model = transformers.Data2VecVisionModel(config).eval()
    for module in model.modules():  # transformers initialises the tables to zero: make the bias matter
        if isinstance(getattr(module, "relative_position_bias_table", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.relative_position_bias_table, std=0.5)
    return model


@pytest.mark.parametrize("bias", BIAS_KINDS)
def test_sites_are_verified_against_a_reference_with_the_bias(bias):
    model = _model(bias)
    adapter = HFVisionAdapter()
    sites, skipped = adapter.find_sites(model)
    assert [s.path for s in sites] == [f"encoder.layer.{i}.attention.attention" for i in range(2)] and not skipped
    tables = "2 table(s)" if "use_relative_position_bias" in bias else "1 table(s)"
    assert all("relative_position_bias_table" in s.notes[0] and tables in s.notes[0] for s in sites)
    for site in sites:
        error = adapter._split_bias_error(site)
        assert error < VERIFY_TOLERANCE
        assert adapter.verify(site).verified is True


def test_verification_fails_when_the_module_does_more_than_biased_softmax():
    model = _model(BIAS_KINDS[0])
    attn = model.encoder.layer[0].attention.attention
    original = attn.forward

    @functools.wraps(original)
    def scaled(*args, **kwargs):
        return original(*args, **kwargs)[0] * 1.01, None

    attn.forward = scaled
    report = inspect_model(model, VCAConfig(contrast_tokens=4))
    skipped = {s.path: s.reason for s in report.skipped}
    assert "relative-position bias differs" in skipped["encoder.layer.0.attention.attention"]
    assert [s.path for s in report.patched] == ["encoder.layer.1.attention.attention"]


@pytest.mark.parametrize("bias", BIAS_KINDS)
def test_convert_run_reload_and_unpatch(bias, tmp_path):
    model = _model(bias)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    keys = set(model.state_dict())
    with torch.no_grad():
        before = model(x).last_hidden_state.clone()
    report = patch_model(model, VCAConfig(contrast_tokens=4))
    assert len(report.patched) == 2 and report.patched[0].notes  # approximate: the bias is named
    # Carried weights keep their names, no projection is added; a layer's own bias table goes with its original
    # module (dropped, as timm's BEiT conversion drops it; unpatch puts it back).
    own_tables = {k for k in keys if ".attention.attention.relative_position_bias." in k}
    assert len(own_tables) == (2 if "use_relative_position_bias" in bias else 0)
    assert keys - own_tables <= set(model.state_dict())
    with torch.no_grad():
        after = model(x).last_hidden_state
        other_size = model(torch.randn(1, 3, 48, 40)).last_hidden_state  # the grid follows the input
    assert after.shape == before.shape and torch.isfinite(after).all() and not torch.equal(after, before)
    assert other_size.shape == (1, 1 + 6 * 5, 32)
    vca_patch.save_pretrained(model, tmp_path / "d2v")
    again = vca_patch.from_pretrained(tmp_path / "d2v")
    with torch.no_grad():
        assert torch.equal(again(x).last_hidden_state, after)
    unpatch_model(model)
    attention = model.encoder.layer[0].attention
    assert not hasattr(attention.attention, "proj") and isinstance(attention.output.dense, torch.nn.Linear)
    assert set(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(model(x).last_hidden_state, before)
