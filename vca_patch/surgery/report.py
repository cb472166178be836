"""What a patch did: sites converted, sites left alone and why, parameters before and after."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from vca_patch.families import SkippedSite
from vca_patch.layers.layout import TokenLayout
from vca_patch.targets import DEFAULT_TARGET
from vca_patch.targets.base import target_display_name


def settings_items(settings: dict[str, Any]) -> list[str]:
    """{"contrast_tokens": 49, "grid": "window 7x7 + global 56x56"} -> ["contrast_tokens=49",
    "grid=window 7x7 + global 56x56"]: one "key=value" per setting (a value may hold spaces)."""
    return [f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in settings.items()]


def settings_text(settings: dict[str, Any]) -> str:
    """{"contrast_tokens": 49, "lambda_init": 0.2} -> "contrast_tokens=49 lambda_init=0.200"."""
    return " ".join(settings_items(settings))


def target_name(target: str) -> str:
    """`"mano"` -> `"MANO"`: the display name of a registered target (its config class's `display_name` hook; the
    upper-cased key when it has none or is not registered)."""
    return target_display_name(target)


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
    target: str = DEFAULT_TARGET  # the TargetConfig.target the sites were (or would be) converted to

    @property
    def params_added(self) -> int:
        return self.params_after - self.params_before

    def to_dict(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "target": self.target,
            "patched": [asdict(s) for s in self.patched],
            "skipped": [asdict(s) for s in self.skipped],
            "params_before": self.params_before,
            "params_after": self.params_after,
            "layout": asdict(self.layout) if self.layout else None,
        }

    def __str__(self) -> str:
        lines = [
            f"{target_name(self.target)} patch ({self.adapter}): {len(self.patched)} attention modules patched, "
            f"{len(self.skipped)} skipped; parameters {self.params_before:,} -> {self.params_after:,} "
            f"(+{self.params_added:,})"
        ]
        lines += [f"  patched {s.path} (block {s.layer_index}, {settings_text(s.settings)})" for s in self.patched]
        lines += [f"  skipped {s.path} [{s.class_name}]: {s.reason}" for s in self.skipped]
        return "\n".join(lines)
