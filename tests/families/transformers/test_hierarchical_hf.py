"""transformers PVTv2 and Swin: the hierarchical conversions of timm (`test_hierarchical_{pvt,swin}`) on HF models.

PVTv2: spatial reduction kept (query/key/value, spatial_reduction, layer_norm, proj carried under their names).
Swin: "residual" (window attention + zero-gated global VCA, exact at init) and "global" (approximate).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from transformers.models.swin import modeling_swin

import vca_patch
from tests.support.hierarchical import (
    assert_state_restored,
    assert_unpatch_restores,
    gradients_without_and_with_checkpointing,
    randomise_vca,
    record_attend_grids,
)
from tests.support.models import trained_a_little
from tests.support.reference.hierarchical import (
    reference_reduction_vca,
    reference_window_attention,
    reference_windowed_vca,
)
from vca_patch import NothingToPatchError, PatchError, VCAConfig, patch_model, unpatch_model
from vca_patch.families import adapter_for
from vca_patch.families.transformers.pvt import HFPvtAdapter
from vca_patch.families.transformers.swin import (
    HFSwinAdapter,
    PaddedShiftWindowCall,
    RecordingClamp,
    SwinLayerWindowEnd,
    SwinLayerWindowHook,
)
from vca_patch.families.transformers.vision import HFVisionAdapter
from vca_patch.surgery import inspect_model, patched_layers
from vca_patch.targets.vca.reduced import SpatialReductionVCA
from vca_patch.targets.vca.windowed import WindowedVCA

PVT = {"hidden_sizes": [16, 32], "depths": [1, 2], "num_attention_heads": [1, 2], "sr_ratios": [4, 2],
       "num_encoder_blocks": 2, "patch_sizes": [7, 3], "strides": [4, 2], "mlp_ratios": [2, 2],
       "image_size": 64}  # fmt: skip
# Stage grids 16/8/4 at 64 px; windows 4, shifted by 2 in every second block; the last stage stays windowed.
SWIN = {"embed_dim": 16, "depths": [2, 2, 2], "num_heads": [1, 2, 4], "window_size": 4, "image_size": 64,
        "patch_size": 4}  # fmt: skip
VCA_PARAMS = {"contrast_embed_pos", "contrast_embed_neg", "lambda1", "lambda2", "stage1_norm", "stage2_norm", "dwc",
              "stage2_temperature", "residual_gate"}  # fmt: skip


@pytest.fixture(scope="module")
def pvt() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.PvtV2Model(transformers.PvtV2Config(**PVT)).eval()


@pytest.fixture(scope="module")
def swin() -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.SwinModel(transformers.SwinConfig(**SWIN)).eval()
    with torch.no_grad():  # transformers initialises the tables to zero: give the bias something to show
        for name, p in model.named_parameters():
            if name.endswith("relative_position_bias_table"):
                p.normal_(0, 0.5)
    return model


class TimmNamed:
    """A converted HF layer as the float64 references read it: timm's member names (qkv, q/kv, proj, sr, norm,
    relative_position_bias_table), everything else delegated to the layer."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer

    def __getattr__(self, name: str):
        layer = self.__dict__["layer"]
        if name == "norm" and "layer_norm" in layer._modules:
            return layer.layer_norm
        if name == "relative_position_index" and "relative_position_bias" in layer._modules:
            return layer.relative_position_bias.relative_position_index
        return getattr(layer, name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        renames = {"spatial_reduction.": "sr.", "layer_norm.": "norm.", "o_proj.": "proj.",
                   "relative_position_bias.relative_position_bias_table": "relative_position_bias_table"}  # fmt: skip
        state = {}
        for key, value in self.layer.state_dict().items():
            for old, new in renames.items():
                key = new + key.removeprefix(old) if key.startswith(old) else key
            state[key] = value
        for p in ("weight", "bias"):
            if "query." + p in state:  # PVT: q and kv (k then v)
                state["q." + p] = state["query." + p]
                state["kv." + p] = torch.cat([state["key." + p], state["value." + p]])
            if "q_proj." + p in state:  # Swin: fused qkv
                state["qkv." + p] = torch.cat([state[f"{n}_proj.{p}"] for n in "qkv"])
        return state


def _max_rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


# -- adapter choice -------------------------------------------------------------------------------------------


def test_hierarchical_models_get_their_own_adapters(pvt, swin):
    assert isinstance(adapter_for(pvt), HFPvtAdapter) and isinstance(adapter_for(swin), HFSwinAdapter)
    classifier = transformers.SwinForImageClassification(transformers.SwinConfig(**SWIN))
    assert isinstance(adapter_for(classifier), HFSwinAdapter)
    assert not any(HFVisionAdapter.applies_to(m) for m in (pvt, swin, classifier))
    vit = transformers.ViTModel(transformers.ViTConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                       intermediate_size=32, image_size=32, patch_size=8))  # fmt: skip
    assert isinstance(adapter_for(vit), HFVisionAdapter)  # the plain ViTs still go to hf-vision


# -- PVTv2 ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_pvt_layer_matches_the_float64_reference(pvt, dtype):
    model = copy.deepcopy(pvt)
    patch_model(model)
    layer = model.encoder.layers[0].blocks[0].attention  # sr 4, n = 9
    assert isinstance(layer, SpatialReductionVCA) and layer.sr.stride == (4, 4)
    torch.manual_seed(1)
    randomise_vca(layer)
    layer.to(dtype)
    grid = (8, 20)  # not square; keys 2x5, upsampled back to 8x20
    x = torch.randn(2, grid[0] * grid[1], layer.attn_dim, dtype=dtype)
    expected = reference_reduction_vca(TimmNamed(layer), x, grid)
    with torch.no_grad():
        (got,) = layer(hidden_states=x, height=grid[0], width=grid[1], output_attentions=False)  # as PVTv2 calls
    assert _max_rel(got, expected) < (4e-15 if dtype == torch.float64 else 4e-6)  # measured 6e-16 / 6e-7


def test_pvt_report_verification_and_global_block_index(pvt):
    model = copy.deepcopy(pvt)
    report = patch_model(model)
    assert all(s.verified and s.exact_carry_over for s in report.patched) and not report.skipped
    layers = patched_layers(model)
    assert [v["layer_index"] for v in layers.values()] == [0, 1, 2]  # over both stages
    assert [v["contrast_tokens"] for v in layers.values()] == [9, 16, 16]
    assert [v["grid"] for v in layers.values()] == ["16x16, keys 4x4 (sr 4)"] + ["8x8, keys 4x4 (sr 2)"] * 2
    assert {v["mode"] for v in layers.values()} == {"reduction-kept"}
    assert layers["encoder.layers.1.blocks.1.attention"]["lambda_init"] == pytest.approx(
        0.8 - 0.6 * 2.718281828 ** (-0.6)
    )

    tampered = copy.deepcopy(pvt)
    attn = tampered.encoder.layers[1].blocks[0].attention
    original = attn.forward
    attn.forward = lambda *a, **k: (original(*a, **k)[0] * 1.01,)
    report = inspect_model(tampered)
    (skip,) = [s for s in report.skipped if s.path == "encoder.layers.1.blocks.0.attention"]
    assert "reference spatial-reduction attention differs" in skip.reason


def test_pvt_carried_modules_and_state_dict_keys_are_kept(pvt):
    model = copy.deepcopy(pvt)
    attn = model.encoder.layers[0].blocks[0].attention
    members = [attn.query, attn.key, attn.value, attn.spatial_reduction, attn.layer_norm, attn.proj]
    keys_before = set(model.state_dict())
    patch_model(model)
    layer = model.encoder.layers[0].blocks[0].attention
    assert [layer.query, layer.key, layer.value, layer.spatial_reduction, layer.layer_norm, layer.proj] == members
    keys = set(model.state_dict())
    assert keys_before <= keys
    assert {k.rsplit(".attention.", 1)[1].split(".")[0] for k in keys - keys_before} <= VCA_PARAMS


def test_pvt_forward_at_two_resolutions_uses_each_stages_grid(pvt):
    model = copy.deepcopy(pvt)
    patch_model(model)
    grids = []
    for module in model.modules():
        if isinstance(module, SpatialReductionVCA):  # registered after the call shim: sees (x, (H, W))
            module.register_forward_pre_hook(lambda m, args: grids.append(tuple(args[1])))
    with torch.no_grad():
        a = model(torch.randn(1, 3, 64, 64)).last_hidden_state
        b = model(torch.randn(2, 3, 40, 56)).last_hidden_state
    assert a.shape == (1, 32, 8, 8) and b.shape == (2, 32, 5, 7)
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    assert grids == [(16, 16), (8, 8), (8, 8), (10, 14), (5, 7), (5, 7)]


def test_pvt_unpatch_restores_bit_identically(pvt):
    model = copy.deepcopy(pvt)
    assert_unpatch_restores(model, torch.randn(1, 3, 48, 64), lambda m, x: m(x).last_hidden_state)
    assert type(model.encoder.layers[0].blocks[0].attention).__name__ == "PvtV2SelfAttention"


def test_pvt_save_and_reload_round_trip(tmp_path):
    torch.manual_seed(0)
    model = transformers.PvtV2ForImageClassification(transformers.PvtV2Config(**PVT, num_labels=3)).eval()
    patch_model(model, VCAConfig(stage_contrast_tokens=[4, 9]))
    trained_a_little(model, "contrast_embed", "dwc", "lambda", "spatial_reduction.", "key.")
    vca_patch.save_pretrained(model, tmp_path / "pvt")
    again = vca_patch.from_pretrained(tmp_path / "pvt")
    assert type(again) is type(model) and patched_layers(again) == patched_layers(model)
    assert [v["contrast_tokens"] for v in patched_layers(again).values()] == [4, 9, 9]
    x = torch.randn(1, 3, 56, 40)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model.eval()(x).logits)


def test_pvt_linear_attention_is_skipped_with_the_reason():  # PVT v1: tests/test_hierarchical_pvt_v1.py
    linear = transformers.PvtV2Model(transformers.PvtV2Config(**PVT, linear_attention=True))
    with pytest.raises(NothingToPatchError, match="linear attention already"):
        inspect_model(linear)


def test_output_attentions_is_refused_with_the_reason(pvt, swin):
    model = copy.deepcopy(pvt)
    patch_model(model)
    with pytest.raises(ValueError, match="no attention weights"):
        model(torch.randn(1, 3, 64, 64), output_attentions=True)
    model = copy.deepcopy(swin)
    patch_model(model)
    with pytest.raises(TypeError, match="output_attentions: VCA has no per-window attention weights"):
        model(torch.randn(1, 3, 64, 64), output_attentions=True)


# -- Swin -----------------------------------------------------------------------------------------------------


def test_padded_shift_window_call_matches_transformers_partition(swin):
    block = copy.deepcopy(swin.encoder.layers[0].blocks[1])  # shift 2, window 4
    assert (block.window_size, block.shift_size) == (4, 2)
    grid = torch.randn(2, 6, 9, 5)  # padded to 8 x 12, then rolled: the order matters
    padded, _ = block.maybe_pad(grid, 6, 9)
    expected = modeling_swin.window_partition(block.cyclic_shift(padded), 4).view(-1, 16, 5)
    call = PaddedShiftWindowCall((6, 9), (4, 4), (2, 2))
    assert torch.equal(call.grid_to_windows(grid), expected)
    assert torch.equal(call.windows_to_grid(expected), grid)


def test_window_attention_reference_reproduces_transformers(swin):
    model = copy.deepcopy(swin)
    original = copy.deepcopy(model.encoder.layers[1].blocks[1].attention).double()
    patch_model(model)
    layer = model.encoder.layers[1].blocks[1].attention  # carries the same weights under the same names
    x = torch.randn(2 * 4, 16, 32, dtype=torch.float64)
    mask = swin.encoder.layers[1].blocks[1].get_attn_mask(8, 8, torch.float64, x.device)  # the shift mask
    assert mask is not None and mask.shape == (4, 16, 16) and (mask != 0).any()
    for m in (None, mask):
        with torch.no_grad():
            expected = original(x, m)[0]
        assert _max_rel(reference_window_attention(TimmNamed(layer), x, m), expected) < 1e-12


@pytest.mark.parametrize("mode", ["residual", "global"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_swin_layer_matches_the_float64_reference(swin, mode, dtype):
    model = copy.deepcopy(swin)
    patch_model(model, VCAConfig(swin_mode=mode))
    layer = model.encoder.layers[1].blocks[1].attention  # 2 heads, n = 16
    torch.manual_seed(3)
    randomise_vca(layer)
    layer.to(dtype)
    call = PaddedShiftWindowCall((8, 12), (4, 4), (2, 2))  # whole windows: both partition orders agree
    layer.window_source = lambda: call
    grid = torch.randn(2, 8, 12, layer.attn_dim, dtype=dtype)
    mask = torch.where(torch.rand(call.num_windows, 16, 16) < 0.3, -100.0, 0.0).to(dtype)
    with torch.no_grad():
        got, weights = layer(call.grid_to_windows(grid), mask)
    assert weights is None
    expected = reference_windowed_vca(TimmNamed(layer), grid, call.window, call.shift, mask)
    assert _max_rel(got, expected) < (4e-15 if dtype == torch.float64 else 4e-6)  # measured ≤ 1.2e-15 / 6e-7


def test_swin_residual_mode_is_exact_at_init_shifted_and_padded_blocks_included(swin):
    model = copy.deepcopy(swin)
    report = patch_model(model)  # residual is the default
    assert [s.path for s in report.patched] == [f"encoder.layers.{i}.blocks.{j}.attention" for i in (0, 1)
                                                for j in (0, 1)]  # fmt: skip
    assert all(s.verified and s.exact_carry_over and not s.notes for s in report.patched)
    assert {s.reason for s in report.skipped} == {"last stage stays window attention (the paper's placement: VCA in "
                                                  "stages 1-3)"}  # fmt: skip
    assert [s.layer_index for s in report.patched] == [0, 1, 2, 3]
    assert [v["grid"] for v in patched_layers(model).values()] == ["window 4x4 + global 16x16"] * 2 + [
        "window 4x4 + global 8x8"
    ] * 2
    seen = record_attend_grids(model, WindowedVCA)
    calls = []
    for module in model.modules():
        if isinstance(module, WindowedVCA):
            module.window_source = lambda _orig=module.window_source: calls.append(_orig()) or calls[-1]
    for size in [(64, 64), (72, 88)]:  # 72 x 88: 18 x 22 and 9 x 11 grids, padded to whole 4 x 4 windows
        x = torch.randn(2, 3, *size)
        with torch.no_grad():
            got, expected = model(x).last_hidden_state, swin(x).last_hidden_state
        assert _max_rel(got, expected) < 1e-5  # measured 0 (the same SDPA call)
    assert seen == [(16, 16), (16, 16), (8, 8), (8, 8), (18, 22), (18, 22), (9, 11), (9, 11)]
    assert all(type(c) is PaddedShiftWindowCall for c in calls)  # transformers pads, then shifts
    assert [(c.padded, c.shift) for c in calls[4:]] == [((20, 24), (0, 0)), ((20, 24), (2, 2)),
                                                        ((12, 12), (0, 0)), ((12, 12), (2, 2))]  # fmt: skip

    layer = model.encoder.layers[0].blocks[1].attention
    with torch.no_grad():
        layer.residual_gate.fill_(0.1)  # the global branch is live once the gate opens
        x = torch.randn(1, 3, 64, 64)
        assert _max_rel(model(x).last_hidden_state, swin(x).last_hidden_state) > 1e-3


def test_swin_residual_keeps_the_state_dict_keys(swin):
    model = copy.deepcopy(swin)
    bias = model.encoder.layers[0].blocks[0].attention.relative_position_bias
    keys_before = set(model.state_dict())
    patch_model(model)
    assert model.encoder.layers[0].blocks[0].attention.relative_position_bias is bias  # carried whole
    keys = set(model.state_dict())
    assert keys_before <= keys
    assert {k.rsplit(".attention.", 1)[1].split(".")[0] for k in keys - keys_before} <= VCA_PARAMS


def test_swin_global_mode_is_reported_approximate_and_drops_the_bias(swin):
    model = copy.deepcopy(swin)
    report = patch_model(model, VCAConfig(swin_mode="global", stage2_temperature=False, prefix_readout="contrast"))
    layers = patched_layers(model)
    assert [v["grid"] for v in layers.values()] == ["global 16x16"] * 2 + ["global 8x8"] * 2
    assert all(any("relative-position bias" in note for note in s.notes) for s in report.patched)
    assert not any("relative_position_bias" in k for k in model.state_dict() if ".layers.2." not in k)
    # 2nC + 10d + 10C per layer, minus the (2·4−1)² × heads bias table.
    expected = sum(2 * (2 * n * c + 10 * c // m + 10 * c - 49 * m) for c, m, n in [(16, 1, 9), (32, 2, 16)])
    assert report.params_added == expected
    seen = record_attend_grids(model, WindowedVCA)
    with torch.no_grad():
        a, b = model(torch.randn(1, 3, 64, 64)), model(torch.randn(2, 3, 72, 88))
    assert torch.isfinite(a.last_hidden_state).all() and torch.isfinite(b.last_hidden_state).all()
    assert seen == [(16, 16), (16, 16), (8, 8), (8, 8), (18, 22), (18, 22), (9, 11), (9, 11)]
    with pytest.raises(PatchError, match="strict mode refuses"):
        patch_model(copy.deepcopy(swin), VCAConfig(swin_mode="global"), strict=True)


@pytest.mark.parametrize("mode", ["residual", "global"])
def test_swin_unpatch_restores_bit_identically_and_removes_the_hooks(swin, mode):
    model = copy.deepcopy(swin)
    x = torch.randn(1, 3, 64, 64)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model, VCAConfig(swin_mode=mode))
    assert any(
        isinstance(h, SwinLayerWindowHook) for h in model.encoder.layers[0].blocks[0]._forward_pre_hooks.values()
    )
    unpatch_model(model)
    assert type(model.encoder.layers[0].blocks[0].attention).__name__ == "SwinAttention"
    assert_state_restored(model, state)
    for module in model.modules():
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        assert not any(isinstance(h, (SwinLayerWindowHook, SwinLayerWindowEnd)) for h in hooks)
        assert not module._forward_pre_hooks_with_kwargs
        assert not isinstance(module.__dict__.get("set_shift_and_window_size"), RecordingClamp)
    with torch.no_grad():
        assert torch.equal(model(x).last_hidden_state, swin(x).last_hidden_state)


@pytest.mark.parametrize("mode", ["residual", "global"])
def test_swin_save_reload_and_deepcopy(mode, tmp_path):
    torch.manual_seed(0)
    model = transformers.SwinForImageClassification(transformers.SwinConfig(**SWIN, num_labels=3)).eval()
    patch_model(model, VCAConfig(swin_mode=mode))
    trained_a_little(model, "contrast_embed", "dwc", "residual_gate", "q_proj.", "relative_position")
    vca_patch.save_pretrained(model, tmp_path / "swin")
    again = vca_patch.from_pretrained(tmp_path / "swin")
    assert type(again) is type(model) and patched_layers(again) == patched_layers(model)
    twin = copy.deepcopy(model)
    x = torch.randn(1, 3, 72, 88)
    with torch.no_grad():
        expected = model.eval()(x).logits
        assert torch.equal(again(x).logits, expected)
        assert torch.equal(twin(x).logits, expected)


@pytest.mark.parametrize("family", ["swin", "pvt"])
def test_gradient_checkpointing_gives_the_same_gradients(family):
    """transformers recomputes a checkpointed layer's `forward` without its hooks: the grid must still be found."""
    torch.manual_seed(0)
    if family == "swin":
        config = transformers.SwinConfig(**SWIN, num_labels=3, drop_path_rate=0.0)  # no randomness in train()
        model = transformers.SwinForImageClassification(config)
    else:
        model = transformers.PvtV2ForImageClassification(transformers.PvtV2Config(**PVT, num_labels=3))
    patch_model(model)
    trained_a_little(model, "residual_gate", "contrast_embed", "dwc")  # the VCA branch contributes
    grads = gradients_without_and_with_checkpointing(model, torch.randn(2, 3, 72, 88))
    assert grads[0].keys() == grads[1].keys() and any("contrast_embed" in n for n in grads[0])
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-4, atol=1e-6) for n in grads[0])


def test_swinv2_goes_to_the_swin_adapter():  # converted since issue 17: tests/test_hierarchical_swinv2.py
    model = transformers.Swinv2Model(transformers.Swinv2Config(**SWIN))
    assert isinstance(adapter_for(model), HFSwinAdapter)
    assert [s.path.endswith(".attention.self") for s in inspect_model(model).patched] == [True] * 4
