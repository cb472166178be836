"""DIDB-ViT binarisation target: binary Linears, differential-informative binary attention, improved RPReLU."""

from vca_patch.targets.didb import macs  # noqa: F401  (registers the bench MAC count)
from vca_patch.targets.didb.attention import DIDBAttention, binarize_attention, neighbour_difference
from vca_patch.targets.didb.binary import BinaryLinear, binarize_activation, binarize_weight, binary_linear
from vca_patch.targets.didb.config import DIDBConfig
from vca_patch.targets.didb.haar import haar_split, haar_subbands
from vca_patch.targets.didb.handler import DIDBHandler  # registers DIDB's handler with its config
from vca_patch.targets.didb.model import set_binarization
from vca_patch.targets.didb.packed import PackedBinaryLinear, is_packed, pack_binary, unpack_binary
from vca_patch.targets.didb.rprelu import ImprovedRPReLU

__all__ = [
    "BinaryLinear",
    "DIDBAttention",
    "DIDBConfig",
    "DIDBHandler",
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
