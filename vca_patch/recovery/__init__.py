"""Training-free recovery: teacher capture and closed-form calibration of converted models."""

from vca_patch.recovery.calibrate import (
    CalibrationOptions,
    CalibrationReport,
    LayerCalibration,
    calibrate,
    run_calibration,
)
from vca_patch.recovery.capture import capture_original_layers, original_attention, patched_modules

__all__ = [
    "CalibrationOptions",
    "CalibrationReport",
    "LayerCalibration",
    "calibrate",
    "capture_original_layers",
    "original_attention",
    "patched_modules",
    "run_calibration",
]
