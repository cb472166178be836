"""`MANOConfig`: the Multipole Attention target (`target = "mano"`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from vca_patch.core.errors import ConfigError
from vca_patch.targets.base import TargetConfig, is_int, register_target
from vca_patch.targets.mano import card


@register_target
@dataclass
class MANOConfig(TargetConfig):
    """Configuration of a Multipole Attention (MANO) patch (docs/mano.md).

    Attributes:
        window: window side k of the per-level windowed attention (clipped to smaller grids; a window
            covering the patch grid reproduces the original attention exactly). Swin/SwinV2: not used, every
            level takes the block's own window (level 0 is the block's window attention, exact at init).
        rate: coarsening factor r ≥ 2 between levels.
        levels: number of levels L; None picks, per input grid, the fewest whose coarsest grid fits
            one window.
        down: "conv" (shared strided conv, C²r² parameters) or "avg" (average pooling, none).
        up: "conv" (shared transposed conv, C²r² parameters) or "nearest" (nearest upsampling with a
            learnable per-channel gain, C parameters).
        init: "preserve" (up = 0 / gain = 0: the layer starts as windowed attention at the finest
            level), "multipole" (average/nearest-equivalent kernels: the full V-cycle) or "random".
        prefix: "global" (prefix keys join every level-0 window; prefix queries attend to all
            tokens) or "separate" (grid queries never see prefix keys).
        pad: pad levels that the window/rate do not divide (masked in the softmax); False raises.
        layers: 0-based block indices to patch; None patches every attention block.
        seed: seed of the random parts of the init ("random" mode).
    """

    target: ClassVar[str] = "mano"
    display_name: ClassVar[str] = card.DISPLAY_NAME
    tags: ClassVar[tuple[str, ...]] = card.TAGS
    citation: ClassVar[str] = card.CITATION

    window: int = field(default=7, metadata={"cli": "--window", "help": "Window side k"})
    rate: int = field(default=2, metadata={"cli": "--rate", "help": "Coarsening rate r between levels"})
    levels: int | None = field(
        default=None, metadata={"cli": "--levels", "help": "Number of levels (default: auto per grid)"}
    )
    down: str = field(default="conv", metadata={"cli": "--down", "help": "conv or avg"})
    up: str = field(default="conv", metadata={"cli": "--up", "help": "conv or nearest"})
    init: str = field(default="preserve", metadata={"cli": "--init", "help": "preserve, multipole or random"})
    prefix: str = field(default="global", metadata={"cli": "--prefix", "help": "Prefix tokens global or separate"})
    pad: bool = True

    def validate(self) -> None:
        super().validate()
        if not is_int(self.window) or self.window < 1:
            raise ConfigError(f"window must be a positive integer, got {self.window!r}")
        if not is_int(self.rate) or self.rate < 2:
            raise ConfigError(f"rate must be an integer ≥ 2, got {self.rate!r}")
        if self.levels is not None and (not is_int(self.levels) or self.levels < 1):
            raise ConfigError(f"levels must be a positive integer or None (auto), got {self.levels!r}")
        choices = {
            "down": ("conv", "avg"),
            "up": ("conv", "nearest"),
            "init": ("preserve", "multipole", "random"),
            "prefix": ("global", "separate"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {getattr(self, name)!r}")
        if not isinstance(self.pad, bool):
            raise ConfigError(f"pad must be true or false, got {self.pad!r}")
