"""DIDB-ViT binarisation target: binary Linears, differential-informative binary attention, improved RPReLU."""

from .attention import DIDBAttention, binarize_attention, neighbour_difference
from .binary import BinaryLinear, binarize_activation, binarize_weight, binary_linear
from .config import DIDBConfig
from .haar import haar_split, haar_subbands
from .model import set_binarization
from .rprelu import ImprovedRPReLU

__all__ = [
    "BinaryLinear",
    "DIDBAttention",
    "DIDBConfig",
    "ImprovedRPReLU",
    "binarize_activation",
    "binarize_attention",
    "binarize_weight",
    "binary_linear",
    "haar_split",
    "haar_subbands",
    "neighbour_difference",
    "set_binarization",
]
