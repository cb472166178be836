"""`DIDBConfig`: the DIDB-ViT binarisation target (`target = "didb"`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vca_patch.core.errors import ConfigError
from vca_patch.targets.base import TargetConfig, register_target

LINEARS = ("qkv", "proj", "fc1", "fc2")
STAGE_KEYS = ("weights", "activations")  # what a recipe stage's target_state may switch (set_binarization)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@register_target
@dataclass
class DIDBConfig(TargetConfig):
    """Configuration of a DIDB-ViT binarisation patch (arXiv 2507.02222; README "DIDB-ViT").

    Every attention site becomes a `DIDBAttention`; its block's MLP Linears become `BinaryLinear`s and the MLP
    activation an `ImprovedRPReLU`. Patch embedding, norms and head stay full precision.

    Attributes:
        binarize: which block Linears are binarised, any of "qkv", "proj", "fc1", "fc2".
        weights: binarise their weights (α ⊙ sign W); False for the first training stage.
        activations: binarise their inputs (c·sign x).
        binary_attention: {0, 1} attention weights (the DIBA update); False keeps the softmax weights.
        hfsc: similarity from the undecimated-Haar low/high bands with learnable per-head band weights.
        local: the 8-neighbour differential term on the patch grid.
        normalize: divide the DIBA update by max(k_i, 1) (the next sign(·) sees the paper's update unchanged).
        rprelu: replace the MLP activation by the improved RPReLU.
        act_clip_init: initial activation clip c; band_init: (α_L, α_H); threshold_init: τ (2: A_ij ≥ 1/N
            selects); local_init: γ; rprelu_slope_init: β.
    """

    citation: ClassVar[str] = """@article{didbvit2025,
  title   = {High-Fidelity Differential-information Driven Binary Vision Transformer},
  journal = {arXiv preprint arXiv:2507.02222},
  year    = {2025}
}"""

    target: ClassVar[str] = "didb"
    display_name: ClassVar[str] = "DIDB"

    binarize: list[str] = field(default_factory=lambda: list(LINEARS))
    weights: bool = True
    activations: bool = True
    binary_attention: bool = True
    hfsc: bool = True
    local: bool = True
    normalize: bool = True
    rprelu: bool = True
    act_clip_init: float = 1.0
    band_init: list[float] = field(default_factory=lambda: [1.0, 1.0])
    threshold_init: float = 2.0
    local_init: float = 1.0
    rprelu_slope_init: float = 0.25

    def validate(self) -> None:
        super().validate()
        if not isinstance(self.binarize, (list, tuple)) or any(name not in LINEARS for name in self.binarize):
            raise ConfigError(f"binarize must list Linears among {list(LINEARS)}, got {self.binarize!r}")
        self.binarize = [name for name in LINEARS if name in self.binarize]
        for name in ("weights", "activations", "binary_attention", "hfsc", "local", "normalize", "rprelu"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("act_clip_init", "threshold_init"):
            if not _number(getattr(self, name)) or not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        for name in ("local_init", "rprelu_slope_init"):
            if not _number(getattr(self, name)):
                raise ConfigError(f"{name} must be a number, got {getattr(self, name)!r}")
        band = self.band_init
        if not isinstance(band, (list, tuple)) or len(band) != 2 or not all(_number(b) for b in band):
            raise ConfigError(f"band_init must be two numbers (low, high), got {band!r}")
        self.band_init = [float(b) for b in band]
