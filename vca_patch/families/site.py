"""What surgery finds in a model: a convertible attention site, or a module skipped with why."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class AttentionSite:
    """A self-attention module that can be converted."""

    path: str
    module: nn.Module
    layer_index: int
    dim: int
    num_heads: int
    notes: list[str] = field(default_factory=list)  # what the conversion drops or changes
    verified: bool | None = None  # a reference softmax attention reproduced the module (None: not checked)

    @property
    def class_name(self) -> str:
        return type(self.module).__name__


@dataclass
class SkippedSite:
    """An attention-like module left untouched, and why."""

    path: str
    class_name: str
    reason: str
