"""Attention math, independent of any model library."""

from .carried import CarriedAttention
from .differential_lambda import DifferentialLambda, lambda_init_for_depth
from .fused_qkv import QKVWithSeparateBias, SplitQKV
from .layout import TokenLayout
from .mano import MultipoleAttention
from .vca import VisualContrastAttention

__all__ = [
    "CarriedAttention",
    "DifferentialLambda",
    "MultipoleAttention",
    "QKVWithSeparateBias",
    "SplitQKV",
    "TokenLayout",
    "VisualContrastAttention",
    "lambda_init_for_depth",
]
