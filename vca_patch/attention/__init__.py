"""Attention math, independent of any model library."""

from .carried import CarriedAttention, CarriedAttentionLayer
from .differential_lambda import DifferentialLambda, lambda_init_for_depth
from .fused_qkv import QKVWithSeparateBias, SplitQKV
from .layout import TokenLayout
from .mano import MultipoleAttention
from .vca import VisualContrastAttention

__all__ = [
    "CarriedAttention",
    "CarriedAttentionLayer",
    "DifferentialLambda",
    "MultipoleAttention",
    "QKVWithSeparateBias",
    "SplitQKV",
    "TokenLayout",
    "VisualContrastAttention",
    "lambda_init_for_depth",
]
