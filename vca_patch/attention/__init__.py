"""Attention math, independent of any model library."""

from .differential_lambda import DifferentialLambda, lambda_init_for_depth
from .layout import TokenLayout
from .vca import VisualContrastAttention

__all__ = ["DifferentialLambda", "TokenLayout", "VisualContrastAttention", "lambda_init_for_depth"]
