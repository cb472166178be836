"""An exported program to an ONNX file (torch.onnx's dynamo exporter), and that file run in onnxruntime.

The program is converted as traced by `torch.export` (no second capture); a few of torch.onnx's translations are
replaced (`translations`), and the written graph is checked to hold only standard ONNX operators."""

from __future__ import annotations

import operator
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from vca_patch.core.install import install_hint
from vca_patch.export.errors import ExportError

INPUT_NAME = "pixel_values"
STANDARD_DOMAINS = ("", "ai.onnx")


def _modules() -> tuple[Any, Any]:
    """(onnx, onnxruntime), with onnxscript (torch's exporter needs it) checked too."""
    try:
        import onnx
        import onnxruntime
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ExportError(f"ONNX export needs {exc.name}: {install_hint('export')}") from None
    return onnx, onnxruntime


def translations() -> dict[Callable[..., Any], Callable[..., Any]]:
    """ONNX translations that replace torch.onnx's own: `//` of symbolic sizes as a floor division.

    torch.onnx writes a size's `a // b` as ONNX integer Div, which truncates toward zero (onnxscript's torch_lib
    implements it "for positive inputs only"). The ceil division `-(-n // b)` (MANO's level grids, the local
    term's query blocks, windowed attention's padding) then rounds down in onnxruntime at every size that is not a
    multiple of b: reshapes fail, or windows are read wrong."""
    from onnxscript import opset18 as op

    def floordiv(a: Any, b: Any) -> Any:
        return op.Div(op.Sub(a, op.Mod(a, b)), b)  # Mod (fmod=0) takes the divisor's sign: a - a mod b is exact

    return {operator.floordiv: floordiv}


def nonstandard_ops(model: Any) -> list[str]:
    """`domain::op_type` of every node of an onnx ModelProto that is no standard ONNX operator (a custom op, a
    vca_patch kernel, an onnxruntime contrib op), sorted."""
    import onnx

    found = set()
    for node in model.graph.node:
        if node.domain not in STANDARD_DOMAINS or not onnx.defs.has(node.op_type):
            found.add(f"{node.domain or 'ai.onnx'}::{node.op_type}")
    return sorted(found)


def write_onnx(
    program: torch.export.ExportedProgram,
    example: torch.Tensor,
    path: Path,
    opset: int | None = None,
    *,
    optimize: bool = True,
) -> None:
    """Convert `program` (traced on `example`) and write it to `path` as one self-contained file; `optimize`: run
    onnxscript's graph optimiser on it."""
    onnx, _ = _modules()
    kwargs = {} if opset is None else {"opset_version": opset}
    onnx_program = torch.onnx.export(
        program, (example,), dynamo=True, input_names=[INPUT_NAME], output_names=["output"], verbose=False,
        custom_translation_table=translations(), optimize=optimize, **kwargs,
    )  # fmt: skip
    leaked = nonstandard_ops(onnx_program.model_proto)
    if leaked:
        raise ExportError(f"non-standard operators in the ONNX graph: {', '.join(leaked)}")
    onnx_program.save(str(path), external_data=False)
    onnx.checker.check_model(str(path))


def onnx_runner(path: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """images -> output by onnxruntime's CPU provider on the ONNX file at `path` (float32 inputs)."""
    _, onnxruntime = _modules()
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4  # its errors come back as exceptions; no log lines on stderr
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name

    def run(images: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(session.run(None, {name: images.float().cpu().numpy()})[0])

    return run
