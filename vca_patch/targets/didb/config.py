"""`DIDBConfig`: the DIDB-ViT binarisation target (`target = "didb"`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.layers.carried import CarriedAttention
from vca_patch.targets.base import TargetConfig, register_target
from vca_patch.targets.didb.attention import DIDBAttention
from vca_patch.targets.didb.binary import BinaryLinear
from vca_patch.targets.didb.block import find_mlp
from vca_patch.targets.didb.model import set_binarization
from vca_patch.targets.didb.packed import is_packed, load_packed, pack_binary, packed_state_dict
from vca_patch.targets.didb.rprelu import ImprovedRPReLU

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

    def build_layer(self, carried: CarriedAttention, layer_index: int) -> DIDBAttention:
        return DIDBAttention.from_carried(
            carried,
            binary=tuple(name for name in ("qkv", "proj") if name in self.binarize),
            binarize_weights=self.weights,
            binarize_activations=self.activations,
            binarize_attention=self.binary_attention,
            hfsc=self.hfsc,
            local=self.local,
            normalize=self.normalize,
            act_clip_init=self.act_clip_init,
            band_init=tuple(self.band_init),
            threshold_init=self.threshold_init,
            local_init=self.local_init,
        )

    def block_edits(self, block: nn.Module, attention_name: str, layer_index: int) -> dict[str, nn.Module]:
        """BinaryLinear for the binarised fc1/fc2, ImprovedRPReLU for the MLP activation."""
        wanted = [name for name in ("fc1", "fc2") if name in self.binarize]
        if not wanted and not self.rprelu:
            return {}
        mlp = find_mlp(block, attention_name)
        edits: dict[str, nn.Module] = {}
        for role in wanted:
            path = getattr(mlp, role)
            edits[path] = BinaryLinear.from_linear(
                block.get_submodule(path),
                binarize_weights=self.weights,
                binarize_activations=self.activations,
                act_clip_init=self.act_clip_init,
            )
        if self.rprelu:
            if mlp.act is None:
                raise ValueError(
                    f"the MLP activation of {type(block).__name__} is not a module (or not one module): set "
                    "DIDBConfig(rprelu=False)"
                )
            fc1 = block.get_submodule(mlp.fc1)
            dd = {"device": fc1.weight.device, "dtype": fc1.weight.dtype}
            edits[mlp.act] = ImprovedRPReLU(fc1.out_features, slope_init=self.rprelu_slope_init, **dd)
        return edits

    def check_stage_state(self, state: dict[str, Any]) -> None:
        """A stage's target_state may set `weights` and/or `activations` (true/false)."""
        unknown = sorted(set(state) - set(STAGE_KEYS))
        if unknown:
            raise ConfigError(
                f"target 'didb': unknown target_state key {unknown[0]!r}; valid keys: {list(STAGE_KEYS)} "
                "(binarise the Linears' weights / activations)"
            )
        for key, value in state.items():
            if not isinstance(value, bool):
                raise ConfigError(f"target 'didb': target_state.{key} must be true or false, got {value!r}")

    def apply_stage_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Switch weight / activation binarisation (`set_binarization`) of `model` for a recipe stage."""
        self.check_stage_state(state)
        if state:
            set_binarization(model, **state)

    # The packed checkpoint form (io/checkpoint.py `save_pretrained(..., packed=True)`): didb/packed.py.

    def pack(self, model: nn.Module) -> nn.Module:
        """Hold `model`'s binarised Linears packed, in place (`vca_patch.targets.didb.pack_binary`); PatchError without
        binarised weights."""
        return pack_binary(model)

    def is_packed(self, model: nn.Module) -> bool:
        """Whether `model` holds its binarised Linears as packed bits (it then saves packed only)."""
        return is_packed(model)

    def packed_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """`model`'s state dict with the binarised Linears as sign bits + scales (the model is not changed)."""
        return packed_state_dict(model)

    def load_packed(self, model: nn.Module, state_dict: dict[str, Any], source: str) -> None:
        """Put a freshly built model into the packed form of `state_dict` (ValueError when it does not fit)."""
        load_packed(model, state_dict, source)

    def layer_settings(self, layer: DIDBAttention) -> dict[str, Any]:
        return {
            "binarize": list(self.binarize),
            "binary_attention": layer.binarize_attention,
            "hfsc": layer.hfsc,
            "local": layer.local,
            "rprelu": self.rprelu,
        }
