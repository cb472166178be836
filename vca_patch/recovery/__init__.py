"""Training-free recovery: teacher capture and closed-form calibration of converted models."""

from vca_patch.recovery.calibrate import CalibrationReport, LayerCalibration, calibrate
from vca_patch.recovery.capture import capture_original_layers, original_attention, patched_modules

__all__ = [
    "CalibrationReport",
    "LayerCalibration",
    "calibrate",
    "capture_original_layers",
    "original_attention",
    "patched_modules",
]
