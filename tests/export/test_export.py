"""Converted models export with a dynamic batch and image size: torch.export (.pt2, saved and reloaded) and ONNX in
onnxruntime match eager at three resolutions (non-square included); `vca-patch export` on a converted folder; bad
input refused in one line with nothing written."""

from __future__ import annotations

import pytest
import timm
import torch
from typer.testing import CliRunner

import vca_patch
from tests.support.models import TARGET_CONFIGS
from vca_patch import VCAConfig, patch_model
from vca_patch.cli.app import app
from vca_patch.export import ExportError, export_model

# eager runs VCA's fused CPU kernel, the exported graph the composite path: measured max |error| <= 3e-7
ATOL = 1e-5

TINY = {"depth": 2, "img_size": 32, "embed_dim": 48, "num_heads": 3, "drop_path_rate": 0.0}
SIZES = [(32, 32), (48, 64), (64, 32)]  # the export size, then non-square grids
MERGE_SIZES = [(64, 64), (48, 96), (96, 64)]  # merging 2 tokens a block needs >= 2 B tokens in the last block


def _deit(target: str, *, dynamic: bool = True) -> torch.nn.Module:
    model = timm.create_model(
        "deit_tiny_patch16_224", pretrained=False, dynamic_img_size=dynamic, **TINY, num_classes=10
    ).eval()
    patch_model(model, TARGET_CONFIGS[target]())
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the new parameters off their (often preserving) init: the grid then matters
        for name, p in model.named_parameters():
            if any(part in name for part in ("lambda", "contrast_embed", "dwc", "local")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


def _check_pt2(model: torch.nn.Module, path, sizes) -> float:
    result = export_model(model, path, format="pt2", dynamic=True, img_size=sizes[0])
    program = torch.export.load(path)
    # standard operators only: a fused vca_patch op would load only where its kernel is built
    assert not [node for node in program.graph.nodes if str(node.target).startswith("vca_patch")]
    run = program.module()
    errors = [result.max_error]
    with torch.no_grad():
        for i, (h, w) in enumerate(sizes):
            x = torch.randn(i + 1, 3, h, w, generator=torch.Generator().manual_seed(i))
            errors.append(float((run(x) - model(x)).abs().max()))
    return max(errors)


@pytest.mark.parametrize("target", ["vca", "vca_local3", pytest.param("mano", marks=pytest.mark.e2e), "didb"])
def test_torch_export_dynamic_batch_and_size(tmp_path, target):
    assert _check_pt2(_deit(target), tmp_path / "m.pt2", SIZES) < ATOL


@pytest.mark.slow
def test_torch_export_dynamic_merge(tmp_path):
    assert _check_pt2(_deit("merge"), tmp_path / "m.pt2", MERGE_SIZES) < ATOL


def _check_onnx(model: torch.nn.Module, path, sizes) -> float:
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    onnx = pytest.importorskip("onnx")
    result = export_model(model, path, format="onnx", dynamic=True, img_size=sizes[0])
    graph = onnx.load(str(path)).graph
    assert {node.domain for node in graph.node} <= {"", "ai.onnx"}  # no vca_patch custom op
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    errors = [result.max_error]
    with torch.no_grad():
        for i, (h, w) in enumerate(sizes):
            x = torch.randn(i + 1, 3, h, w, generator=torch.Generator().manual_seed(i))
            out = session.run(None, {"pixel_values": x.numpy()})[0]
            errors.append(float((torch.from_numpy(out) - model(x)).abs().max()))
    return max(errors)


@pytest.mark.e2e  # ~12 s on one core: in make test-e2e
def test_onnx_pools_and_reads_neighbours_at_grids_it_was_not_traced_at(tmp_path):
    """Contrast pooling over grids that are not multiples of the contrast grid (4×3, 3×5 and 8×8 patches into 2×2)
    and the local term: exporters used to bake the traced grid's pooling windows and neighbour mask into the graph
    (onnxruntime then failed, or pooled wrong windows silently: 1.5e-4 off at 3×5)."""
    model = timm.create_model(
        "deit_tiny_patch16_224", pretrained=False, dynamic_img_size=True, **TINY, num_classes=10
    ).eval()
    patch_model(model, VCAConfig(contrast_tokens=4, local_window=3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(part in name for part in ("lambda", "contrast_embed", "dwc", "local")):
                p.add_(0.3)
    assert _check_onnx(model, tmp_path / "m.onnx", [(64, 48), (48, 80), (128, 128)]) < ATOL


# --- the CLI ---------------------------------------------------------------------------------------------------

runner = CliRunner()


def _folder(tmp_path, *, dynamic: bool):
    model = _deit("vca", dynamic=dynamic)
    args = {**TINY, "num_classes": 10, **({"dynamic_img_size": True} if dynamic else {})}
    folder = tmp_path / ("dyn" if dynamic else "fixed")
    vca_patch.save_pretrained(model, folder, model_args=args)
    return folder


def test_cli_exports_pt2_dynamic(tmp_path):
    folder = _folder(tmp_path, dynamic=True)
    out = tmp_path / "model.pt2"
    result = runner.invoke(
        app, ["export", str(folder), "--format", "pt2", "--dynamic", "--img-size", "32x48", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "max |error|" in result.output and "dynamic" in result.output
    assert out.is_file() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    x = torch.randn(3, 3, 64, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            torch.export.load(out).module()(x), vca_patch.from_pretrained(folder)(x), atol=ATOL, rtol=0
        )


def test_cli_exports_onnx_static(tmp_path):
    pytest.importorskip("onnxscript")
    pytest.importorskip("onnxruntime")
    folder = _folder(tmp_path, dynamic=False)
    result = runner.invoke(app, ["export", str(folder), "--format", "onnx"])
    assert result.exit_code == 0, result.output
    assert "static" in result.output and "max |error|" in result.output
    assert (tmp_path / "fixed.onnx").is_file()


def _refused(tmp_path, args: list[str], message: str) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    result = runner.invoke(app, ["export", *args])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary left


def test_cli_refuses_a_folder_that_is_not_a_converted_model(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("hi")
    _refused(tmp_path, [str(tmp_path / "plain"), "-o", str(tmp_path / "m.pt2")], "not a vca-patch checkpoint")


def test_cli_refuses_an_unsupported_format(tmp_path):
    folder = _folder(tmp_path, dynamic=True)
    _refused(tmp_path, [str(folder), "--format", "tflite"], "unsupported --format 'tflite'")


def test_cli_refuses_a_dynamic_export_of_a_fixed_size_model(tmp_path):
    folder = _folder(tmp_path, dynamic=False)
    _refused(tmp_path, [str(folder), "--dynamic", "-o", str(tmp_path / "m.pt2")], "fixed-size")


def test_api_refuses_unknown_format(tmp_path):
    with pytest.raises(ExportError, match="unsupported format"):
        export_model(_deit("vca"), tmp_path / "m.x", format="x")
    assert list(tmp_path.iterdir()) == []
