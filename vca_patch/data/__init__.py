"""Data sources for calibration, fidelity and recovery recipes."""

from .build import build_dataset, mixup_fn
from .errors import DatasetError
from .fashion_mnist import load_fashion_mnist, read_idx

__all__ = ["DatasetError", "build_dataset", "load_fashion_mnist", "mixup_fn", "read_idx"]
