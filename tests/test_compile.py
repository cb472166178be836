"""Converted models compile whole: no graph breaks, compiled == eager, a new resolution never reuses a stale grid."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend

from vca_patch import DIDBConfig, MANOConfig, MergeConfig, VCAConfig, patch_model

# compiled vs eager in float32: measured max abs error ~1e-6 on these tiny models (inductor reorders reductions)
ATOL = 2e-5
RTOL = 1e-4

TARGETS = {
    "vca": lambda: VCAConfig(),
    "vca_local3": lambda: VCAConfig(local_window=3),
    "mano": lambda: MANOConfig(),
    "merge": lambda: MergeConfig(r=2),
    "didb": lambda: DIDBConfig(),
}


def _randomise_new_parameters(model: torch.nn.Module) -> torch.nn.Module:
    """Move the replacement layers' own parameters off their (often preserving) init: the grid then matters."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("lambda", "contrast_embed", "dwc", "local")):
                p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.2)
    return model


def _deit(target: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(original, converted) tiny DeiTs taking any image size."""
    model = timm.create_model(
        "deit_tiny_patch16_224", pretrained=False, depth=2, img_size=32, embed_dim=48, num_heads=3,
        dynamic_img_size=True, drop_path_rate=0.0,
    )  # fmt: skip
    original = copy.deepcopy(model).eval()
    patch_model(model, TARGETS[target]())
    return original, _randomise_new_parameters(model).eval()


def _hf(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(original, converted) tiny transformers models, called on positional images."""
    transformers = pytest.importorskip("transformers")
    common = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
    if kind == "dinov2":
        model = transformers.Dinov2Model(transformers.Dinov2Config(**common, image_size=28, patch_size=14))
    else:
        model = transformers.ViTModel(transformers.ViTConfig(**common, image_size=32, patch_size=16))
    extra = {"interpolate_pos_encoding": True} if kind == "vit" else {}
    original = copy.deepcopy(model).eval()
    patch_model(model, VCAConfig())
    for m in (original, model):
        forward = m.forward
        m.forward = lambda x, forward=forward: forward(pixel_values=x, **extra)
    return original, _randomise_new_parameters(model).eval()


def _output(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


def _images(size: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(seed))


def _compiles(model: torch.nn.Module, sizes: list[tuple[int, int]]) -> int:
    """Frames compiled by `torch.compile(dynamic=True)` over `sizes`, each call checked against eager."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    for i, size in enumerate(sizes):
        xi = _images(size, seed=i)
        torch.testing.assert_close(_output(compiled(xi)), _output(model(xi)), atol=ATOL, rtol=RTOL)
    return counter.frame_count


_ORIGINAL_COMPILES: dict[str, int] = {}  # the original of a family compiles the same for every target


def _check(
    family: str,
    models: tuple[torch.nn.Module, torch.nn.Module],
    sizes: list[tuple[int, int]],
    *,
    inductor: bool = False,
    dynamic: bool = True,
) -> None:
    original, model = models
    torch._dynamo.reset()
    x = _images(sizes[0])
    with torch.no_grad():
        explanation = torch._dynamo.explain(model)(x)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        eager = _output(model(x))
        if inductor:
            torch._dynamo.reset()
            compiled = torch.compile(model, fullgraph=True)
            torch.testing.assert_close(_output(compiled(x)), eager, atol=ATOL, rtol=RTOL)
        if not dynamic:
            return
        # dynamic shapes: new resolutions (transposed, non-square) recompile no more often than the original model
        # does (at most once where the original is shape-generic), and never reuse a stale grid
        if family not in _ORIGINAL_COMPILES:
            _ORIGINAL_COMPILES[family] = _compiles(original, sizes)
        converted, before = _compiles(model, sizes), _ORIGINAL_COMPILES[family]
        assert converted <= max(before, 2), (converted, before)
    torch._dynamo.reset()


DEIT_SIZES = [(32, 32), (32, 64), (64, 32)]  # 2x2, then transposed non-square grids with the same token count


# CPU compile time dominates: the default run checks graph breaks everywhere and the dynamic-shape recompiles on
# one target per family; `-m slow` adds inductor's output and the dynamic check for every case.
@pytest.mark.parametrize("target", ["vca", "vca_local3", "mano", "merge", "didb"])
def test_deit_compiles_without_graph_breaks(target):
    _check("deit", _deit(target), DEIT_SIZES[1:], dynamic=target == "vca")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["vca", "vca_local3", "mano", "merge", "didb"])
def test_deit_inductor_matches_eager(target):
    _check("deit", _deit(target), DEIT_SIZES, inductor=True)


@pytest.mark.parametrize("kind", ["dinov2", "vit"])
def test_transformers_vca_compiles_without_graph_breaks(kind):
    _check(kind, _hf(kind), _HF_SIZES[kind][1:], dynamic=kind == "dinov2")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dinov2", "vit"])
def test_transformers_vca_inductor_matches_eager(kind):
    _check(kind, _hf(kind), _HF_SIZES[kind], inductor=True)


_HF_SIZES = {"dinov2": [(28, 28), (28, 56), (56, 28)], "vit": [(32, 32), (32, 64), (64, 32)]}
