"""`VCAConfig`: what to patch and how, as a dataclass that round-trips through JSON."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar


class ConfigError(ValueError):
    """A configuration value or key is invalid."""


@dataclass
class VCAConfig:
    """Configuration of a Visual-Contrast Attention patch.

    Attributes:
        contrast_tokens: n, the number of pooled contrast tokens; a perfect square (h = w = √n).
        softmax: Stage-II softmax, "joint" (official code) or "separate" (paper text).
        init: "preserve" (carry q/k/v/proj, function-preserving new parameters) or "paper"
            (the paper's from-scratch init of the new parameters).
        layers: 0-based block indices to patch; None patches every attention block.
        rms_eps: epsilon of the two sub-layer RMSNorms.
        seed: seed of the random parts of the init (λ vectors; e± and DWC in "paper" mode).
    """

    target: ClassVar[str] = "vca"

    contrast_tokens: int = 49
    softmax: str = "joint"
    init: str = "preserve"
    layers: list[int] | None = field(default=None)
    rms_eps: float = 1e-5
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    @property
    def contrast_grid(self) -> tuple[int, int]:
        side = math.isqrt(self.contrast_tokens)
        return side, side

    def validate(self) -> None:
        n = self.contrast_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or math.isqrt(n) ** 2 != n:
            raise ConfigError(f"contrast_tokens must be a positive perfect square (4, 16, 49, ...), got {n!r}")
        if self.softmax not in ("joint", "separate"):
            raise ConfigError(f"softmax must be 'joint' or 'separate', got {self.softmax!r}")
        if self.init not in ("preserve", "paper"):
            raise ConfigError(f"init must be 'preserve' or 'paper', got {self.init!r}")
        if self.layers is not None:
            if not isinstance(self.layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers
            ):
                raise ConfigError(f"layers must be a list of non-negative block indices or None, got {self.layers!r}")
            self.layers = sorted(set(self.layers))
        if not isinstance(self.rms_eps, (int, float)) or not self.rms_eps > 0:
            raise ConfigError(f"rms_eps must be a positive number, got {self.rms_eps!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> VCAConfig:
        data = dict(data)
        target = data.pop("target", cls.target)
        if target != cls.target:
            raise ConfigError(f"config is for target {target!r}, not {cls.target!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown VCAConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> VCAConfig:
        return cls.from_dict(json.loads(text))
