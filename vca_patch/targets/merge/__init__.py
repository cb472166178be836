"""Token merging (ToMe, Bolya et al., ICLR 2023) as a surgery target: `MergeConfig`, alone or composed with VCA."""

from vca_patch.targets.merge.attention import MergingAttention
from vca_patch.targets.merge.block import FAMILIES, MergeState, MergingForward, unmerge
from vca_patch.targets.merge.config import MergeConfig
from vca_patch.targets.merge.handler import MergeHandler  # registers merging's handler with its config
from vca_patch.targets.merge.matching import TokenMerge, bipartite_soft_matching
from vca_patch.targets.merge.plan_space import PLAN_SPACE, MergePlanSpace  # registers merging's plan space

__all__ = [
    "FAMILIES",
    "PLAN_SPACE",
    "MergeConfig",
    "MergeHandler",
    "MergePlanSpace",
    "MergeState",
    "MergingAttention",
    "MergingForward",
    "TokenMerge",
    "bipartite_soft_matching",
    "unmerge",
]
