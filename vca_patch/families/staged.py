"""What the hierarchical-model adapters (Swin, PVT; timm and transformers) share: sites grouped by stage, whose
replacements take their grid (and windows) from their block's call, and how each library's bases are rebuilt."""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.families.base import AttentionSite, ModelAdapter, attention_dropout_note


class StagedAdapter(ModelAdapter):
    """An adapter of a model in stages: each site's stage and report settings are kept for its carry, and its
    replacement needs its block's call (grid, windows), so it never runs alone."""

    layers_run_alone = False  # grid/windows come from block hooks

    def __init__(self) -> None:
        self._stages: dict[str, tuple[int, dict[str, Any]]] = {}  # site path -> (stage, report settings)

    def staged_site(
        self, path: str, attn: nn.Module, index: int, dim: int, num_heads: int, stage: int, settings: dict[str, Any]
    ) -> AttentionSite:
        """The site of `attn` (noting attention dropout, which VCA drops), its stage and report settings kept."""
        self._stages[path] = (stage, settings)
        notes = list(filter(None, [attention_dropout_note(attn)]))
        return AttentionSite(path, attn, index, dim, num_heads, notes)
