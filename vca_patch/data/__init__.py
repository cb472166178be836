"""Data sources for calibration, fidelity and recovery recipes."""

from vca_patch.data.build import build_dataset, infer_kind, mixup_fn
from vca_patch.data.errors import DatasetError
from vca_patch.data.fashion_mnist import load_fashion_mnist, read_idx

__all__ = ["DatasetError", "build_dataset", "infer_kind", "load_fashion_mnist", "mixup_fn", "read_idx"]
