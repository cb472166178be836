"""Diffusion transformers through diffusers: site classification, verification, processor swap, pipelines, I/O."""

from __future__ import annotations

import copy

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install -e '.[diffusers]')")

from diffusers.models.attention_processor import AttnProcessor2_0  # noqa: E402

from tests.support.diffusers_models import (  # noqa: E402
    attention_processors,
    denoise,
    latent,
    patch_save_reload,
    processor_impostor,
    record_grids,
    tiny_dit,
    tiny_pixart,
    tiny_vae,
)
from tests.support.reference.vca import reference_vca  # noqa: E402
from vca_patch import VCAConfig, patch_model, unpatch_model  # noqa: E402
from vca_patch.families import adapter_for  # noqa: E402
from vca_patch.families.diffusers.dit import DiffusersDiTAdapter, patched_processors  # noqa: E402
from vca_patch.families.diffusers.guard import check_diffusers_base  # noqa: E402
from vca_patch.families.diffusers.processor import CarriedLayerProcessor  # noqa: E402
from vca_patch.families.verify import reference_softmax_attention  # noqa: E402
from vca_patch.layers.layout import TokenLayout  # noqa: E402
from vca_patch.surgery import NothingToPatchError, get_patch_state, inspect_model  # noqa: E402
from vca_patch.targets.vca.layer import VisualContrastAttention  # noqa: E402

CONFIG = VCAConfig(contrast_tokens=16, init="paper")  # random e±, λ, DWC: every new parameter matters


def dit_call(model, latent):
    B = latent.shape[0]
    return model(latent, timestep=torch.arange(B) * 7 + 3, class_labels=torch.arange(B) % 10).sample


def pixart_call(model, latent):
    B = latent.shape[0]
    text = torch.randn(B, 5, 24, generator=torch.Generator().manual_seed(3)).to(latent)
    return model(latent, encoder_hidden_states=text, timestep=torch.arange(B) * 7 + 3, added_cond_kwargs={}).sample


# -- classification and verification ------------------------------------------------------------------------


def test_adapter_is_chosen_for_diffusers_transformers():
    assert isinstance(adapter_for(tiny_dit()), DiffusersDiTAdapter)
    assert isinstance(adapter_for(tiny_pixart()), DiffusersDiTAdapter)


def test_dit_and_pixart_sites_are_classified_and_verified():
    dit_report = inspect_model(tiny_dit(), CONFIG)
    assert [s.path for s in dit_report.patched] == ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    assert [s.layer_index for s in dit_report.patched] == [0, 1]
    assert all(s.verified is True and not s.notes for s in dit_report.patched)
    assert dit_report.skipped == []

    report = inspect_model(tiny_pixart(), CONFIG)
    assert [s.path for s in report.patched] == ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    assert all(s.verified is True for s in report.patched)
    skipped = {s.path: s.reason for s in report.skipped}
    assert sorted(skipped) == ["transformer_blocks.0.attn2", "transformer_blocks.1.attn2"]
    assert all("cross-attention" in reason for reason in skipped.values())
    assert report.layout == TokenLayout(0, (8, 8))  # sample_size 16, patch 2, no prefix


def test_verification_reference_matches_the_diffusers_processor_in_float64():
    """The reference the adapter verifies against reproduces AttnProcessor2_0 to float64 round-off."""
    model = tiny_pixart().double()
    adapter = DiffusersDiTAdapter()
    sites, _ = adapter.find_sites(model)
    x = latent(2, 24, 32).double()
    for site in sites:
        expected = site.module(x)
        got = reference_softmax_attention(adapter.carry(site), x)
        assert ((got - expected).norm() / expected.norm()) < 5e-15  # measured 2e-16


def test_unknown_and_wrong_processors_are_skipped_with_why():
    model = tiny_dit()

    class IPAdapterLike(AttnProcessor2_0):
        pass

    model.transformer_blocks[0].attn1.set_processor(IPAdapterLike())
    model.transformer_blocks[1].attn1.set_processor(processor_impostor(AttnProcessor2_0, lambda out: 2 * out)())
    with pytest.raises(NothingToPatchError) as info:
        patch_model(model, CONFIG)
    message = str(info.value)
    assert "transformer_blocks.0.attn1" in message and "unknown attention processor" in message
    assert "IPAdapterLike" in message
    assert "transformer_blocks.1.attn1" in message and "verification failed" in message
    assert get_patch_state(model) is None


def test_already_linear_attention_is_skipped():
    torch.manual_seed(0)
    sana = diffusers.SanaTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32, caption_channels=24,
        sample_size=16, patch_size=1,
    )  # fmt: skip
    with pytest.raises(NothingToPatchError, match="already linear attention"):
        patch_model(sana, CONFIG)


def test_sd3_image_self_attention_converted():  # its joint attention: tests/test_diffusers_joint.py
    torch.manual_seed(0)
    sd3 = diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=24, caption_projection_dim=32, pooled_projection_dim=12, out_channels=4,
        pos_embed_max_size=16, dual_attention_layers=(0,),
    ).eval()  # fmt: skip
    report = patch_model(sd3, CONFIG)
    assert "transformer_blocks.0.attn2" in [s.path for s in report.patched]
    assert all(s.verified is True for s in report.patched) and report.skipped == []
    x = latent(1, 4, 16, 24)
    out = sd3(
        x, encoder_hidden_states=latent(1, 7, 24), pooled_projections=latent(1, 12), timestep=torch.tensor([5])
    ).sample
    assert out.shape == x.shape and out.isfinite().all()


# -- processor swap ---------------------------------------------------------------------------------------


def test_processor_swap_keeps_state_dict_names_and_unpatch_is_bit_identical():
    model = tiny_pixart()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    processors = attention_processors(model)
    x = latent(2, 4, 16, 24)
    with torch.no_grad():
        reference = pixart_call(model, x)

    patch_model(model, CONFIG)
    after = model.state_dict()
    assert set(before) <= set(after)  # every original key, same name
    assert all(torch.equal(after[k], v) for k, v in before.items())
    new = sorted(set(after) - set(before))
    assert new and all(".attn1.vca." in k for k in new)
    assert sorted(patched_processors(model)) == ["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"]
    assert model.transformer_blocks[0].attn2.processor is processors["transformer_blocks.0.attn2"]
    with torch.no_grad():
        patched = pixart_call(model, x)
    assert patched.isfinite().all() and not torch.allclose(patched, reference)

    unpatch_model(model)
    assert attention_processors(model) == processors
    assert all(processor is processors[p] for p, processor in attention_processors(model).items())
    restored = model.state_dict()
    assert list(restored) == list(before) and all(torch.equal(restored[k], v) for k, v in before.items())
    with torch.no_grad():
        assert torch.equal(pixart_call(model, x), reference)


def test_patched_attention_matches_float64_vca_reference_on_a_non_square_grid():
    """The processor runs VCA on the attention's own to_q/to_k/to_v/to_out, after a dtype conversion."""
    model = tiny_pixart()
    patch_model(model, CONFIG)
    model.double()
    attn = model.transformer_blocks[1].attn1
    layer = attn.processor.layer
    grid = (5, 7)
    x = latent(2, grid[0] * grid[1], 32).double()
    got = attn(x, layout=TokenLayout(0, grid))

    fresh = VisualContrastAttention(32, 2, contrast_grid=(4, 4), layer_index=1, stage2_temperature=True)
    fresh.prefix_readout = layer.prefix_readout
    fresh = fresh.double()
    with torch.no_grad():
        fresh.qkv.weight.copy_(torch.cat([attn.to_q.weight, attn.to_k.weight, attn.to_v.weight]))
        fresh.qkv.bias.copy_(torch.cat([attn.to_q.bias, attn.to_k.bias, attn.to_v.bias]))
        fresh.proj.load_state_dict(attn.to_out[0].state_dict())
        fresh.load_state_dict(attn.vca.state_dict(), strict=False)
    expected = reference_vca(fresh, x, 0, grid)
    assert got.dtype == torch.float64
    assert ((got - expected).norm() / expected.norm()) < 1e-14  # measured 5e-16


def test_training_reaches_new_and_carried_parameters_and_copies_are_independent():
    model = tiny_dit()
    patch_model(model, CONFIG)
    names = {n for n, _ in model.named_parameters()}
    assert "transformer_blocks.0.attn1.vca.contrast_embed_pos" in names
    model.train()
    dit_call(model, latent(2, 4, 16, 16)).square().mean().backward()
    attn = model.transformer_blocks[0].attn1
    assert attn.vca.contrast_embed_pos.grad.abs().sum() > 0 and attn.to_q.weight.grad.abs().sum() > 0

    model.eval()
    twin = copy.deepcopy(model)
    x = latent(1, 4, 16, 16)
    with torch.no_grad():
        assert torch.equal(dit_call(twin, x), dit_call(model, x))
        twin.transformer_blocks[0].attn1.vca.contrast_embed_pos.add_(1.0)
        twin.transformer_blocks[0].attn1.to_q.weight.mul_(2.0)
        assert not torch.equal(dit_call(twin, x), dit_call(model, x))
        reference = dit_call(model, x)
        model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)  # parameters replaced: re-bound
        assert torch.equal(dit_call(model, x), reference)


def test_processor_refuses_cross_attention_and_masks():
    model = tiny_dit()
    patch_model(model, CONFIG)
    attn = model.transformer_blocks[0].attn1
    x = latent(1, 16, 32)
    assert isinstance(attn.processor, CarriedLayerProcessor)
    with pytest.raises(TypeError, match="encoder_hidden_states"):
        attn(x, encoder_hidden_states=x, layout=TokenLayout(0, (4, 4)))
    with pytest.raises(ValueError, match="attention mask"):
        attn(x, attention_mask=torch.ones(1, 16), layout=TokenLayout(0, (4, 4)))


# -- layout and pipelines ---------------------------------------------------------------------------------


def test_dit_pipeline_runs_patched_at_two_resolutions():
    transformer = tiny_dit(num_classes=1000)  # DiTPipeline's classifier-free guidance uses class 1000 as null
    pipe = diffusers.DiTPipeline(transformer=transformer, vae=tiny_vae(), scheduler=diffusers.DDIMScheduler())
    pipe.set_progress_bar_config(disable=True)

    def generate():
        generator = torch.Generator().manual_seed(0)
        images = pipe(class_labels=[1, 3], num_inference_steps=3, output_type="np", generator=generator).images
        return torch.from_numpy(images)  # decoded, in [0, 1] (NaN would survive the clamp)

    reference = generate()
    patch_model(transformer, CONFIG)
    grids = record_grids(transformer)
    images = generate()
    assert images.shape == reference.shape == (2, 16, 16, 3)
    assert images.isfinite().all() and not torch.allclose(images, reference)
    assert grids == [(8, 8)] * (3 * 2)  # 3 steps x 2 blocks (CFG runs in one batch)

    # A second resolution: 24x24 latents (DiT's own unpatchify needs a square latent), a hand-written DDIM loop.
    grids.clear()

    def eps(sample, t):
        return transformer(sample, timestep=t.expand(1), class_labels=torch.tensor([7])).sample[:, :4]

    sample = denoise(diffusers.DDIMScheduler(), latent(1, 4, 24, 24), eps)
    assert sample.isfinite().all() and grids == [(12, 12)] * (3 * 2)


def test_pixart_pipeline_runs_patched_on_a_non_square_latent():
    transformer = tiny_pixart()
    patch_model(transformer, CONFIG)
    grids = record_grids(transformer)
    pipe = diffusers.PixArtAlphaPipeline(
        tokenizer=None, text_encoder=None, vae=tiny_vae(), transformer=transformer,
        scheduler=diffusers.DPMSolverMultistepScheduler(),
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    text, mask = latent(1, 5, 24, seed=4), torch.ones(1, 5)
    images = pipe(
        prompt_embeds=text, prompt_attention_mask=mask, negative_prompt=None,
        negative_prompt_embeds=torch.zeros_like(text), negative_prompt_attention_mask=mask, height=16, width=24,
        num_inference_steps=3, output_type="latent", use_resolution_binning=False,
        generator=torch.Generator().manual_seed(0),
    ).images  # fmt: skip
    assert images.shape == (1, 4, 16, 24) and images.isfinite().all()
    assert grids == [(8, 12)] * (3 * 2)  # H/p x W/p of the latent, every step and block


# -- checkpoints ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["merged", "delta"])
def test_save_and_reload_give_identical_outputs(tmp_path, diffusers_loadable, form):
    model, x = tiny_pixart(), latent(2, 4, 16, 24)
    reloaded = patch_save_reload(model, CONFIG, form, tmp_path, lambda m: pixart_call(m, x))
    loaded = reloaded.model
    assert type(loaded) is type(model)
    assert sorted(patched_processors(loaded)) == sorted(patched_processors(model))
    with torch.no_grad():
        assert torch.equal(pixart_call(loaded, x), reloaded.expected)
    if form == "delta":
        stored = reloaded.delta
        assert stored and all(".vca." in k for k in stored)  # only the new attention parameters


def test_base_description_refuses_unknown_classes_and_paths():
    from vca_patch.checkpoint.config_guard import UnsafeConfigError

    description = DiffusersDiTAdapter().describe_base(tiny_dit())
    check_diffusers_base(description, "test")
    with pytest.raises(UnsafeConfigError, match="architecture"):
        check_diffusers_base({**description, "architecture": "AutoModel"}, "test")
    with pytest.raises(UnsafeConfigError, match="weights_path"):
        check_diffusers_base({**description, "config": {**description["config"], "weights_path": "/x"}}, "test")


def test_bfloat16_model_and_gradient_checkpointing():
    model = tiny_dit().to(torch.bfloat16)
    assert all(s.verified is True for s in patch_model(model, CONFIG).patched)  # verified on a float32 copy
    with torch.no_grad():
        out = dit_call(model, latent(1, 4, 16, 16).bfloat16())
    assert out.dtype == torch.bfloat16 and out.isfinite().all()

    model = tiny_dit()
    patch_model(model, CONFIG)
    model.enable_gradient_checkpointing()
    model.train()
    dit_call(model, latent(2, 4, 16, 16)).square().mean().backward()  # blocks recomputed: the layout is found
    assert model.transformer_blocks[1].attn1.vca.dwc.weight.grad.abs().sum() > 0
