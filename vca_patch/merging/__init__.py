"""Token merging (ToMe, Bolya et al., ICLR 2023) as a surgery target: `MergeConfig`, alone or composed with VCA."""

from .attention import MergingAttention
from .block import FAMILIES, MergeState, MergingForward, unmerge
from .config import MergeConfig
from .matching import TokenMerge, bipartite_soft_matching

__all__ = [
    "FAMILIES",
    "MergeConfig",
    "MergeState",
    "MergingAttention",
    "MergingForward",
    "TokenMerge",
    "bipartite_soft_matching",
    "unmerge",
]
