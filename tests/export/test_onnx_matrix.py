"""ONNX in onnxruntime against eager, every target on the families whose original exports with a dynamic image
size (timm DeiT with dynamic_img_size, transformers Dinov2): one dynamic export per model (batch, height and
width), run at three resolutions (non-square included); the graph holds standard ONNX operators only."""

from __future__ import annotations

import pytest
import timm
import torch

from tests.support.models import TARGET_CONFIGS
from vca_patch import patch_model
from vca_patch.core.model_io import output_tensor
from vca_patch.export import export_model

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

from vca_patch.export.onnx_file import nonstandard_ops, onnx_runner  # noqa: E402  (needs the export extra)

# eager runs the fused CPU kernels (VCA, neighbourhood, XNOR), onnxruntime the composite path: measured max
# |error| 0.9-1.8e-7 on DeiT, 4.8-9.5e-7 on Dinov2 (unnormalised last hidden states, entries up to ~10)
ATOL = 4e-6

# (export size, then two more) per family, non-square included. Merging r=2 tokens a block needs >= 2 B tokens
# in the last block; MANO's level count (so its graph) is fixed while no side exceeds its window (7 patches);
# transformers' Dinov2 skips interpolating its position embeddings at its own 4x4 grid, so a graph traced there
# holds for that grid alone: it is traced at 3x5 and run at grids other than 4x4 (as its original would be)
SIZES = {"deit": [(64, 64), (48, 80), (80, 48)], "dinov2": [(42, 70), (70, 42), (84, 56)]}


def _deit() -> torch.nn.Module:
    return timm.create_model(
        "deit_tiny_patch16_224", pretrained=False, dynamic_img_size=True, depth=2, img_size=64, embed_dim=48,
        num_heads=3, num_classes=10, drop_path_rate=0.0,
    )  # fmt: skip


def _dinov2() -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=56, patch_size=14
    )
    return transformers.Dinov2Model(config)


FAMILIES = {"deit": _deit, "dinov2": _dinov2}


def converted(family: str, target: str) -> torch.nn.Module:
    """A tiny random model of `family` patched with `target`, its new parameters moved off their (often
    preserving) init so that the grid, the local term and the binarisation all matter."""
    torch.manual_seed(0)
    model = FAMILIES[family]().eval()
    patch_model(model, TARGET_CONFIGS[target]())
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("lambda", "contrast_embed", "dwc", "local")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


def onnx_error(model: torch.nn.Module, path, sizes: list[tuple[int, int]]) -> float:
    """Export `model` to ONNX with dynamic batch and size at sizes[0] (onnxscript's optimiser off: half the export
    time; test_export's ONNX tests run it); max |onnxruntime - eager| over every size (batch 1, 2, 3), after
    checking the graph for non-standard operators."""
    result = export_model(model, path, format="onnx", dynamic=True, img_size=sizes[0], optimize=False)
    assert result.dynamic and not result.static
    assert nonstandard_ops(onnx.load(str(path))) == []  # no vca_patch / kernel / contrib op in the graph
    run = onnx_runner(path)
    errors = [result.max_error]
    with torch.no_grad():
        for i, (h, w) in enumerate(sizes):
            x = torch.randn(i + 1, 3, h, w, generator=torch.Generator().manual_seed(10 + i))
            errors.append(float((run(x) - output_tensor(model(x))).abs().max()))
    return max(errors)


# `make test` runs VCA on DeiT (~7 s a case on one core; test_export.py's ONNX test of the local term runs in e2e too);
# `make test-e2e` runs the whole matrix (MANO and merging ~14 s a case)
QUICK = {("deit", "vca")}
CASES = [
    pytest.param(family, target, marks=[] if (family, target) in QUICK else [pytest.mark.e2e])
    for family in sorted(FAMILIES)
    for target in sorted(TARGET_CONFIGS)
]


@pytest.mark.parametrize(("family", "target"), CASES)
def test_onnxruntime_matches_eager_at_three_resolutions(tmp_path, family, target):
    assert onnx_error(converted(family, target), tmp_path / "m.onnx", SIZES[family]) < ATOL
