"""`export_model`: a converted (or any) vision model to a `torch.export` program (.pt2) or an ONNX file.

Traced, every converted layer takes its composite path (`torch.compiler.is_compiling()` is True under export):
standard ops and `scaled_dot_product_attention`, no vca_patch custom op, and the token grid follows the input's
symbolic height and width. With `dynamic`, the batch, height and width are dynamic (height and width as multiples
of the patch size); the exported model is reloaded from the written file and checked against eager at the export
size and at a second, non-square size with another batch. Nothing is written unless the check runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.checkpoint.folder import from_pretrained
from vca_patch.core.atomic import atomic_file
from vca_patch.core.errors import ConfigError
from vca_patch.core.install import install_hint
from vca_patch.core.model_io import model_input_size, output_tensor

FORMATS = ("pt2", "onnx")
_MAX_PATCHES = 512  # per side, the dynamic dims' upper bound (a 8192 px image at patch 16)


class ExportError(ConfigError):
    """The model cannot be exported as asked (format, dynamic sizes, a custom op left in the graph)."""


@dataclass
class ExportResult:
    path: Path
    format: str
    dynamic: bool
    max_error: float  # max |exported - eager| over the checked batches
    checked: list[tuple[int, int, int]] = field(default_factory=list)  # (batch, height, width) checked


class _Images(nn.Module):
    """images -> the model's main output tensor (transformers' outputs are dataclasses)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return output_tensor(self.model(images))


def takes_any_size(model: nn.Module) -> bool:
    """Whether the original model takes any image size: timm's `dynamic_img_size`, or a transformers DINOv2."""
    if getattr(model, "dynamic_img_size", False) or getattr(getattr(model, "patch_embed", None), "dynamic_img_size", 0):
        return True
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) == "dinov2"


def patch_size(model: nn.Module) -> tuple[int, int]:
    """The patch embedding's stride (height, width)."""
    size = getattr(getattr(model, "patch_embed", None), "patch_size", None)
    if size is None:
        config = getattr(model, "config", None)
        size = getattr(getattr(config, "vision_config", config), "patch_size", None)
    if size is None:
        raise ExportError(f"cannot tell the patch size of {type(model).__name__}; export it with --static")
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _image_size(model: nn.Module, img_size: int | tuple[int, int] | None, dynamic: bool) -> tuple[int, int, int]:
    chans, height, width = model_input_size(model)
    if img_size is None:
        return chans, height, width
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    if (h, w) != (height, width) and not takes_any_size(model):
        raise ExportError(f"the model takes only {height}x{width} images (its original is fixed-size); got {h}x{w}")
    if dynamic:
        ph, pw = patch_size(model)
        if h % ph or w % pw:
            raise ExportError(f"a dynamic export needs a size that is a multiple of the patch {ph}x{pw}; got {h}x{w}")
    return chans, int(h), int(w)


def _dynamic_shapes(model: nn.Module) -> tuple[dict[int, Any]]:
    ph, pw = patch_size(model)
    batch = torch.export.Dim("batch", min=1, max=4096)
    rows = torch.export.Dim("patch_rows", min=1, max=_MAX_PATCHES)
    cols = torch.export.Dim("patch_cols", min=1, max=_MAX_PATCHES)
    return ({0: batch, 2: ph * rows, 3: pw * cols},)


def _custom_ops(program: torch.export.ExportedProgram) -> list[str]:
    return sorted(
        {str(n.target) for n in program.graph.nodes if n.op == "call_function" and "vca_patch" in str(n.target)}
    )


def _images(batch: int, chans: int, height: int, width: int, seed: int, like: nn.Module) -> torch.Tensor:
    param = next(iter(like.parameters()), None)
    x = torch.randn(batch, chans, height, width, generator=torch.Generator().manual_seed(seed))
    return x if param is None else x.to(device=param.device, dtype=param.dtype)


def export_model(
    model: nn.Module,
    path: str | Path,
    *,
    format: str = "pt2",
    dynamic: bool | None = None,
    img_size: int | tuple[int, int] | None = None,
    batch_size: int = 2,
    opset: int | None = None,
) -> ExportResult:
    """Export `model` (eval mode, its device and dtype) to `path`; see the module docstring.

    `dynamic`: None exports dynamic sizes where the model takes any size, else static; True on a fixed-size model
    is an ExportError. `img_size`: the example (and checked) size, default the model's input size."""
    if format not in FORMATS:
        raise ExportError(f"unsupported format {format!r}: choose one of {', '.join(FORMATS)}")
    if dynamic is None:
        dynamic = takes_any_size(model)
    elif dynamic and not takes_any_size(model):
        raise ExportError(
            f"{type(model).__name__} was built for one image size (its original is fixed-size, no dynamic_img_size): "
            "a dynamic export is not possible; export it with --static"
        )
    chans, height, width = _image_size(model, img_size, dynamic)
    wrapped = _Images(model).eval()
    example = _images(batch_size, chans, height, width, 0, model)
    shapes = _dynamic_shapes(model) if dynamic else None
    checks = [example]
    if dynamic:
        ph, pw = patch_size(model)
        checks.append(_images(batch_size + 1, chans, height + ph, width + 2 * pw, 1, model))  # non-square, new batch
    path = Path(path)
    with torch.no_grad():
        program = torch.export.export(wrapped, (example,), dynamic_shapes=shapes)
        leaked = _custom_ops(program)
        if leaked:
            raise ExportError(f"custom ops left in the exported graph: {', '.join(leaked)}")
        eager = [wrapped(x) for x in checks]
        with atomic_file(path, suffix=f".{format}") as tmp:
            if format == "pt2":
                torch.export.save(program, tmp)
                run = torch.export.load(tmp).module()
                outputs = [run(x) for x in checks]
            else:
                outputs = _onnx(wrapped, example, shapes, tmp, checks, opset)
            pairs = zip(outputs, eager, strict=True)
            error = max(float((o.to(e.dtype).to(e.device) - e).abs().max()) for o, e in pairs)
    return ExportResult(path, format, dynamic, error, [tuple(x.shape[:1]) + tuple(x.shape[2:]) for x in checks])


def _onnx(
    wrapped: nn.Module, example: torch.Tensor, shapes: Any, tmp: Path, checks: list[torch.Tensor], opset: int | None
) -> list[torch.Tensor]:
    try:
        import onnxruntime
        import onnxscript  # noqa: F401  (torch's dynamo exporter needs it)
    except ImportError as exc:
        raise ExportError(f"ONNX export needs {exc.name}: {install_hint('export')}") from None
    kwargs = {} if opset is None else {"opset_version": opset}
    program = torch.onnx.export(
        wrapped, (example,), dynamo=True, dynamic_shapes=shapes, input_names=["pixel_values"],
        output_names=["output"], verbose=False, **kwargs,
    )  # fmt: skip
    domains = {node.domain for node in program.model_proto.graph.node} - {"", "ai.onnx"}
    if domains:
        raise ExportError(f"custom op domains left in the ONNX graph: {', '.join(sorted(domains))}")
    program.save(str(tmp), external_data=False)
    session = onnxruntime.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    return [torch.from_numpy(session.run(None, {name: x.float().cpu().numpy()})[0]) for x in checks]


def export_folder(
    directory: str | Path,
    path: str | Path,
    *,
    format: str = "pt2",
    dynamic: bool | None = None,
    img_size: int | tuple[int, int] | None = None,
) -> ExportResult:
    """`export_model` on the converted model saved in `directory` (a `save_pretrained` folder)."""
    if format not in FORMATS:  # before loading anything
        raise ExportError(f"unsupported format {format!r}: choose one of {', '.join(FORMATS)}")
    model = from_pretrained(directory)
    return export_model(model, path, format=format, dynamic=dynamic, img_size=img_size)
