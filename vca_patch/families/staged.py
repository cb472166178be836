"""What the hierarchical-model adapters (Swin, PVT; timm and transformers) share: sites grouped by stage, whose
replacements take their grid (and windows) from their block's call, and how each library's bases are rebuilt."""

from __future__ import annotations

from typing import Any, NamedTuple

from torch import nn

from vca_patch.families.base import AttentionSite, ModelAdapter, attention_dropout_note


class StageFacts(NamedTuple):
    """What a staged site's carry needs: its stage, the report's settings and the stage's token grid (H, W)."""

    stage: int
    settings: dict[str, Any]
    grid: tuple[int, int] | None


class StagedAdapter(ModelAdapter):
    """An adapter of a model in stages: each site's stage and report settings are kept for its carry, and its
    replacement needs its block's call (grid, windows), so it never runs alone."""

    layers_run_alone = False  # grid/windows come from block hooks

    def __init__(self) -> None:
        self._stages: dict[str, StageFacts] = {}  # site path -> its stage, report settings and grid

    def staged_site(
        self,
        path: str,
        attn: nn.Module,
        index: int,
        dim: int,
        num_heads: int,
        stage: int,
        settings: dict[str, Any],
        grid: tuple[int, int] | None = None,
    ) -> AttentionSite:
        """The site of `attn` (noting attention dropout, which VCA drops), its stage, report settings and token grid
        (H, W) at the model's input size kept for its carry."""
        self._stages[path] = StageFacts(stage, settings, None if grid is None else (int(grid[0]), int(grid[1])))
        notes = list(filter(None, [attention_dropout_note(attn)]))
        return AttentionSite(path, attn, index, dim, num_heads, notes)
