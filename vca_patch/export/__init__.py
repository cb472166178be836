"""Export a converted model: `torch.export` (.pt2) or ONNX, with a dynamic batch and image size where the original
takes any size, written atomically and checked against eager."""

from vca_patch.export.api import FORMATS, ExportError, ExportResult, export_folder, export_model, takes_any_size

__all__ = ["FORMATS", "ExportError", "ExportResult", "export_folder", "export_model", "takes_any_size"]
