"""`export_model`: a converted (or any) vision model to a `torch.export` program (.pt2) or an ONNX file.

Exported, every converted layer takes its composite path (`torch.compiler.is_exporting()`):
standard ops and `scaled_dot_product_attention`, no vca_patch custom op, and the token grid follows the input's
symbolic height and width. Dynamic axes: the batch always (unless `dynamic=False`), the height and width (as
multiples of the patch size) where the original takes any image size. The exported model is reloaded from the
written file and checked against eager at the export size and at a second size (another batch; with dynamic
height and width a non-square size). The program's shape guards are probed over many sizes (`guards.py`): a .pt2
refuses the sizes outside them, which the result reports; ONNX drops guards, so onnxruntime is also checked at the
smallest refused sizes and the export fails if it is wrong there. Nothing is written unless every step passes."""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vca_patch.checkpoint.folder import from_pretrained
from vca_patch.core.atomic import atomic_file
from vca_patch.core.model_io import model_input_size, output_tensor
from vca_patch.export.errors import ExportError, FixedSizeError
from vca_patch.export.guards import Guards, Refusal
from vca_patch.export.onnx_file import onnx_runner, write_onnx

FORMATS = ("pt2", "onnx")
_MAX_PATCHES = 512  # per side, the dynamic dims' upper bound (a 8192 px image at patch 16)
_MAX_BATCH = 4096
_NEARBY = ((1, 2), (-1, -2), (1, -1), (-1, 1))  # patches added to the export size for the second check
_OUTSIDE_CHECKS = 3  # guard-refused probe sizes checked in onnxruntime: the smallest of each guard


@dataclass
class ExportResult:
    path: Path
    format: str
    dynamic: bool  # dynamic height and width (the batch is dynamic unless `static`)
    max_error: float  # max |exported - eager| over the checked batches
    checked: list[tuple[int, int, int]] = field(default_factory=list)  # (batch, height, width) checked
    static: bool = False  # every axis fixed, the batch too
    limits: list[Refusal] = field(default_factory=list)  # probe sizes the program's guards refuse (a .pt2 raises)
    unserved: list[tuple[int, int]] = field(default_factory=list)  # refused sizes where onnxruntime fails

    def axes(self) -> str:
        """The dynamic axes in words."""
        if self.static:
            return "static"
        return "dynamic batch/height/width" if self.dynamic else "dynamic batch, static height/width"


class _Images(nn.Module):
    """images -> the model's main output tensor (transformers' outputs are dataclasses)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return output_tensor(self.model(images))


@contextmanager
def _unmasked_transformers() -> Iterator[None]:
    """While tracing, let transformers skip the attention mask of a call without one, as it does in eager.

    Exporting, transformers cannot look at the data to see that no token is masked, so it builds an all-true
    [B, 1, N, N] mask and hands it to every attention layer; converted layers (linear attention) refuse a mask
    tensor, and an all-true mask changes nothing. `_Images` passes no mask: told it is not exporting,
    transformers' check sees no padding mask and passes None, as in eager."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    original = getattr(masking_utils, "is_torchdynamo_exporting", None)
    if original is None:
        yield
        return
    masking_utils.is_torchdynamo_exporting = lambda: False
    try:
        yield
    finally:
        masking_utils.is_torchdynamo_exporting = original


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


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ExportError(f"unsupported format {format!r}: choose one of {', '.join(FORMATS)}")


def _dynamic_size(model: nn.Module, dynamic: bool | None) -> bool:
    """Whether height and width are dynamic: `dynamic`, by default where the model takes any size."""
    if dynamic is None:
        return takes_any_size(model)
    if dynamic and not takes_any_size(model):
        raise FixedSizeError(
            f"{type(model).__name__} was built for one image size (its original is fixed-size, no "
            "dynamic_img_size), so its height and width cannot be dynamic; export without --dynamic (dynamic "
            "batch, its own image size)"
        )
    return dynamic


def _image_size(model: nn.Module, img_size: int | tuple[int, int] | None, dynamic: bool) -> tuple[int, int, int]:
    chans, height, width = model_input_size(model)
    if img_size is None:
        return chans, height, width
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    if (h, w) != (height, width) and not takes_any_size(model):
        raise FixedSizeError(f"the model takes only {height}x{width} images (its original is fixed-size); got {h}x{w}")
    if dynamic:
        ph, pw = patch_size(model)
        if h % ph or w % pw:
            raise ExportError(f"a dynamic export needs a size that is a multiple of the patch {ph}x{pw}; got {h}x{w}")
    return chans, int(h), int(w)


def _dynamic_shapes(model: nn.Module, size: bool) -> tuple[dict[int, Any]]:
    """The batch dynamic, and with `size` the height and width as multiples of the patch."""
    batch = torch.export.Dim("batch", min=1, max=_MAX_BATCH)
    if not size:
        return ({0: batch},)
    ph, pw = patch_size(model)
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
    optimize: bool = True,
) -> ExportResult:
    """Export `model` (eval mode, its device and dtype) to `path`; see the module docstring.

    `dynamic`: None makes height and width dynamic where the model takes any size (the batch always); True on a
    fixed-size model is a FixedSizeError; False fixes every axis. `img_size`: the example (and checked) size,
    default the model's input size. ONNX: `opset` the opset version (default: the exporter's), `optimize` runs
    onnxscript's graph optimiser (constant folding, redundant casts and reshapes removed; False: a faster export
    of a larger graph, which onnxruntime optimises when it loads it)."""
    _check_format(format)
    size = _dynamic_size(model, dynamic)
    chans, height, width = _image_size(model, img_size, size)
    wrapped = _Images(model).eval()
    example = _images(batch_size, chans, height, width, 0, model)
    path = Path(path)
    with torch.no_grad():
        program = _trace(wrapped, example, None if dynamic is False else _dynamic_shapes(model, size))
        guards = Guards(program)
        checks = [example] if dynamic is False else [example, _second_check(model, example, guards, size, format)]
        limits = guards.probe(example, patch_size(model)) if size else []
        if format == "onnx":  # no guards in ONNX: check the smallest size that each refusing guard refuses too
            checks += [_images(1, chans, r.height, r.width, 2, model) for r in _per_guard(limits)]
        with atomic_file(path, suffix=f".{format}") as tmp:
            run = _write(program, example, tmp, format, opset, optimize)
            errors = [_checked(run, wrapped, x, guards.refusal(x)) for x in checks]
            if len(errors) > 1 and errors[1] is None:
                raise _not_dynamic(checks[1], guards)
    served = [(x, e) for x, e in zip(checks, errors, strict=True) if e is not None]
    unserved = [(x.shape[2], x.shape[3]) for x, e in zip(checks, errors, strict=True) if e is None]
    return ExportResult(
        path, format, size, max(e for _, e in served), [(x.shape[0], *x.shape[2:]) for x, _ in served],
        static=dynamic is False, limits=limits, unserved=unserved,
    )  # fmt: skip


def _trace(wrapped: nn.Module, example: torch.Tensor, shapes: Any) -> torch.export.ExportedProgram:
    """`torch.export` of `wrapped` on `example`; ExportError when a vca_patch custom op is left in the graph."""
    with _unmasked_transformers():
        program = torch.export.export(wrapped, (example,), dynamic_shapes=shapes)
    leaked = _custom_ops(program)
    if leaked:
        raise ExportError(f"custom ops left in the exported graph: {', '.join(leaked)}")
    return program


def _second_check(model: nn.Module, example: torch.Tensor, guards: Guards, size: bool, format: str) -> torch.Tensor:
    """Images of another batch (and with a dynamic size, of a nearby non-square size) to check the dynamic axes
    with. A .pt2 takes the first nearby size its guards accept (ExportError when none is); ONNX, which keeps no
    guard, the first nearby size, which onnxruntime must then serve."""
    batch, chans, height, width = example.shape
    if not size:
        return _images(batch + 1, chans, height, width, 1, model)
    ph, pw = patch_size(model)
    nearby = [(height + rows * ph, width + cols * pw) for rows, cols in _NEARBY]
    nearby = [(h, w) for h, w in nearby if h >= 2 * ph and w >= 2 * pw]
    for h, w in nearby:
        candidate = _images(batch + 1, chans, h, w, 1, model)
        if format == "onnx" or guards.refusal(candidate) is None:
            return candidate
    raise _not_dynamic(_images(batch + 1, chans, *nearby[0], 1, model), guards)


def _not_dynamic(images: torch.Tensor, guards: Guards) -> ExportError:
    refused = guards.refusal(images)
    where = "x".join(str(n) for n in images.shape[2:])
    return ExportError(
        f"the exported graph does not serve {where}, near the export size: it holds only where "
        f"{refused.guard if refused else 'the traced grid'} (a layer branched on the exact grid, e.g. transformers' "
        "Dinov2 skips interpolating its position embeddings at its own grid), so height and width are not "
        "dynamic; export at another --img-size, or with --static"
    )


def _write(
    program: torch.export.ExportedProgram,
    example: torch.Tensor,
    tmp: Path,
    format: str,
    opset: int | None,
    optimize: bool,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Write `program` in `format` to `tmp` and return the reloaded model's forward."""
    if format == "pt2":  # serialised in memory, then written by Python: a full disk or a file-size limit is an
        buffer = io.BytesIO()  # OSError naming it, where torch's own zip writer aborts the process
        torch.export.save(program, buffer)
        with open(tmp, "wb") as file:
            file.write(buffer.getbuffer())
        return torch.export.load(tmp).module()
    write_onnx(program, example, tmp, opset, optimize=optimize)
    return onnx_runner(tmp)


def _per_guard(limits: list[Refusal]) -> list[Refusal]:
    """The first (smallest) refused size of each distinct guard, at most _OUTSIDE_CHECKS."""
    firsts: dict[str, Refusal] = {}
    for refusal in limits:
        firsts.setdefault(refusal.guard, refusal)
    return list(firsts.values())[:_OUTSIDE_CHECKS]


def _checked(
    run: Callable[[torch.Tensor], torch.Tensor], wrapped: nn.Module, images: torch.Tensor, refused: Refusal | None
) -> float | None:
    """max |exported - eager| on `images`. At a size the program's guards refuse (`refused`: ONNX only, which keeps
    no guard) onnxruntime may fail (None: the size is not served, as a .pt2 would refuse it) or match eager within
    float32 rounding of the output's scale (a branch traced at one size that computes the same at others); a
    silent difference there refuses the export."""
    where = "x".join(str(int(n)) for n in images.shape[2:])
    expected = wrapped(images)
    try:
        out = run(images)
    except Exception as exc:  # onnxruntime's own errors: a reshape or broadcast of a traced grid
        if refused is not None:
            return None
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ExportError(f"the exported model fails at {where}: {first[:300]}") from None
    error = float((out.to(expected.dtype).to(expected.device) - expected).abs().max())
    if not math.isfinite(error):
        raise _not_finite(out, expected, where)
    if refused is not None and not error <= 1e-4 * (1 + float(expected.abs().max())):
        raise ExportError(
            f"the ONNX graph differs from eager by {error:.2e} at {where}, where the traced graph does not hold "
            f"({refused.guard}: a converted layer branches on the token grid's size, and ONNX keeps no guard); "
            "export with a static image size for the size you deploy (--static --img-size HxW), or as .pt2, "
            "which refuses the sizes outside"
        )
    return error


def _not_finite(out: torch.Tensor, expected: torch.Tensor, where: str) -> ExportError:
    """The export's refusal when its check against eager is not a number: which side gave non-finite values."""
    sides = [name for name, t in (("eager", expected), ("the exported model", out)) if not torch.isfinite(t).all()]
    return ExportError(
        f"the check against eager at {where} is not finite: {' and '.join(sides) or 'their difference'} gave NaN "
        "or infinite outputs, so the export cannot be verified; nothing was written (check the weights for NaN)"
    )


def export_folder(
    directory: str | Path,
    path: str | Path,
    *,
    format: str = "pt2",
    dynamic: bool | None = None,
    img_size: int | tuple[int, int] | None = None,
) -> ExportResult:
    """`export_model` on the converted model saved in `directory` (a `save_pretrained` folder)."""
    _check_format(format)  # before loading anything
    model = from_pretrained(directory)
    return export_model(model, path, format=format, dynamic=dynamic, img_size=img_size)
