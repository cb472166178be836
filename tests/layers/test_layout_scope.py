"""The token layout belongs to the forward call: checkpointing, threads, replicas and stale reads."""

import threading

import pytest
import timm
import torch

from tests.support.vca import perturbed
from vca_patch import VisualContrastAttention, patch_model, unpatch_model
from vca_patch.layers.layout import TokenLayout
from vca_patch.surgery.patch import get_patch_state


def _dynamic_vit() -> torch.nn.Module:
    model = timm.create_model(
        "deit_tiny_patch16_224", pretrained=False, depth=2, img_size=64, dynamic_img_size=True, drop_path_rate=0.0
    )
    patch_model(model)
    for module in model.modules():
        if isinstance(module, VisualContrastAttention):
            perturbed(module)  # the grid then matters everywhere: pooling windows, e±, the conv
    return model.train()


def _transposed_grid_gradients(model: torch.nn.Module, images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """One backward through two forwards at transposed grids (same token count)."""
    model.zero_grad(set_to_none=True)
    outputs = [model(x) for x in images]  # both graphs alive; the second forward ran last
    sum(o.square().mean() for o in outputs).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_at_transposed_grids_gives_the_same_gradients():
    model = _dynamic_vit()
    gen = torch.Generator().manual_seed(0)
    images = [torch.randn(2, 3, 64, 128, generator=gen), torch.randn(2, 3, 128, 64, generator=gen)]  # 4x8, 8x4
    plain = _transposed_grid_gradients(model, images)
    model.set_grad_checkpointing(True)
    checkpointed = _transposed_grid_gradients(model, images)
    assert plain.keys() == checkpointed.keys() and any("contrast_embed" in k for k in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_transformers_gradient_checkpointing_recovers_the_layout_of_each_forward():
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=56, patch_size=14
    )
    model = transformers.Dinov2Model(config)
    patch_model(model)
    for module in model.modules():
        if isinstance(module, VisualContrastAttention):
            perturbed(module)
    model.train()
    gen = torch.Generator().manual_seed(1)
    images = [torch.randn(2, 3, 28, 56, generator=gen), torch.randn(2, 3, 56, 28, generator=gen)]  # 2x4, 4x2

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        outs = [model(pixel_values=x).last_hidden_state for x in images]
        sum(o.square().mean() for o in outs).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain = grads()
    model.gradient_checkpointing_enable()
    checkpointed = grads()
    assert plain.keys() == checkpointed.keys()
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_threads_at_different_resolutions_each_get_their_own_layout():
    """One model (so one set of hooks, as DataParallel's replicas share) run by four threads at once."""
    model = _dynamic_vit().eval()
    sizes = [(64, 64), (64, 128), (128, 64), (96, 96)]
    inputs = {s: torch.randn(1, 3, *s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(sizes)}
    with torch.no_grad():
        expected = {s: model(x) for s, x in inputs.items()}
    barrier, errors, results = threading.Barrier(len(sizes)), [], {}

    def run(size):
        try:
            barrier.wait()
            with torch.no_grad():
                results[size] = [model(inputs[size]) for _ in range(8)]
        except Exception as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(s,)) for s in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for size, outs in results.items():
        for out in outs:
            torch.testing.assert_close(out, expected[size], rtol=0, atol=1e-6)


def test_a_layer_called_outside_its_models_forward_refuses_a_stale_layout():
    model = _dynamic_vit().eval()
    with torch.no_grad():
        model(torch.randn(1, 3, 64, 128))
        x = torch.randn(1, 33, 192)  # a 4x8 or 8x4 grid + CLS: the last forward's layout would "fit"
        with pytest.raises(RuntimeError, match="no token layout for this call"):
            model.blocks[0].attn(x)
        layout = TokenLayout(1, (4, 8))
        tracker = get_patch_state(model).tracker
        with tracker.scope(layout):  # an explicit scope, e.g. for layer-by-layer calibration
            torch.testing.assert_close(model.blocks[0].attn(x), model.blocks[0].attn(x, layout=layout))
        with pytest.raises(RuntimeError, match="no token layout"):
            model.blocks[0].attn(x)


def test_a_forward_that_raises_closes_its_scope():
    model = _dynamic_vit().eval()
    tracker = get_patch_state(model).tracker

    def boom(module, args, output):
        raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_hook(boom)
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        model(torch.randn(1, 3, 64, 64))
    handle.remove()
    assert tracker.layout is None


def test_unpatch_removes_the_scope_hooks():
    model = _dynamic_vit()
    unpatch_model(model)
    assert not model._forward_hooks and not model.patch_embed._forward_hooks
