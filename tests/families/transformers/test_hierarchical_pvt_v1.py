"""transformers PVT v1 (`PvtModel`: the CLS token of the last stage, the output projection outside the attention)
and PVT's paper mode (`pvt_mode="paper"`: the reduction dropped) in timm and transformers."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import transformers

import vca_patch
from tests.support.hierarchical import assert_unpatch_restores, randomise_vca
from tests.support.models import trained_a_little
from tests.support.reference.hierarchical import reference_reduction_vca
from tests.support.reference.vca import reference_vca
from vca_patch import NothingToPatchError, PatchError, VCAConfig, patch_model, unpatch_model
from vca_patch.core.errors import ConfigError
from vca_patch.families import adapter_for
from vca_patch.families.timm.pvt import PAPER_MODE_NOTE
from vca_patch.families.transformers.pvt_v1 import HFPvtV1Adapter
from vca_patch.surgery import inspect_model, patched_layers
from vca_patch.targets.base import TargetConfig
from vca_patch.targets.vca.reduced import SpatialReductionVCA

# Stage grids 16x16 (sr 4), 8x8 (sr 2), 4x4 + CLS (no reduction: transformers runs the CLS stage only so) at 64 px.
PVT_V1 = {"hidden_sizes": [16, 24, 32], "depths": [1, 1, 2], "num_encoder_blocks": 3, "num_attention_heads": [1, 2, 2],
          "sequence_reduction_ratios": [4, 2, 1], "patch_sizes": [4, 2, 2], "strides": [4, 2, 2],
          "mlp_ratios": [2, 2, 2], "image_size": 64}  # fmt: skip
PVT_V2 = {"hidden_sizes": [16, 32], "depths": [1, 2], "num_attention_heads": [1, 2], "sr_ratios": [4, 2],
          "num_encoder_blocks": 2, "patch_sizes": [7, 3], "strides": [4, 2], "mlp_ratios": [2, 2],
          "image_size": 64}  # fmt: skip
STAGE_TOKENS = [4, 9, 4]  # at most the stage's patches
VCA_PARAMS = {"contrast_embed_pos", "contrast_embed_neg", "lambda1", "lambda2", "stage1_norm", "stage2_norm", "dwc",
              "stage2_temperature"}  # fmt: skip


@pytest.fixture(scope="module")
def pvt() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.PvtModel(transformers.PvtConfig(**PVT_V1)).eval()


class TimmNamed:
    """A converted v1 layer as the float64 references read it: timm's names (q, kv, sr, norm) and, for the
    projection the parent applies, an identity `proj`."""

    def __init__(self, layer: torch.nn.Module) -> None:
        self.layer = layer

    def __getattr__(self, name: str):
        layer = self.__dict__["layer"]
        return layer.layer_norm if name == "norm" else getattr(layer, name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        renames = {"sequence_reduction.": "sr.", "layer_norm.": "norm."}
        state = {}
        for key, value in self.layer.state_dict().items():
            old = next((o for o in renames if key.startswith(o)), None)
            state[renames[old] + key.removeprefix(old) if old else key] = value
        for p in ("weight", "bias"):
            state["q." + p] = state["query." + p]
            state["kv." + p] = torch.cat([state["key." + p], state["value." + p]])
            state["qkv." + p] = torch.cat([state[n + "." + p] for n in ("query", "key", "value")])
        C = self.layer.attn_dim
        state["proj.weight"], state["proj.bias"] = torch.eye(C, dtype=torch.float64), torch.zeros(C)
        return state


def _max_rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected.double()).abs().max() / expected.double().abs().max())


# -- PVT v1 ---------------------------------------------------------------------------------------------------


def test_v1_gets_its_adapter_and_every_site_verifies(pvt):
    assert isinstance(adapter_for(pvt), HFPvtV1Adapter)
    model = copy.deepcopy(pvt)
    report = patch_model(model, VCAConfig(stage_contrast_tokens=STAGE_TOKENS))
    assert report.adapter == "hf-pvt-v1" and not report.skipped
    assert all(s.verified and s.exact_carry_over for s in report.patched)
    layers = patched_layers(model)
    assert list(layers) == [f"encoder.block.{i}.{j}.attention.self" for i, j in ((0, 0), (1, 0), (2, 0), (2, 1))]
    assert [v["layer_index"] for v in layers.values()] == [0, 1, 2, 3]  # global block index over the stages
    assert [v["stage"] for v in layers.values()] == [0, 1, 2, 2]
    assert [v["grid"] for v in layers.values()] == ["16x16, keys 4x4 (sr 4)", "8x8, keys 4x4 (sr 2)"] + [
        "4x4 + CLS"
    ] * 2
    assert layers["encoder.block.2.1.attention.self"]["lambda_init"] == pytest.approx(0.8 - 0.6 * 2.718281828**-0.9)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_v1_reduction_layer_matches_the_float64_reference(pvt, dtype):
    model = copy.deepcopy(pvt)
    patch_model(model, VCAConfig(stage_contrast_tokens=STAGE_TOKENS))
    layer = model.encoder.block[0][0].attention.self  # sr 4, n = 4
    assert isinstance(layer, SpatialReductionVCA) and layer.sr.stride == (4, 4)
    torch.manual_seed(1)
    randomise_vca(layer)
    layer.to(dtype)
    grid = (8, 20)  # not square; keys 2x5, upsampled back to 8x20
    x = torch.randn(2, grid[0] * grid[1], layer.attn_dim, dtype=dtype)
    expected = reference_reduction_vca(TimmNamed(layer), x, grid)
    with torch.no_grad():
        (got,) = layer(x, grid[0], grid[1], False)  # as PvtAttention calls it
    assert _max_rel(got, expected) < (4e-15 if dtype == torch.float64 else 4e-6)  # measured 7e-16 / 5e-7


def test_v1_cls_stage_reads_the_cls_token_as_a_prefix(pvt):
    model = copy.deepcopy(pvt)
    patch_model(model, VCAConfig(stage_contrast_tokens=STAGE_TOKENS))
    layer = model.encoder.block[2][1].attention.self
    assert layer.sr is None
    torch.manual_seed(2)
    randomise_vca(layer)
    layer.double()
    grid = (3, 5)
    x = torch.randn(2, 1 + grid[0] * grid[1], layer.attn_dim, dtype=torch.float64)
    with torch.no_grad():
        (got,) = layer(hidden_states=x, height=grid[0], width=grid[1])
    expected = reference_vca(TimmNamed(layer), x, 1, grid)  # exact prefix read-out: the CLS reads all keys
    assert _max_rel(got, expected) < 4e-15  # measured 6e-16
    with pytest.raises(ValueError, match="do not fill"):
        layer(x[:, :10], grid[0], grid[1])


def test_v1_whole_model_at_two_grids_and_the_projection_stays_outside(pvt):
    model = copy.deepcopy(pvt)
    dense = model.encoder.block[1][0].attention.output.dense
    keys_before = set(model.state_dict())
    patch_model(model, VCAConfig(stage_contrast_tokens=STAGE_TOKENS))
    assert model.encoder.block[1][0].attention.output.dense is dense  # the block still projects
    keys = set(model.state_dict())
    assert keys_before <= keys
    assert {k.rsplit(".attention.self.", 1)[1].split(".")[0] for k in keys - keys_before} <= VCA_PARAMS
    layouts = []
    for module in model.modules():
        if isinstance(module, SpatialReductionVCA):
            original = module.attend

            def spy(x, q, k, v, layout, *rest, _orig=original):
                layouts.append((layout.num_prefix_tokens, layout.grid))
                return _orig(x, q, k, v, layout, *rest)

            module.attend = spy
            module._fused_kernel_usable = lambda x: False  # every call through `attend`
    with torch.no_grad():
        a = model(torch.randn(1, 3, 64, 64)).last_hidden_state
        b = model(torch.randn(2, 3, 32, 128)).last_hidden_state  # transformers' PVT v1 keeps the token count
    assert a.shape == (1, 17, 32) and b.shape == (2, 17, 32) and torch.isfinite(a).all() and torch.isfinite(b).all()
    assert layouts == [(0, (16, 16)), (0, (8, 8)), (1, (4, 4)), (1, (4, 4)), (0, (8, 32)), (0, (4, 16)),
                       (1, (2, 8)), (1, (2, 8))]  # fmt: skip


def test_v1_unpatch_restores_bit_identically(pvt):
    model = copy.deepcopy(pvt)
    assert_unpatch_restores(model, torch.randn(1, 3, 64, 64), lambda m, x: m(x).last_hidden_state)
    assert type(model.encoder.block[0][0].attention.self).__name__ == "PvtEfficientSelfAttention"


def test_v1_save_and_reload_round_trip(tmp_path):
    torch.manual_seed(0)
    model = transformers.PvtForImageClassification(transformers.PvtConfig(**PVT_V1, num_labels=3)).eval()
    patch_model(model, VCAConfig(stage_contrast_tokens=STAGE_TOKENS))
    trained_a_little(model, "contrast_embed", "dwc", "lambda", "sequence_reduction.", "key.", "dense.")
    vca_patch.save_pretrained(model, tmp_path / "pvt1")
    again = vca_patch.from_pretrained(tmp_path / "pvt1")
    assert type(again) is type(model) and patched_layers(again) == patched_layers(model)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model.eval()(x).logits)


def test_v1_cls_stage_with_a_reduction_is_skipped_with_the_reason():
    config = {**PVT_V1, "sequence_reduction_ratios": [4, 2, 2]}  # transformers cannot run this stage either
    model = transformers.PvtModel(transformers.PvtConfig(**config))
    report = inspect_model(model, VCAConfig(stage_contrast_tokens=STAGE_TOKENS))
    assert [s.path for s in report.patched] == ["encoder.block.0.0.attention.self", "encoder.block.1.0.attention.self"]
    assert {s.path for s in report.skipped} == {"encoder.block.2.0.attention.self", "encoder.block.2.1.attention.self"}
    assert all("verification raised" in s.reason for s in report.skipped)


# -- pvt_mode="paper": the reduction dropped ------------------------------------------------------------------


def test_paper_mode_config_round_trips_and_validates():
    config = VCAConfig(pvt_mode="paper")
    assert TargetConfig.from_json(config.to_json()) == config and VCAConfig().pvt_mode == "carry"
    with pytest.raises(ConfigError, match="'carry' or 'paper'"):
        VCAConfig(pvt_mode="global")


@pytest.fixture(scope="module")
def timm_pvt() -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model("pvt_v2_b0", pretrained=False).eval()


@pytest.mark.parametrize("family", ["timm", "hf-v2", "hf-v1"])
def test_paper_mode_is_global_vca_over_full_resolution_keys(family, timm_pvt):
    if family == "timm":
        model, path = copy.deepcopy(timm_pvt), "stages.0.blocks.0.attn"
    elif family == "hf-v2":
        torch.manual_seed(0)
        model, path = (
            transformers.PvtV2Model(transformers.PvtV2Config(**PVT_V2)).eval(),
            "encoder.layers.0.blocks.0.attention",
        )
    else:
        torch.manual_seed(0)
        model, path = transformers.PvtModel(transformers.PvtConfig(**PVT_V1)).eval(), "encoder.block.0.0.attention.self"
    original = model.get_submodule(path)
    sr_name = {"timm": "sr", "hf-v2": "spatial_reduction", "hf-v1": "sequence_reduction"}[family]
    keys_before = set(model.state_dict())
    report = patch_model(model, VCAConfig(pvt_mode="paper", stage_contrast_tokens=[4, 9, 4, 4]))
    by_path = {s.path: s for s in report.patched}
    assert PAPER_MODE_NOTE in by_path[path].notes and not by_path[path].exact_carry_over
    layer = model.get_submodule(path)
    assert isinstance(layer, SpatialReductionVCA) and layer.sr is None and sr_name not in layer._modules
    settings = patched_layers(model)[path]
    assert settings["mode"] == "reduction-dropped" and settings["grid"].endswith("(sr dropped)")
    dropped = {k for k in keys_before - set(model.state_dict())}
    assert dropped and all(f".{sr_name}." in k or k.split(".")[-2] in ("norm", "layer_norm") for k in dropped)
    # The layer is plain VCA over the full grid: its q/k/v read the block input (no reduction), float64 reference.
    torch.manual_seed(3)
    randomise_vca(layer)
    layer.double()
    grid = (6, 10)
    x = torch.randn(2, grid[0] * grid[1], layer.attn_dim, dtype=torch.float64)
    with torch.no_grad():
        got = layer(x, grid) if family == "timm" else layer(x, grid[0], grid[1])[0]
    if family == "timm":
        state = layer.state_dict()
        fused = {f"qkv.{p}": torch.cat([state[f"q.{p}"], state[f"kv.{p}"]]) for p in ("weight", "bias")}
        shim = copy.deepcopy(layer)
        shim.state_dict = lambda: {**state, **fused}
    elif family == "hf-v1":
        shim = TimmNamed(layer)
    else:
        state = layer.state_dict()
        fused = {
            f"qkv.{p}": torch.cat([state[f"{n}.{p}"] for n in ("query", "key", "value")]) for p in ("weight", "bias")
        }
        shim = copy.deepcopy(layer)
        shim.state_dict = lambda: {**state, **fused}
    assert _max_rel(got, reference_vca(shim, x, 0, grid)) < 4e-15  # measured <= 1e-15
    unpatch_model(model)
    assert model.get_submodule(path) is original and getattr(original, sr_name) is not None


def test_paper_mode_is_refused_by_strict_and_the_carry_is_not(timm_pvt):
    with pytest.raises(PatchError, match="pvt_mode='paper'"):
        patch_model(copy.deepcopy(timm_pvt), VCAConfig(pvt_mode="paper"), strict=True)
    report = inspect_model(timm_pvt, VCAConfig(), strict=True)
    assert all(s.exact_carry_over for s in report.patched)
    # The last stage has no reduction (sr 1): the paper mode changes nothing there, and says nothing.
    report = inspect_model(timm_pvt, VCAConfig(pvt_mode="paper"))
    last = [s for s in report.patched if s.path.startswith("stages.3.")]
    assert last and all(s.exact_carry_over and s.settings["mode"] == "reduction-kept" for s in last)


def test_paper_mode_skips_linear_attention_models_with_the_reason():
    model = timm.create_model("pvt_v2_b0", pretrained=False, linear=True)  # pvt_v2_b2_li's attention, smaller
    assert all(getattr(b.attn, "pool", None) is not None for s in model.stages for b in s.blocks)
    with pytest.raises(NothingToPatchError, match="linear attention already"):
        inspect_model(model, VCAConfig(pvt_mode="paper"))
    hf = transformers.PvtV2Model(transformers.PvtV2Config(**PVT_V2, linear_attention=True))
    with pytest.raises(NothingToPatchError, match="linear attention already"):
        inspect_model(hf, VCAConfig(pvt_mode="paper"))


def test_paper_mode_save_and_reload_round_trip(tmp_path):
    torch.manual_seed(0)
    model = transformers.PvtV2ForImageClassification(transformers.PvtV2Config(**PVT_V2, num_labels=3)).eval()
    patch_model(model, VCAConfig(pvt_mode="paper", stage_contrast_tokens=[4, 9]))
    trained_a_little(model, "contrast_embed", "dwc", "lambda", "key.")
    vca_patch.save_pretrained(model, tmp_path / "paper")
    again = vca_patch.from_pretrained(tmp_path / "paper")
    assert patched_layers(again) == patched_layers(model)
    assert {v["mode"] for v in patched_layers(again).values()} == {"reduction-dropped"}
    x = torch.randn(1, 3, 48, 64)
    with torch.no_grad():
        assert torch.equal(again(x).logits, model.eval()(x).logits)
