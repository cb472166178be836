"""Fidelity, evaluation and attention transfer on hierarchical models, whose layers only run inside their blocks.

PVT's and Swin's patched layers take their grid, windows and shift from hooks on their blocks, so their adapters
say `layers_run_alone = False` and the teacher-forced numbers come from one forward of the patched model with each
layer's input swapped for the original's (`train.forced`); ViTs keep calling each layer alone.
"""

from __future__ import annotations

import itertools
import math

import pytest
import timm
import torch
import transformers

from vca_patch import VCAConfig, patch_model
from vca_patch.eval.fidelity import fidelity
from vca_patch.recovery.capture import patched_modules
from vca_patch.train import teacher_from
from vca_patch.train.evaluation import image_terms, summarize
from vca_patch.train.forced import forced_forward, layer_outputs, layers_run_alone
from vca_patch.train.objective import teacher_attention, transfer_loss

# Stage grids 16/8/4 at 64 px, windows 4 (shifted by 2 in every second block); the last stage stays windowed.
SWIN_ARGS = {"img_size": 64, "embed_dim": 16, "depths": [2, 2, 2], "num_heads": [1, 2, 4], "window_size": 4}
HF_SWIN = {"embed_dim": 16, "depths": [2, 2], "num_heads": [2, 4], "window_size": 4, "image_size": 64, "patch_size": 4}
HF_PVT = {"hidden_sizes": [16, 32], "depths": [1, 2], "num_attention_heads": [1, 2], "sr_ratios": [4, 2],
          "num_encoder_blocks": 2, "patch_sizes": [7, 3], "strides": [4, 2], "mlp_ratios": [2, 2],
          "image_size": 64}  # fmt: skip
PVT_ARGS = {"embed_dims": (16, 32, 32, 32), "num_heads": (1, 2, 2, 2), "depths": (1, 1, 1, 1)}
EXACT_ROUNDING = 1e-6  # residual Swin at init: the window attention plus a zero-gated branch (measured 1.2e-7)


def _images(size: int = 64, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(1))


def _timm_swin(mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("swin_tiny_patch4_window7_224", pretrained=False, num_classes=5, **SWIN_ARGS).eval()
    patch_model(model, VCAConfig(swin_mode=mode, stage_contrast_tokens=[4, 4, 4]))
    return model


def _timm_pvt(mode: str = "carry") -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("pvt_v2_b0", pretrained=False, num_classes=5, **PVT_ARGS).eval()
    patch_model(model, VCAConfig(pvt_mode=mode, stage_contrast_tokens=[4, 4, 4, 4]))
    return model


def _hf(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "swin":
        model = transformers.SwinModel(transformers.SwinConfig(**HF_SWIN)).eval()
    else:
        model = transformers.PvtV2Model(transformers.PvtV2Config(**HF_PVT)).eval()
    patch_model(model, VCAConfig(stage_contrast_tokens=[4, 4]))
    return model


def _vit(depth: int) -> torch.nn.Module:
    torch.manual_seed(0)
    model = timm.create_model("deit_tiny_patch16_224", pretrained=False, depth=depth).eval()
    patch_model(model, VCAConfig())
    return model


def test_adapters_say_whether_their_layers_run_alone():
    vit = _vit(1)
    assert layers_run_alone(vit)
    assert not layers_run_alone(_timm_swin("residual")) and not layers_run_alone(_timm_pvt())
    assert not layers_run_alone(_hf("swin")) and not layers_run_alone(_hf("pvt"))


def test_residual_swin_is_exact_at_init_in_fidelity():
    model = _timm_swin("residual")
    report = fidelity(None, model, [_images()])
    assert len(report.layer_error) == 4  # stages 1-2 patched, the last stage left windowed
    assert max(report.layer_error) < EXACT_ROUNDING and max(report.layer_error_free) < EXACT_ROUNDING
    assert report.patch_cosine == pytest.approx(1.0, abs=1e-6)
    hf = fidelity(None, _hf("swin"), [_images()])
    assert len(hf.layer_error) == 2 and max(hf.layer_error) < EXACT_ROUNDING


@pytest.mark.parametrize("build", [lambda: _timm_swin("global"), _timm_pvt, lambda: _timm_pvt("paper"),
                                   lambda: _hf("swin"), lambda: _hf("pvt")])  # fmt: skip
def test_teacher_forced_error_is_finite_and_starts_where_free_running_does(build):
    model = build()
    report = fidelity(None, model, [_images()])
    assert all(math.isfinite(e) and e >= 0 for e in report.layer_error + report.layer_error_free)
    # Layer 0 sees the same input either way; later layers see the original's input only when teacher-forced.
    assert report.layer_error[0] == pytest.approx(report.layer_error_free[0], rel=1e-6)


def test_forced_outputs_equal_each_layer_called_on_the_originals_input_with_its_grid():
    """timm PVT hands each attention call its `feat_size`: calling the layer directly with the original's input and
    that grid is an independent check of the input swap inside the forced forward."""
    model = _timm_pvt()
    teacher = teacher_from(model)
    paths = list(patched_modules(model))
    grids: dict[str, tuple[int, int]] = {}
    handles = [
        teacher.get_submodule(p).register_forward_hook(lambda m, a, o, p=p: grids.__setitem__(p, tuple(a[1])))
        for p in paths
    ]
    x = _images()
    captured, _, _ = teacher_attention(teacher, paths, x)
    for h in handles:
        h.remove()
    forced = layer_outputs(model, captured, x, layout=lambda: pytest.fail("PVT layers are not called alone"))
    with torch.no_grad():
        for p in paths:
            direct = model.get_submodule(p)(captured[p][0], grids[p])
            torch.testing.assert_close(forced[p], direct, rtol=0, atol=1e-6)
    assert len({grids[p] for p in paths}) == 4  # one grid per stage: the layers did need their own grids


def test_vit_path_is_unchanged_and_matches_a_forced_forward():
    model = _vit(2)
    teacher = teacher_from(model)
    x = _images(224)
    paths = list(patched_modules(model))
    captured, _, _ = teacher_attention(teacher, paths, x)
    layout = model.vca_patch_state.adapter.default_layout(model)
    with torch.no_grad():
        alone = layer_outputs(model, captured, x, layout)
        expected = {p: model.get_submodule(p)(captured[p][0], layout=layout) for p in paths}
        forced = forced_forward(model, captured, x)
    for p in paths:
        assert torch.equal(alone[p], expected[p])  # the ViT path calls each layer alone, as before
        torch.testing.assert_close(forced[p], alone[p], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["swin", "pvt"])
def test_engine_evaluation_agrees_with_fidelity(kind):
    model = _hf(kind)
    teacher = teacher_from(model)
    x = _images()
    with torch.no_grad():
        evaluated = summarize(image_terms(model, teacher, x, None))["layer_error"]
    expected = fidelity(teacher, model, [x]).layer_error
    assert evaluated == pytest.approx(expected, rel=1e-4)  # float64 sums in another order


def test_attention_transfer_on_global_swin_lowers_its_loss_and_trains_only_attention():
    model = _timm_swin("global").train()
    teacher = teacher_from(model)
    x = _images(batch=4)
    trainable = [p for n, p in model.named_parameters() if "contrast_embed" in n or "dwc" in n or "norm" in n]
    optimizer = torch.optim.Adam(trainable, lr=2e-2)
    losses = []
    for step in range(6):
        optimizer.zero_grad()
        loss = transfer_loss(model, teacher, x)
        loss.backward()
        if step == 0:
            assert model.patch_embed.proj.weight.grad is None  # gradients reach the attention layers only
            assert model.head.fc.weight.grad is None
            vca_grads = [p.grad for n, p in model.named_parameters() if "contrast_embed" in n]
            assert vca_grads and all(g is not None and g.abs().sum() > 0 for g in vca_grads)
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(v) for v in losses)
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < 0.7 * losses[0], losses
