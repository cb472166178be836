"""Flux single-stream blocks through diffusers: one [text; image] sequence, shared q/k/v, rotary on both, no output
projection. Verification, a float64 reference for both rope_contrast modes, exact text rows, denoising, unpatch,
save/reload with the rotary choice kept."""

from __future__ import annotations

import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[diffusers]')")

from tests.support.diffusers_models import (  # noqa: E402
    flux_call,
    flux_denoise,
    flux_rotary,
    latent,
    patch_save_reload,
    processor_impostor,
    record_grids,
    reference_rope,
    rel,
    tiny_flux,
)
from tests.support.reference.vca import _depthwise3x3, _lam, _pool, _rms, _softmax  # noqa: E402
from vca_patch import MANOConfig, VCAConfig, patch_model, unpatch_model  # noqa: E402
from vca_patch.families.diffusers.dit import carry_single, patched_processors  # noqa: E402
from vca_patch.families.diffusers.flux import FluxSingleLayerProcessor, reference_single_attention  # noqa: E402
from vca_patch.layers.layout import TokenLayout  # noqa: E402
from vca_patch.targets.vca.joint import SingleStreamVisualContrastAttention  # noqa: E402

CONFIG = VCAConfig(contrast_tokens=16, init="paper")  # random e±, λ, DWC: every new parameter matters
DOUBLE = ["transformer_blocks.0.attn", "transformer_blocks.1.attn"]
SINGLE = ["single_transformer_blocks.0.attn", "single_transformer_blocks.1.attn"]


def _cell_centres(H, W, h, w):
    """Mean (row, col) of each adaptive-average-pooling window of an H×W grid pooled to h×w: [h·w, 2]."""
    centres = []
    for i in range(h):
        r0, r1 = (i * H) // h, -((-(i + 1) * H) // h)
        for j in range(w):
            c0, c1 = (j * W) // w, -((-(j + 1) * W) // w)
            centres.append(((r0 + r1 - 1) / 2, (c0 + c1 - 1) / 2))
    return torch.tensor(centres, dtype=torch.float64)


def reference_single_vca(model, attn, layer, x, grid, rotary, mode):
    """Single-stream joint VCA in float64 from the attention's weights and `vca` parameters: the first L rows are
    text (softmax over all keys), the rest image rows on `grid` running VCA; contrast tokens pooled from the rotated
    image queries ("pooled") or pooled un-rotated and rotated by Flux's own embedding at each cell's centre."""
    g = {k: v.detach().double() for k, v in attn.state_dict().items()}
    x = x.double()
    M, d = layer.num_heads, layer.head_dim
    C, (B, S, _), (H, W), (h, w) = M * d, x.shape, grid, layer.contrast_grid
    N, n, s = H * W, h * w, d**-0.5
    L = S - N
    li = 0.8 - 0.6 * math.exp(-0.3 * layer.layer_index)

    def project(name, norm=None):
        out = (x @ g[f"{name}.weight"].T + g[f"{name}.bias"]).reshape(B, S, M, d)
        return out if norm is None else getattr(attn, norm)(out)  # the model's own RMSNorm

    q0, k0, v = project("to_q", "norm_q"), project("to_k", "norm_k"), project("to_v")  # [B, S, M, d]
    cos, sin = (t.double() for t in rotary)
    q, k = reference_rope(q0, cos, sin), reference_rope(k0, cos, sin)
    if mode == "pooled":
        pooled = _pool(q[:, L:].reshape(B, H, W, C), h, w)  # [B, n, C]
        tp = (pooled + g["vca.contrast_embed_pos"]).reshape(B, n, M, d)
        tn = (pooled + g["vca.contrast_embed_neg"]).reshape(B, n, M, d)
    else:
        pooled = _pool(q0[:, L:].reshape(B, H, W, C), h, w)
        centres = _cell_centres(H, W, h, w)
        ids = torch.cat([torch.zeros(n, 1, dtype=torch.float64), centres], dim=1)
        ccos, csin = (t.double() for t in model.pos_embed(ids))
        tp = reference_rope((pooled + g["vca.contrast_embed_pos"]).reshape(B, n, M, d), ccos, csin)
        tn = reference_rope((pooled + g["vca.contrast_embed_neg"]).reshape(B, n, M, d), ccos, csin)
    lam1, lam2 = _lam(layer.lambda1, li), _lam(layer.lambda2, li)
    up = torch.einsum("bmij,bjmd->bmid", _softmax(s * torch.einsum("bimd,bjmd->bmij", tp, k)), v)
    un = torch.einsum("bmij,bjmd->bmid", _softmax(s * torch.einsum("bimd,bjmd->bmij", tn, k)), v)
    vhat = (1 - li) * _rms(up - lam1 * un, g["vca.stage1_norm.weight"], layer.stage1_norm.eps)  # [B, M, n, d]
    tau = g["vca.stage2_temperature"].view(1, M, 1, 1)
    qi = q[:, L:]
    a = _softmax(torch.cat([torch.einsum("bimd,bjmd->bmij", qi, t) for t in (tp, tn)], dim=-1) * s * tau)
    o = (1 - li) * _rms(
        torch.einsum("bmij,bmjd->bmid", a[..., :n] - lam2 * a[..., n:], vhat),
        g["vca.stage2_norm.weight"],
        layer.stage2_norm.eps,
    )
    image = o.permute(0, 2, 1, 3).reshape(B, N, C)
    image = image + _depthwise3x3(v[:, L:].reshape(B, H, W, C), g["vca.dwc.weight"], g["vca.dwc.bias"]).reshape(B, N, C)
    text = torch.einsum("bmij,bjmd->bimd", _softmax(s * torch.einsum("bimd,bjmd->bmij", q[:, :L], k)), v)
    return torch.cat([text.reshape(B, L, C), image], dim=1)


# -- classification, verification, the config ----------------------------------------------------------------


def test_single_stream_blocks_are_patched_verified_and_counted_after_the_double_blocks():
    model = tiny_flux()
    report = patch_model(model, VCAConfig(contrast_tokens=16, rope_contrast="centre"))
    assert [s.path for s in report.patched] == DOUBLE + SINGLE and not report.skipped
    assert [s.layer_index for s in report.patched] == [0, 1, 2, 3]  # λ_init keeps growing with depth
    assert all(s.verified is True and not s.notes for s in report.patched)
    processors = patched_processors(model)
    assert all(type(processors[p]) is FluxSingleLayerProcessor for p in SINGLE)
    layers = [processors[p].layer for p in DOUBLE + SINGLE]
    assert all(layer.rope_contrast == "centre" and layer.prefix_readout == "exact" for layer in layers)
    assert all(type(processors[p].layer) is SingleStreamVisualContrastAttention for p in SINGLE)
    assert [s.path for s in patch_model(tiny_flux(), VCAConfig(layers=[3])).patched] == [SINGLE[1]]


def test_rope_contrast_is_a_validated_config_field_that_round_trips():
    config = VCAConfig(rope_contrast="centre")
    assert VCAConfig.from_json(config.to_json()) == config and config.to_dict()["rope_contrast"] == "centre"
    assert VCAConfig().rope_contrast == "pooled"
    with pytest.raises(ValueError, match="rope_contrast must be 'pooled' or 'centre'"):
        VCAConfig(rope_contrast="center")


def test_reference_matches_the_single_stream_processor_with_rotary():
    model = tiny_flux()
    grid, L = (3, 5), 6
    x = latent(2, L + 15, 32)
    rotary = flux_rotary(model, L, grid)
    for path in SINGLE:
        attn = model.get_submodule(path)
        with torch.no_grad():
            expected = attn(hidden_states=x, image_rotary_emb=rotary)
            got = reference_single_attention(carry_single(attn), x, rotary)
            unrotated = reference_single_attention(carry_single(attn), x)
        assert rel(got, expected) < 1e-6  # float32, measured 1.6e-7
        assert rel(unrotated, expected) > 1e-2  # the rotary embedding matters here


def test_a_processor_computing_something_else_fails_verification():
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor as Original

    model = tiny_flux()
    model.single_transformer_blocks[0].attn.set_processor(processor_impostor(Original, lambda out: 1.5 * out)())
    report = patch_model(model, CONFIG)
    assert [s.path for s in report.patched] == [*DOUBLE, SINGLE[1]]
    assert [(s.path, s.reason.split(":")[0]) for s in report.skipped] == [(SINGLE[0], "verification failed")]


def test_other_targets_skip_single_stream_attention_with_why():
    from vca_patch.surgery import NothingToPatchError

    refused = "single-stream joint attention is not plain softmax attention over one token grid: .* not Multipole"
    with pytest.raises(NothingToPatchError, match=refused + r"Attention \(targets that do: vca\)"):
        patch_model(tiny_flux(), MANOConfig(window=4))  # Flux has no attention MANO can take


# -- the converted layer against a float64 reference ---------------------------------------------------------


@pytest.mark.parametrize("grid", [(5, 7), (16, 12)])  # (16, 12): several patches per contrast cell, uneven cells
def test_patched_single_stream_matches_float64_reference_and_text_rows_are_exact(grid):
    model = tiny_flux()
    L = 6
    x = latent(2, L + grid[0] * grid[1], 32)
    rotary = flux_rotary(model, L, grid)
    with torch.no_grad():
        teacher = {p: model.get_submodule(p)(hidden_states=x, image_rotary_emb=rotary) for p in SINGLE}
        patch_model(model, VCAConfig(contrast_tokens=16, init="paper", rope_contrast="centre"))
        for path in SINGLE:
            got = model.get_submodule(path)(x, image_rotary_emb=rotary, layout=TokenLayout(0, grid))
            assert got.shape == teacher[path].shape
            assert rel(got[:, :L], teacher[path][:, :L]) < 1e-6  # text rows: softmax over all keys, measured 0
            assert rel(got[:, L:], teacher[path][:, L:]) > 1e-2  # image rows: VCA
    model.double()
    x, rotary = x.double(), tuple(t.double() for t in rotary)
    outputs = {}
    for mode in ("centre", "pooled"):  # the layer reads its mode at each call
        for path in SINGLE:
            attn = model.get_submodule(path)
            attn.processor.layer.rope_contrast = mode
            got = attn(x, image_rotary_emb=rotary, layout=TokenLayout(0, grid))
            expected = reference_single_vca(model, attn, attn.processor.layer, x, grid, rotary, mode)
            assert got.dtype == torch.float64
            assert rel(got, expected) < 3e-15  # measured 5e-16
            outputs[mode, path] = got
    assert all(rel(outputs["centre", p], outputs["pooled", p]) > 1e-6 for p in SINGLE)  # the modes differ here


def test_one_token_cells_make_both_rope_modes_the_same_layer():
    model = tiny_flux()
    patch_model(model, CONFIG)
    model.double()
    grid, L = (4, 4), 5  # contrast_tokens = 16: one token per cell
    attn = model.get_submodule(SINGLE[0])
    layer = attn.processor.layer
    x = latent(1, L + 16, 32).double()
    rotary = tuple(t.double() for t in flux_rotary(model, L, grid))
    outputs = {}
    with torch.no_grad():
        layer.contrast_embed_pos.zero_()
        layer.contrast_embed_neg.zero_()
        for mode in ("centre", "pooled"):
            layer.rope_contrast = mode
            outputs[mode] = attn(x, image_rotary_emb=rotary, layout=TokenLayout(0, grid))
        layer.rope_contrast = "centre"
        other = attn(x, image_rotary_emb=rotary, layout=TokenLayout(0, (2, 8)))  # a grid of other cells
    assert rel(outputs["centre"], outputs["pooled"]) < 1e-14  # measured 0
    assert rel(other, outputs["pooled"]) > 1e-3


def test_processor_refuses_context_masks_and_a_short_sequence():
    model = tiny_flux()
    patch_model(model, CONFIG)
    attn = model.get_submodule(SINGLE[0])
    x, rotary = latent(1, 5 + 16, 32), flux_rotary(model, 5, (4, 4))
    with pytest.raises(TypeError, match="single-stream"):
        attn(x, encoder_hidden_states=latent(1, 5, 32), image_rotary_emb=rotary, layout=TokenLayout(0, (4, 4)))
    with pytest.raises(ValueError, match="attention mask"):
        attn(x, attention_mask=torch.ones(1, 21, 21), image_rotary_emb=rotary, layout=TokenLayout(0, (4, 4)))
    with pytest.raises(ValueError, match="fewer than"):
        attn(x, image_rotary_emb=rotary, layout=TokenLayout(0, (5, 5)))
    with pytest.raises(ValueError, match="rotary embedding has"):
        attn(x, image_rotary_emb=flux_rotary(model, 4, (4, 4)), layout=TokenLayout(0, (4, 4)))


# -- the model: denoising, training, unpatch, checkpoints ---------------------------------------------------


def test_denoising_runs_with_the_grid_from_img_ids_and_unpatch_is_bit_identical():
    model = tiny_flux()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grid, x = (6, 10), latent(2, 60, 16)
    with torch.no_grad():
        reference = flux_call(model, x, grid)
    patch_model(model, CONFIG)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    added = set(model.state_dict()) - set(before)
    assert {k.split(".vca.")[0] for k in added} == set(DOUBLE + SINGLE)
    grids = record_grids(model, SINGLE)
    sample = flux_denoise(model, x, grid)
    with torch.no_grad():
        assert sample.isfinite().all() and grids == [grid] * (3 * len(SINGLE))
        assert rel(flux_call(model, x, grid), reference) > 1e-3
        unpatch_model(model)
        assert torch.equal(flux_call(model, x, grid), reference)
    assert set(model.state_dict()) == set(before)


def test_training_and_gradient_checkpointing_reach_single_stream_parameters():
    model = tiny_flux()
    patch_model(model, CONFIG)
    model.train()
    x = latent(1, 24, 16)
    for recompute in (True, False):
        model.zero_grad()
        for processor in patched_processors(model).values():
            processor.layer.recompute_in_backward = recompute
        flux_call(model, x, (4, 6)).square().mean().backward()
        attn = model.get_submodule(SINGLE[0])
        for param in (attn.vca.contrast_embed_pos, attn.vca.dwc.weight, attn.to_q.weight, attn.norm_k.weight):
            assert param.grad is not None and param.grad.abs().sum() > 0


@pytest.mark.parametrize("form", ["merged", "delta"])
def test_save_and_reload_keep_the_rotary_choice_and_outputs(tmp_path, diffusers_loadable, form):
    import json

    grid, x = (6, 10), latent(2, 60, 16)
    config = VCAConfig(contrast_tokens=9, init="paper", rope_contrast="centre")
    reloaded = patch_save_reload(tiny_flux(), config, form, tmp_path, lambda m: flux_call(m, x, grid))
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["config"]["rope_contrast"] == "centre"
    processors = patched_processors(reloaded.model)
    assert sorted(processors) == sorted(DOUBLE + SINGLE)
    assert all(p.layer.rope_contrast == "centre" for p in processors.values())
    with torch.no_grad():
        assert torch.equal(flux_call(reloaded.model, x, grid), reloaded.expected)
    if form == "delta":
        stored = reloaded.delta
        assert stored and all(".vca." in k for k in stored)
        assert any(k.startswith(f"{SINGLE[1]}.vca.") for k in stored)


def test_bfloat16_flux_patches_verified_and_runs():
    model = tiny_flux().to(torch.bfloat16)
    report = patch_model(model, CONFIG)
    assert [s.path for s in report.patched] == DOUBLE + SINGLE and all(s.verified for s in report.patched)
    attn = model.get_submodule(SINGLE[0])
    assert attn.vca.lambda1.q1.dtype == torch.float32 and attn.vca.contrast_embed_pos.dtype == torch.bfloat16
    with torch.no_grad():
        out = flux_call(model, latent(1, 24, 16).bfloat16(), (4, 6))
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
