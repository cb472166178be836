"""What a patch did: sites converted, sites left alone and why, parameters before and after."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..adapters import SkippedSite
from ..attention import TokenLayout


def settings_text(settings: dict[str, Any]) -> str:
    """{"contrast_tokens": 49, "lambda_init": 0.2} -> "contrast_tokens=49 lambda_init=0.200"."""
    return " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in settings.items())


@dataclass
class PatchedSite:
    path: str
    original_class: str
    layer_index: int
    dim: int
    num_heads: int
    settings: dict[str, Any]  # the target's per-layer settings (JSON-safe), e.g. contrast tokens
    params_added: int
    notes: list[str] = field(default_factory=list)
    verified: bool | None = None  # a reference softmax attention reproduced the original module

    @property
    def exact_carry_over(self) -> bool:
        """True when everything the original module computes was carried over (nothing dropped)."""
        return not self.notes


@dataclass
class PatchReport:
    adapter: str
    patched: list[PatchedSite]
    skipped: list[SkippedSite]
    params_before: int
    params_after: int
    layout: TokenLayout | None = None  # prefix tokens and grid at the native input size

    @property
    def params_added(self) -> int:
        return self.params_after - self.params_before

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "patched": [asdict(s) for s in self.patched],
            "skipped": [asdict(s) for s in self.skipped],
            "params_before": self.params_before,
            "params_after": self.params_after,
            "layout": asdict(self.layout) if self.layout else None,
        }

    def __str__(self) -> str:
        lines = [
            f"VCA patch ({self.adapter}): {len(self.patched)} attention modules patched, "
            f"{len(self.skipped)} skipped; parameters {self.params_before:,} -> {self.params_after:,} "
            f"(+{self.params_added:,})"
        ]
        lines += [f"  patched {s.path} (block {s.layer_index}, {settings_text(s.settings)})" for s in self.patched]
        lines += [f"  skipped {s.path} [{s.class_name}]: {s.reason}" for s in self.skipped]
        return "\n".join(lines)
