"""What the hierarchical tests (PVT, Swin, SwinV2; timm and transformers) share: VCA parameters moved off their
init, a spy on the grids the VCA cores run with, unpatch round trips and gradient-checkpointing comparisons."""

from __future__ import annotations

from collections.abc import Callable

import torch

from vca_patch import patch_model, unpatch_model


def randomise_vca(layer: torch.nn.Module, *, norms: bool = True) -> None:
    """Move every VCA parameter off its function-preserving init (a term the layer dropped would then show).

    Paper init, e± scaled by 0.3, the residual gate (where the layer has one) drawn from N(0, 1); `norms=True` adds
    U(0, 0.5) noise to both RMSNorm weights and the Stage-II temperature, `norms=False` only adds 0.5 to the
    temperature.
    """
    layer.reset_vca_parameters("paper")
    with torch.no_grad():
        if norms:
            for p in (layer.stage1_norm.weight, layer.stage2_norm.weight, layer.stage2_temperature):
                p.add_(torch.rand_like(p) * 0.5)
        else:
            layer.stage2_temperature.add_(0.5)
        layer.contrast_embed_pos.mul_(0.3)
        layer.contrast_embed_neg.mul_(0.3)
        if getattr(layer, "residual_gate", None) is not None:
            layer.residual_gate.normal_()


def record_attend_grids(model: torch.nn.Module, layer_type: type) -> list[tuple[int, int]]:
    """A list that fills with the layout grid of every VCA core call (fused CPU kernel or composite path) of the
    `layer_type` layers in `model`."""
    seen = []
    for module in model.modules():
        if isinstance(module, layer_type):
            fused, composite = module.attend_fused, module.attend

            def spy_fused(x, layout, _orig=fused):
                seen.append(layout.grid)
                return _orig(x, layout)

            def spy(x, q, k, v, layout, *rest, _orig=composite):
                seen.append(layout.grid)
                return _orig(x, q, k, v, layout, *rest)

            module.attend_fused, module.attend = spy_fused, spy
    return seen


def assert_state_restored(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """`model`'s state dict has exactly the keys of `state` and bit-identical tensors."""
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def assert_unpatch_restores(
    model: torch.nn.Module,
    x: torch.Tensor,
    features: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] = lambda model, x: model(x),
) -> None:
    """Patch `model` (the default config): `features(model, x)` changes; unpatch it: the state dict and the features
    are bit-identical to before."""
    with torch.no_grad():
        before = features(model, x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    patch_model(model)
    with torch.no_grad():
        assert not torch.equal(features(model, x), before)
    unpatch_model(model)
    assert_state_restored(model, state)
    with torch.no_grad():
        assert torch.equal(features(model, x), before)


def gradients_without_and_with_checkpointing(
    model: torch.nn.Module, x: torch.Tensor
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Parameter gradients of `model(x).logits.square().sum()` in train mode: plain, then with transformers'
    (non-reentrant) activation checkpointing enabled."""
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        model(x).logits.square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return grads[0], grads[1]
