"""DIDB-ViT binarisation target: binary Linears, differential-informative binary attention, improved RPReLU."""

from . import macs  # noqa: F401  (registers the bench MAC count)
from .attention import DIDBAttention, binarize_attention, neighbour_difference
from .binary import BinaryLinear, binarize_activation, binarize_weight, binary_linear
from .config import DIDBConfig
from .haar import haar_split, haar_subbands
from .model import set_binarization
from .packed import PackedBinaryLinear, is_packed, pack_binary, unpack_binary
from .rprelu import ImprovedRPReLU

__all__ = [
    "BinaryLinear",
    "DIDBAttention",
    "DIDBConfig",
    "ImprovedRPReLU",
    "PackedBinaryLinear",
    "binarize_activation",
    "binarize_attention",
    "binarize_weight",
    "binary_linear",
    "haar_split",
    "haar_subbands",
    "is_packed",
    "neighbour_difference",
    "pack_binary",
    "set_binarization",
    "unpack_binary",
]
