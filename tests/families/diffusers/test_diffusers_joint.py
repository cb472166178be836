"""Joint (image + text) attention of SD3/SD3.5 through diffusers: verification, exact text stream, VCA image
stream against a float64 reference, denoising, unpatch, state-dict names, save/reload."""

from __future__ import annotations

import copy
import math

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[diffusers]')")

from diffusers.models.attention_processor import JointAttnProcessor2_0  # noqa: E402

from tests.support.diffusers_models import (  # noqa: E402
    attention_processors,
    denoise,
    flux_call,
    flux_denoise,
    flux_inputs,
    flux_rotary,
    image_ids,
    latent,
    patch_save_reload,
    processor_impostor,
    record_grids,
    reference_rope,
    rel,
    tiny_flux,
    tiny_vae,
)
from tests.support.reference.vca import _depthwise3x3, _lam, _pool, _rms, _softmax  # noqa: E402
from vca_patch import MANOConfig, VCAConfig, patch_model, unpatch_model  # noqa: E402
from vca_patch.families.diffusers.dit import DiffusersDiTAdapter, patched_processors  # noqa: E402
from vca_patch.families.diffusers.joint import carry_joint, reference_joint_attention  # noqa: E402
from vca_patch.families.diffusers.processor import JointLayerProcessor  # noqa: E402
from vca_patch.layers.layout import TokenLayout  # noqa: E402
from vca_patch.surgery import NothingToPatchError  # noqa: E402
from vca_patch.targets.vca.joint import JointVisualContrastAttention  # noqa: E402

CONFIG = VCAConfig(contrast_tokens=16, init="paper")  # random e±, λ, DWC: every new parameter matters
JOINT = ["transformer_blocks.0.attn", "transformer_blocks.1.attn"]


def tiny_sd3(qk_norm: str | None = None, dual: tuple[int, ...] = ()) -> torch.nn.Module:
    """SD3 (qk_norm None) or SD3.5-style (qk_norm "rms_norm", dual_attention_layers adds image-only attn2)."""
    torch.manual_seed(0)
    return diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=12, out_channels=4,
        pos_embed_max_size=16, qk_norm=qk_norm, dual_attention_layers=dual,
    ).eval()  # fmt: skip


def sd3_call(model, x, seed=3):
    B = x.shape[0]
    text, pooled = latent(B, 7, 24, seed=seed).to(x), latent(B, 12, seed=seed + 1).to(x)
    return model(x, encoder_hidden_states=text, pooled_projections=pooled, timestep=torch.arange(B) * 50 + 5).sample


# -- classification and verification ------------------------------------------------------------------------


@pytest.mark.parametrize("qk_norm", [None, "rms_norm"])
def test_joint_sites_are_classified_verified_and_patched(qk_norm):
    model = tiny_sd3(qk_norm, dual=(0,))
    report = patch_model(model, CONFIG)
    assert [s.path for s in report.patched] == [JOINT[0], "transformer_blocks.0.attn2", JOINT[1]]
    assert [s.layer_index for s in report.patched] == [0, 0, 1]
    assert all(s.verified is True and not s.notes for s in report.patched)
    assert report.skipped == [] and report.layout == TokenLayout(0, (8, 8))
    processors = patched_processors(model)
    assert all(isinstance(processors[p], JointLayerProcessor) for p in JOINT)
    assert not isinstance(processors["transformer_blocks.0.attn2"], JointLayerProcessor)
    layer = processors[JOINT[1]].layer
    assert isinstance(layer, JointVisualContrastAttention) and layer.prefix_readout == "exact"
    assert model.transformer_blocks[1].attn.context_pre_only and "to_add_out" not in layer._modules


@pytest.mark.parametrize("qk_norm", [None, "rms_norm"])
def test_reference_matches_joint_processor_in_float64_with_text_at_either_end(qk_norm):
    """The written-out reference reproduces JointAttnProcessor2_0 (image first) in both streams, and softmax
    attention does not care at which end of the joint sequence the text sits."""
    model = tiny_sd3(qk_norm).double()
    for path in JOINT:
        attn = model.get_submodule(path)
        image, text = latent(2, 20, 32).double(), latent(2, 6, 32, seed=1).double()
        expected = attn(hidden_states=image, encoder_hidden_states=text)
        carried = carry_joint(attn)
        for image_first in (True, False):
            got = reference_joint_attention(carried, image, text, image_first=image_first)
            assert rel(got[0], expected[0]) < 2e-15 and rel(got[1], expected[1]) < 2e-15  # measured 3e-16


def test_wrong_and_unknown_joint_processors_are_skipped_with_why():
    model = tiny_sd3()

    class IPAdapterJoint(JointAttnProcessor2_0):
        pass

    swapped = processor_impostor(JointAttnProcessor2_0, lambda out: (out[0], 1.01 * out[1]))  # a wrong text path
    model.transformer_blocks[0].attn.set_processor(swapped())
    model.transformer_blocks[1].attn.set_processor(IPAdapterJoint())
    with pytest.raises(NothingToPatchError) as info:
        patch_model(model, CONFIG)
    message = str(info.value)
    assert f"{JOINT[0]} [Attention]: verification failed: reference joint softmax attention differs" in message
    assert f"{JOINT[1]} [Attention]: joint (image + text) attention with processor" in message
    assert "IPAdapterJoint" in message


def test_other_targets_skip_joint_attention_with_why():
    report = patch_model(tiny_sd3(dual=(0,)), MANOConfig())
    assert [s.path for s in report.patched] == ["transformer_blocks.0.attn2"]
    skipped = {s.path: s.reason for s in report.skipped}
    assert sorted(skipped) == JOINT
    refused = "joint (image + text) attention is not plain softmax attention over one token grid: only a target that"
    assert all(refused in reason and reason.endswith("(targets that do: vca)") for reason in skipped.values())


# -- numerics of the patched streams ----------------------------------------------------------------------


def test_text_stream_is_exact_whatever_the_vca_parameters():
    """Text tokens are exact prefix tokens: their output is the original joint attention's, for random e±, λ,
    DWC (init="paper") and on any grid; the image stream is changed."""
    model = tiny_sd3("rms_norm")
    image, text = latent(2, 5 * 7, 32), latent(2, 6, 32, seed=1)
    with torch.no_grad():
        expected = {p: model.get_submodule(p)(hidden_states=image, encoder_hidden_states=text) for p in JOINT}
        patch_model(model, CONFIG)
        for path in JOINT:
            got = model.get_submodule(path)(
                hidden_states=image, encoder_hidden_states=text, layout=TokenLayout(0, (5, 7))
            )
            assert rel(got[1], expected[path][1]) < 1e-6  # measured 1.7e-7 (float32 round-off)
            assert rel(got[0], expected[path][0]) > 1e-2


def reference_joint_vca(attn, layer, x, c, grid, rotary=None):
    """Joint VCA in float64 from the attention's weights and its `vca` parameters, image first as SD3 orders it:
    text rows read all keys with softmax attention; image rows run VCA with contrast tokens pooled from the
    (normed) image queries, Stage-I keys over text and image, DWC over the image values."""
    g = {k: v.detach().double() for k, v in attn.state_dict().items()}
    x, c = x.double(), c.double()
    M, d = layer.num_heads, layer.head_dim
    C, (B, N, _), L, (H, W), (h, w) = M * d, x.shape, c.shape[1], grid, layer.contrast_grid
    n, s = h * w, d**-0.5
    li = 0.8 - 0.6 * math.exp(-0.3 * layer.layer_index)

    def project(t, name, norm=None):
        out = (t @ g[f"{name}.weight"].T + g[f"{name}.bias"]).reshape(B, -1, M, d)
        module = getattr(attn, norm, None) if norm else None
        return out if module is None else module(out)  # the model's own norm (float32 variance, as diffusers has it)

    q, k, v = project(x, "to_q", "norm_q"), project(x, "to_k", "norm_k"), project(x, "to_v")  # [B, N, M, d]
    tq, tk, tv = (
        project(c, "add_q_proj", "norm_added_q"),
        project(c, "add_k_proj", "norm_added_k"),
        project(c, "add_v_proj"),
    )
    if rotary is not None:  # (cos, sin) [L + N, d], text first (Flux); contrast tokens pooled after rotation
        cos, sin = (t.double() for t in rotary)
        q, k = (reference_rope(t, cos[L:], sin[L:]) for t in (q, k))
        tq, tk = (reference_rope(t, cos[:L], sin[:L]) for t in (tq, tk))
    keys, values = torch.cat([k, tk], 1), torch.cat([v, tv], 1)  # [B, N + L, M, d]

    pooled = _pool(q.reshape(B, H, W, C), h, w)  # [B, n, C]
    tp = (pooled + g["vca.contrast_embed_pos"]).reshape(B, n, M, d)
    tn = (pooled + g["vca.contrast_embed_neg"]).reshape(B, n, M, d)
    lam1, lam2 = _lam(layer.lambda1, li), _lam(layer.lambda2, li)
    up = torch.einsum("bmij,bjmd->bmid", _softmax(s * torch.einsum("bimd,bjmd->bmij", tp, keys)), values)
    un = torch.einsum("bmij,bjmd->bmid", _softmax(s * torch.einsum("bimd,bjmd->bmij", tn, keys)), values)
    vhat = (1 - li) * _rms(up - lam1 * un, g["vca.stage1_norm.weight"], layer.stage1_norm.eps)  # [B, M, n, d]
    tau = g["vca.stage2_temperature"].view(1, M, 1, 1) if "vca.stage2_temperature" in g else 1.0
    logits = torch.cat([torch.einsum("bimd,bjmd->bmij", q, t) for t in (tp, tn)], dim=-1) * s * tau
    if layer.softmax == "joint":
        a = _softmax(logits)
        a_pos, a_neg = a[..., :n], a[..., n:]
    else:
        a_pos, a_neg = _softmax(logits[..., :n]), _softmax(logits[..., n:])
    o = (1 - li) * _rms(
        torch.einsum("bmij,bmjd->bmid", a_pos - lam2 * a_neg, vhat), g["vca.stage2_norm.weight"], layer.stage2_norm.eps
    )
    o = o.permute(0, 2, 1, 3).reshape(B, N, C)
    o = o + _depthwise3x3(v.reshape(B, H, W, C), g["vca.dwc.weight"], g["vca.dwc.bias"]).reshape(B, N, C)
    image = o @ g["to_out.0.weight"].T + g["to_out.0.bias"]

    text = torch.einsum("bmij,bjmd->bimd", _softmax(s * torch.einsum("bimd,bjmd->bmij", tq, keys)), values).reshape(
        B, L, C
    )
    if "to_add_out.weight" in g:
        text = text @ g["to_add_out.weight"].T + g["to_add_out.bias"]
    return image, text


@pytest.mark.parametrize("qk_norm", [None, "rms_norm"])
@pytest.mark.parametrize("grid", [(5, 7), (16, 12)])  # (16, 12): 192 patches, the pool-the-input path when unnormed
def test_patched_joint_attention_matches_float64_reference(qk_norm, grid):
    model = tiny_sd3(qk_norm)
    patch_model(model, CONFIG)
    model.double()
    x, c = latent(2, grid[0] * grid[1], 32).double(), latent(2, 6, 32, seed=1).double()
    for path in JOINT:
        attn = model.get_submodule(path)
        got = attn(hidden_states=x, encoder_hidden_states=c, layout=TokenLayout(0, grid))
        expected = reference_joint_vca(attn, attn.processor.layer, x, c, grid)
        assert got[0].dtype == torch.float64
        assert rel(got[0], expected[0]) < 3e-15 and rel(got[1], expected[1]) < 3e-15  # measured 6e-16


# -- the model: denoising, unpatch, names, training, checkpoints ------------------------------------------


def test_flow_matching_denoising_runs_patched_on_a_non_square_latent():
    model = tiny_sd3("rms_norm", dual=(0,))
    patch_model(model, CONFIG)
    grids = record_grids(model)
    text, pooled = latent(2, 7, 24, seed=3), latent(2, 12, seed=4)

    def velocity(sample, t):
        return model(sample, encoder_hidden_states=text, pooled_projections=pooled, timestep=t.expand(2)).sample

    sample = denoise(diffusers.FlowMatchEulerDiscreteScheduler(), latent(2, 4, 16, 24), velocity)
    assert sample.shape == (2, 4, 16, 24) and sample.isfinite().all()
    assert grids == [(8, 12)] * (3 * 3)  # H/p x W/p, 3 steps x 3 patched attentions


def test_sd3_pipeline_runs_patched():
    transformer = tiny_sd3()
    patch_model(transformer, CONFIG)
    vae = tiny_vae(shift_factor=0.0, scaling_factor=1.0)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
        tokenizer=None, text_encoder_2=None, tokenizer_2=None, text_encoder_3=None, tokenizer_3=None,
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    text, pooled = latent(1, 7, 24, seed=3), latent(1, 12, seed=4)
    images = pipe(
        prompt_embeds=text, pooled_prompt_embeds=pooled, negative_prompt_embeds=torch.zeros_like(text),
        negative_pooled_prompt_embeds=torch.zeros_like(pooled), height=16, width=16, num_inference_steps=2,
        output_type="latent", generator=torch.Generator().manual_seed(0),
    ).images  # fmt: skip
    assert images.shape == (1, 4, 16, 16) and images.isfinite().all()


def test_names_kept_and_unpatch_is_bit_identical():
    model = tiny_sd3("rms_norm", dual=(0,))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    processors = attention_processors(model)
    x = latent(2, 4, 16, 24)
    with torch.no_grad():
        reference = sd3_call(model, x)

    patch_model(model, CONFIG)
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # every original key, same name and value
    new = sorted(set(after) - set(before))
    assert new and all(".attn.vca." in k or ".attn2.vca." in k for k in new)
    assert {k.split(".vca.")[1] for k in new if ".attn.vca." in k} >= {"contrast_embed_pos", "dwc.weight"}
    with torch.no_grad():
        patched = sd3_call(model, x)
    assert patched.isfinite().all() and rel(patched, reference) > 1e-3

    unpatch_model(model)
    assert all(processor is processors[p] for p, processor in attention_processors(model).items())
    restored = model.state_dict()
    assert list(restored) == list(before) and all(torch.equal(restored[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(sd3_call(model, x), reference)


def test_training_and_gradient_checkpointing_reach_both_streams():
    model = tiny_sd3("rms_norm")
    patch_model(model, CONFIG)
    model.enable_gradient_checkpointing()
    model.train()
    sd3_call(model, latent(2, 4, 16, 16)).square().mean().backward()  # blocks recomputed: the layout is found
    attn = model.transformer_blocks[0].attn
    for param in (attn.vca.contrast_embed_pos, attn.vca.dwc.weight, attn.to_q.weight, attn.add_q_proj.weight):
        assert param.grad is not None and param.grad.abs().sum() > 0
    assert attn.norm_added_k.weight.grad.abs().sum() > 0

    model.eval()
    twin = copy.deepcopy(model)
    x = latent(1, 4, 16, 16)
    with torch.no_grad():
        assert torch.equal(sd3_call(twin, x), sd3_call(model, x))
        twin.transformer_blocks[0].attn.add_k_proj.weight.mul_(2.0)  # the copy's own text projection
        assert not torch.equal(sd3_call(twin, x), sd3_call(model, x))


def test_processor_refuses_missing_text_and_masks():
    model = tiny_sd3()
    patch_model(model, CONFIG)
    attn, x = model.transformer_blocks[0].attn, latent(1, 16, 32)
    with pytest.raises(TypeError, match="needs encoder_hidden_states"):
        attn(x, layout=TokenLayout(0, (4, 4)))
    with pytest.raises(ValueError, match="attention mask"):
        attn(x, encoder_hidden_states=x[:, :3], attention_mask=torch.ones(1, 19), layout=TokenLayout(0, (4, 4)))


def test_bfloat16_model_patches_and_runs():
    model = tiny_sd3("rms_norm").to(torch.bfloat16)
    assert all(s.verified is True for s in patch_model(model, CONFIG).patched)  # verified on a float32 copy
    with torch.no_grad():
        out = sd3_call(model, latent(1, 4, 16, 16).bfloat16())
    assert out.dtype == torch.bfloat16 and out.isfinite().all()


@pytest.mark.parametrize("form", ["merged", "delta"])
def test_save_and_reload_give_identical_outputs(tmp_path, diffusers_loadable, form):
    model, x = tiny_sd3("rms_norm", dual=(0,)), latent(2, 4, 16, 24)
    reloaded = patch_save_reload(model, CONFIG, form, tmp_path, lambda m: sd3_call(m, x))
    loaded = reloaded.model
    assert type(loaded) is type(model) and isinstance(DiffusersDiTAdapter(), DiffusersDiTAdapter)
    assert {p: type(q) for p, q in patched_processors(loaded).items()} == {
        p: type(q) for p, q in patched_processors(model).items()
    }
    with torch.no_grad():
        assert torch.equal(sd3_call(loaded, x), reloaded.expected)
    if form == "delta":
        stored = reloaded.delta
        assert stored and all(".vca." in k for k in stored)  # only the new attention parameters
        assert any(k.startswith(f"{JOINT[0]}.vca.") for k in stored)


# -- Flux: text first, rotary embedding -------------------------------------------------------------------

FLUX_DOUBLE = ["transformer_blocks.0.attn", "transformer_blocks.1.attn"]
FLUX_SINGLE = "single_transformer_blocks.0.attn"


def test_flux_double_blocks_patched_single_blocks_too():  # single-stream: tests/test_diffusers_single_stream.py
    model = tiny_flux(num_single_layers=1)
    report = patch_model(model, CONFIG)
    assert [s.path for s in report.patched] == [*FLUX_DOUBLE, FLUX_SINGLE]
    assert [s.layer_index for s in report.patched] == [0, 1, 2] and not report.skipped
    assert all(s.verified is True and not s.notes for s in report.patched)
    layer = patched_processors(model)[FLUX_DOUBLE[0]].layer
    assert layer.rope_contrast == "pooled" and layer.prefix_readout == "exact"


def test_flux_reference_matches_processor_with_rotary_and_text_first():
    model = tiny_flux(num_single_layers=1)
    grid, L = (3, 5), 6
    image, text = latent(2, 15, 32), latent(2, L, 32, seed=1)
    rotary = flux_rotary(model, L, grid)
    for path in FLUX_DOUBLE:
        attn = model.get_submodule(path)
        with torch.no_grad():
            expected = attn(hidden_states=image, encoder_hidden_states=text, image_rotary_emb=rotary)
            got = reference_joint_attention(carry_joint(attn), image, text, image_first=False, rotary=rotary)
            unrotated = reference_joint_attention(carry_joint(attn), image, text, image_first=False)
        assert rel(got[0], expected[0]) < 1e-6 and rel(got[1], expected[1]) < 1e-6  # float32, measured 1.5e-7
        assert rel(unrotated[0], expected[0]) > 1e-2  # the rotary embedding matters here


def test_flux_patched_attention_matches_float64_reference_and_text_is_exact():
    model = tiny_flux(num_single_layers=1)
    grid, L = (6, 10), 6
    x, c = latent(2, 60, 32), latent(2, L, 32, seed=1)
    rotary = flux_rotary(model, L, grid)
    with torch.no_grad():
        teacher = {
            p: model.get_submodule(p)(hidden_states=x, encoder_hidden_states=c, image_rotary_emb=rotary)[1]
            for p in FLUX_DOUBLE
        }
        patch_model(model, CONFIG)
        for path in FLUX_DOUBLE:
            got = model.get_submodule(path)(x, c, image_rotary_emb=rotary, layout=TokenLayout(0, grid))
            assert rel(got[1], teacher[path]) < 1e-6  # text stream exact: measured 0 (Flux's key order is ours)
    model.double()
    x, c, rotary = x.double(), c.double(), tuple(t.double() for t in rotary)
    for path in FLUX_DOUBLE:
        attn = model.get_submodule(path)
        got = attn(x, c, image_rotary_emb=rotary, layout=TokenLayout(0, grid))
        expected = reference_joint_vca(attn, attn.processor.layer, x, c, grid, rotary=rotary)
        assert rel(got[0], expected[0]) < 3e-15 and rel(got[1], expected[1]) < 3e-15  # measured 5e-16


def test_rope_one_token_cells_rotate_contrast_tokens_as_the_tokens_themselves():
    """A 1×1 pooling cell: the contrast token rotated at its cell's centre is the token's own rotation (so, with
    e± = 0, both rope_contrast modes compute the same layer); with e± ≠ 0 "centre" also rotates e±."""
    from vca_patch.targets.vca.joint import JointInputs, rotate

    model = tiny_flux(num_single_layers=1)
    patch_model(model, CONFIG)
    model.double()
    grid, L = (4, 4), 5  # contrast_tokens = 16: one token per cell
    attn = model.get_submodule(FLUX_DOUBLE[0])
    layer = attn.processor.layer
    attn.processor.bind(attn)
    cos, sin = (t.double() for t in flux_rotary(model, L, grid))
    q = latent(2, 2, L + 16, 16).double()  # [B, M, L + N, d] joint queries before rotation
    joint = TokenLayout(L, grid)
    centre = layer.centre_rotary(TokenLayout(0, grid), q.device)
    assert torch.allclose(centre[0].double(), cos[L:], atol=1e-12) and torch.allclose(
        centre[1].double(), sin[L:], atol=1e-12
    )
    tokens = layer.contrast_tokens(JointInputs(q[:, 0, L:], q, centre, rotated=True), rotate(q, cos, sin), joint)
    embed = torch.cat([layer.contrast_embed_pos, layer.contrast_embed_neg]).view(2, 16, 2, 16).permute(2, 0, 1, 3)
    own = rotate(q[:, :, None, L:] + embed, cos[L:], sin[L:]).flatten(2, 3)  # each token plus e±, at its own place
    assert rel(tokens, own) < 1e-14  # measured 0

    x, c = latent(1, 16, 32).double(), latent(1, L, 32, seed=1).double()
    with torch.no_grad():
        layer.contrast_embed_pos.zero_()
        layer.contrast_embed_neg.zero_()
        outputs = {}
        for mode in ("centre", "pooled"):
            layer.rope_contrast = mode
            outputs[mode] = attn(x, c, image_rotary_emb=(cos, sin), layout=TokenLayout(0, grid))[0]
    assert rel(outputs["centre"], outputs["pooled"]) < 1e-14  # measured 0


def test_flux_denoising_layout_from_img_ids_unpatch_and_reload(tmp_path, diffusers_loadable):
    from vca_patch.checkpoint.folder import from_pretrained, save_pretrained

    model = tiny_flux(num_single_layers=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grid, x = (6, 10), latent(2, 60, 16)
    with torch.no_grad():
        reference = flux_call(model, x, grid)
    patch_model(model, CONFIG)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert all(".attn.vca." in k for k in set(model.state_dict()) - set(before))
    grids = record_grids(model)
    sample, (text, pooled) = flux_denoise(model, x, grid), flux_inputs(2)
    with torch.no_grad():
        assert sample.isfinite().all() and grids == [grid] * (3 * 3)  # 2 double-stream, 1 single-stream block
        with pytest.raises(ValueError, match="one row-major grid"):
            model(
                hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=torch.full((2,), 0.5),
                img_ids=image_ids(*grid, offset=1), txt_ids=torch.zeros(7, 3),
            )  # fmt: skip
        expected = flux_call(model, x, grid)
        save_pretrained(model, tmp_path / "ckpt")
        loaded = from_pretrained(tmp_path / "ckpt")
        assert sorted(patched_processors(loaded)) == sorted([*FLUX_DOUBLE, FLUX_SINGLE])
        assert torch.equal(flux_call(loaded, x, grid), expected)

        unpatch_model(model)
        assert torch.equal(flux_call(model, x, grid), reference)
        assert not any(hooks for hooks in (model._forward_pre_hooks, model._forward_hooks))
