"""Token merging's plan space: what the latency-budget planner (planner/) searches and the configs it builds.

A plan is a `MergeConfig`: r tokens merged after each block from some block on, and before that block each block
softmax, VCA(n) or MANO(k) (merging's declared composition with VCA and MANO). This module declares those choices
(`VCA_BLOCKS`, `MANO_BLOCKS`), how merging shrinks the token count, and every config the planner times, measures
and saves; the VCA and MANO configs and MAC counts are reached through the target and MAC registries by name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.layers.macs import attention_macs
from vca_patch.targets.base import CONFIG_TYPES, BlockKind, PlanSpace, TargetConfig, register_plan_space
from vca_patch.targets.merge.config import UNMERGE_MODES, MergeConfig


class VCABlocks(BlockKind):
    """VCA(n) in a block: n contrast tokens, calibrated with the plan's images (with the per-token gain then),
    and the plan's local term."""

    name, label, symbol, shrinks = "vca", "VCA", "n", True

    def config(
        self, value: int, layers: list[int] | None, *, calibrate: bool | None, local_window: int
    ) -> TargetConfig:
        gain = {} if calibrate is None else {"token_magnitude": calibrate}
        return CONFIG_TYPES["vca"](contrast_tokens=value, layers=layers, local_window=local_window, **gain)

    def macs(self, shape: Any, value: int, *, local_window: int) -> float:
        """VCA's count with the exact prefix read-out (its default) and the local term."""
        return attention_macs("vca", shape, CONFIG_TYPES["vca"](contrast_tokens=value, local_window=local_window))


class MANOBlocks(BlockKind):
    """MANO(k) in a block: window k, its preserving init (training-free)."""

    name, label, symbol = "mano", "MANO", "k"

    def config(
        self, value: int, layers: list[int] | None, *, calibrate: bool | None, local_window: int
    ) -> TargetConfig:
        return CONFIG_TYPES["mano"](window=value, layers=layers)

    def macs(self, shape: Any, value: int, *, local_window: int) -> float:
        """Training-free MANO: its coarse levels vanish (U = 0), so it computes what a one-level MANO does."""
        return attention_macs("mano", shape, CONFIG_TYPES["mano"](window=value, levels=1))


VCA_BLOCKS, MANO_BLOCKS = VCABlocks(), MANOBlocks()


class MergePlanSpace(PlanSpace):
    """Merge schedules (ToMe's r per block from block j on) with VCA or MANO blocks before the first merge."""

    target = MergeConfig.target
    kinds = (VCA_BLOCKS, MANO_BLOCKS)
    unmerge_modes = UNMERGE_MODES

    def check_settings(self, *, local_window: int) -> None:
        try:
            VCA_BLOCKS.config(4, None, calibrate=None, local_window=local_window)
        except ConfigError:
            raise ConfigError(
                f"local_window must be 0 (none) or an odd window side (3, 5, 7, ...), got {local_window!r}"
            ) from None

    def survey_config(self) -> MergeConfig:
        return MergeConfig(r=0)

    def tokens_removed(self, tokens: int, prefix: int, r: int) -> int:
        """Bipartite matching pairs the patch tokens in two halves: one merge takes at most the A half."""
        patches = tokens - prefix
        limit = (patches + 1) // 2 if patches >= 2 else 0
        return max(0, min(r, limit))

    def schedule_config(self, schedule: list[int], *, unmerge: str) -> MergeConfig:
        return MergeConfig(schedule=list(schedule), unmerge=unmerge)

    def mark_timed_block(self, block: nn.Module) -> None:
        """A block timed alone is also the model's last: with a residual unmerge it undoes every merge once."""
        block.forward.last = True

    def plan_config(
        self,
        schedule: list[int],
        blocks: dict[str, dict[int, int]],
        *,
        calibrate: bool,
        local_window: int,
        expect: dict[str, int],
        unmerge: str,
    ) -> MergeConfig:
        """The plan; its VCA blocks get the per-token gain when calibrated, and the local term."""
        vca, mano = dict(blocks.get("vca") or {}), dict(blocks.get("mano") or {})
        options: dict[str, Any] = {"token_magnitude": True} if calibrate and vca else {}
        if vca and local_window:
            options["local_window"] = local_window
        return MergeConfig(
            schedule=list(schedule), vca_layers=vca or None, mano_layers=mano or None, vca=options, expect=expect,
            unmerge=unmerge,
        )  # fmt: skip

    def plan_sizes(self, config: TargetConfig, depth: int | None) -> tuple[int, int]:
        """(tokens merged in all, the largest VCA contrast-token count); `r` counts once per block of a
        `depth`-block model when the plan gives no schedule."""
        merged = sum(config.schedule) if config.schedule is not None else config.r * (depth or 0)
        return merged, max((config.vca_layers or {}).values(), default=0)


PLAN_SPACE = register_plan_space(MergePlanSpace())
