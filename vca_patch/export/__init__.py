"""Export a converted model: `torch.export` (.pt2) or ONNX, with a dynamic batch and image size where the original
takes any size, written atomically and checked against eager."""

from vca_patch.export.api import FORMATS, ExportResult, export_folder, export_model, takes_any_size
from vca_patch.export.errors import ExportError, FixedSizeError

__all__ = [
    "FORMATS",
    "ExportError",
    "ExportResult",
    "FixedSizeError",
    "export_folder",
    "export_model",
    "takes_any_size",
]
