"""LLaVA-SP settings (arXiv 2507.00505) as a JSON-round-tripping dataclass, and the view geometry they imply."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from vca_patch.core.errors import ConfigError

VARIANTS = ("pooling", "cropping")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class SpatialTokensConfig:
    """Which spatial-token module to put in front of a LLaVA projector's output.

    variant: "pooling" (adaptive average pools to k×k, then a k×k conv: abstract → specific) or "cropping"
        (nested centre crops of side k, a k×k conv each, plus a detail path read by single-head cross-attention:
        centre → global).
    num_tokens: spatial tokens added in front of the patch tokens (the paper: 6).
    hidden_dim: width of the conv outputs (the paper: 512 for CLIP ViT-L's 1024); None = projector input // 2.
    sizes: view sides k on the patch grid, ascending, the last one the whole grid; None = round(G·i/num_tokens),
        which is the paper's 4, 8, ..., 24 on CLIP-L/336's 24×24 grid.
    detail_kernel / detail_stride: the cropping variant's detail conv; None = stride max(1, G // 12) and kernel
        G − 4·stride, a 5×5 map of detail tokens (the paper: kernel 16, stride 2 on 24×24).
    seed: seed of the new modules' random initialisation.
    """

    format: ClassVar[str] = "llava-sp"

    variant: str = "pooling"
    num_tokens: int = 6
    hidden_dim: int | None = None
    sizes: list[int] | None = None
    detail_kernel: int | None = None
    detail_stride: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.variant not in VARIANTS:
            raise ConfigError(f"variant must be one of {list(VARIANTS)}, got {self.variant!r}")
        if not _is_int(self.num_tokens) or self.num_tokens < 1:
            raise ConfigError(f"num_tokens must be a positive integer, got {self.num_tokens!r}")
        for name in ("hidden_dim", "detail_kernel", "detail_stride"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ConfigError(f"{name} must be a positive integer or None, got {value!r}")
        if self.sizes is not None:
            if not isinstance(self.sizes, (list, tuple)) or not all(_is_int(s) and s >= 1 for s in self.sizes):
                raise ConfigError(f"sizes must be a list of positive integers or None, got {self.sizes!r}")
            self.sizes = list(self.sizes)
            if len(self.sizes) != self.num_tokens:
                raise ConfigError(f"sizes has {len(self.sizes)} entries but num_tokens is {self.num_tokens}")
            if self.sizes != sorted(self.sizes):
                raise ConfigError(f"sizes must be ascending (small view first), got {self.sizes}")
        if not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    def view_sizes(self, grid: int) -> list[int]:
        """The k of each view on a grid×grid patch map, checked against the grid."""
        sizes = self.sizes or [max(1, round(grid * (i + 1) / self.num_tokens)) for i in range(self.num_tokens)]
        if sizes[-1] > grid:
            raise ConfigError(f"view side {sizes[-1]} exceeds the {grid}×{grid} patch grid")
        return sizes

    def detail_geometry(self, grid: int) -> tuple[int, int]:
        """(kernel, stride) of the cropping variant's detail conv on a grid×grid map, checked."""
        stride = self.detail_stride or max(1, grid // 12)
        kernel = self.detail_kernel or grid - 4 * stride
        if kernel < 1 or kernel > grid:
            raise ConfigError(
                f"detail conv kernel {kernel} does not fit the {grid}×{grid} grid; set detail_kernel/detail_stride"
            )
        return kernel, stride

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpatialTokensConfig:
        data = dict(data)
        fmt = data.pop("format", cls.format)
        if fmt != cls.format:
            raise ConfigError(f"not a {cls.format} config (format {fmt!r})")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown SpatialTokensConfig keys {unknown}; valid keys: {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> SpatialTokensConfig:
        return cls.from_dict(json.loads(text))
