"""`MergeConfig`: token merging (ToMe) as a target, alone or after VCA / MANO in the blocks before the first merge."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from vca_patch.core.errors import ConfigError
from vca_patch.core.sizes import check_contrast_tokens
from vca_patch.layers.carried import CarriedAttention
from vca_patch.targets.base import RecipeOptions, TargetConfig, register_target
from vca_patch.targets.mano.config import MANOConfig
from vca_patch.targets.vca.config import VCAConfig

# VCAConfig options a merge config passes to its VCA layers (contrast tokens are per layer, in vca_layers).
_VCA_OPTIONS = {
    "softmax", "init", "rms_eps", "prefix_readout", "stage2_temperature", "token_magnitude", "local_window",
}  # fmt: skip
# MANOConfig options a merge config passes to its MANO layers (the window is per layer, in mano_layers).
_MANO_OPTIONS = {"rate", "levels", "down", "up", "init", "prefix", "pad"}
_EXPECT_KEYS = ("depth", "dim", "num_heads")
UNMERGE_MODES = ("copy", "residual")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_keys(name: str, mapping: Any) -> dict[int, int]:
    """{block: non-negative int}, accepting JSON's string keys."""
    if not isinstance(mapping, dict):
        raise ConfigError(f"{name} must map block index -> integer, got {mapping!r}")
    out = {}
    for key, value in mapping.items():
        try:
            index = int(key)
        except (TypeError, ValueError):
            raise ConfigError(f"{name} key {key!r} is not a block index") from None
        if index < 0 or not _is_int(value) or value < 0:
            raise ConfigError(f"{name}[{key}] must be a non-negative integer for a non-negative block, got {value!r}")
        out[index] = value
    return out


@register_target
@dataclass
class MergeConfig(TargetConfig):
    """Token merging (ToMe, Bolya et al., ICLR 2023): bipartite soft matching between attention and MLP.

    Every block's attention becomes softmax attention with proportional attention (log token size added to the
    logits) and `r` tokens merge after it (size-weighted averages; prefix tokens never merge); the last block gives
    merged tokens back to their patches (`unmerge`), so the output keeps all N tokens. LayerScale (timm `ls1`/`ls2`,
    DINOv2 `layer_scale1/2`) is kept. Supported blocks: timm `VisionTransformer` blocks, transformers `Dinov2Layer`.

    Attributes:
        r: tokens merged in each block (clipped to half the patch tokens left).
        schedule: per-block r, [r of block 0, r of block 1, ...]; overrides `r`; blocks past its end merge none.
        vca_layers: {block: contrast tokens n}: these blocks get VCA instead (see `vca`). VCA needs the patch grid,
            so every VCA block must come before the first block that merges (r > 0); anything else is refused.
        vca: VCAConfig options for those blocks (softmax, init, rms_eps, prefix_readout, stage2_temperature,
            token_magnitude, local_window).
        mano_layers: {block: window k}: these blocks get Multipole Attention (MANO) instead (see `mano`); like VCA,
            only before the first block that merges, and never a block that is in vca_layers too.
        mano: MANOConfig options for those blocks (rate, levels, down, up, init, prefix, pad).
        expect: {"depth", "dim", "num_heads"} of the model a plan was made for; patching another model is refused.
        unmerge: how the output's patch tokens come back: "copy" (ToMe's, the default: the merged token as is) or
            "residual" (the merged token plus what merging took from each patch, so merged patches differ again:
            better dense outputs at the same r, for a little more time: `vca-patch plan --unmerge residual`). A CLS
            or other prefix read-out is the same either way.
    """

    target: ClassVar[str] = "merge"
    # Declared composition: the VCA blocks calibrate and train as VCA's, so VCA's calibration and recipe keys apply.
    calibration_options: ClassVar[type | None] = VCAConfig.calibration_options
    recipe_options: ClassVar[RecipeOptions] = VCAConfig.recipe_options

    r: int = 8
    schedule: list[int] | None = None
    vca_layers: dict[int, int] | None = None
    vca: dict[str, Any] = field(default_factory=dict)
    mano_layers: dict[int, int] | None = None
    mano: dict[str, Any] = field(default_factory=dict)
    expect: dict[str, int] | None = None
    unmerge: str = "copy"

    def validate(self) -> None:
        super().validate()
        if self.unmerge not in UNMERGE_MODES:
            raise ConfigError(f"unmerge must be one of {list(UNMERGE_MODES)}, got {self.unmerge!r}")
        if not _is_int(self.r) or self.r < 0:
            raise ConfigError(f"r must be a non-negative integer (tokens merged per block), got {self.r!r}")
        if self.schedule is not None:
            if not isinstance(self.schedule, (list, tuple)) or not all(_is_int(v) and v >= 0 for v in self.schedule):
                raise ConfigError(
                    f"schedule must be a list of non-negative integers (r per block), got {self.schedule!r}"
                )
            self.schedule = list(self.schedule)
        if self.vca_layers is not None:
            layers = _int_keys("vca_layers", self.vca_layers)
            for n in layers.values():
                VCAConfig(contrast_tokens=n)  # a perfect square, or its error
            self.vca_layers = dict(sorted(layers.items())) or None
        if not isinstance(self.vca, dict) or set(self.vca) - _VCA_OPTIONS:
            bad = sorted(set(self.vca) - _VCA_OPTIONS) if isinstance(self.vca, dict) else self.vca
            raise ConfigError(f"vca takes VCAConfig options {sorted(_VCA_OPTIONS)}; got {bad!r}")
        VCAConfig(**self.vca)  # the options' own checks
        if self.mano_layers is not None:
            layers = _int_keys("mano_layers", self.mano_layers)
            for block, k in layers.items():
                if k < 1:
                    raise ConfigError(f"mano_layers[{block}] must be a positive window side k, got {k!r}")
            self.mano_layers = dict(sorted(layers.items())) or None
        if not isinstance(self.mano, dict) or set(self.mano) - _MANO_OPTIONS:
            bad = sorted(set(self.mano) - _MANO_OPTIONS) if isinstance(self.mano, dict) else self.mano
            raise ConfigError(f"mano takes MANOConfig options {sorted(_MANO_OPTIONS)}; got {bad!r}")
        MANOConfig(**self.mano)
        both = sorted(set(self.vca_layers or {}) & set(self.mano_layers or {}))
        if both:
            raise ConfigError(
                f"blocks {both} are in both vca_layers and mano_layers; a block gets one attention: take each out "
                "of one of them"
            )
        if self.expect is not None and (
            not isinstance(self.expect, dict) or sorted(self.expect) != sorted(_EXPECT_KEYS)
        ):
            raise ConfigError(f"expect must give {list(_EXPECT_KEYS)}, got {self.expect!r}")
        first = self.first_merge()
        for name, kind, layers in (("vca_layers", "VCA", self.vca_layers), ("mano_layers", "MANO", self.mano_layers)):
            late = [i for i in sorted(layers or {}) if first is not None and i >= first]
            if late:
                raise ConfigError(
                    f"{kind} needs the patch grid, which merging destroys: {kind} blocks must all come before the "
                    f"first block that merges (block {first}), but {name} asks for blocks {late}. Set their r (and "
                    f"that of every earlier block) to 0 in `schedule`, or take them out of {name}"
                )

    def fit_grid(self, grid: tuple[int, int]) -> tuple[MergeConfig, list[str]]:
        """VCA blocks pool at most the grid's patches (VCA's rule, `check_contrast_tokens`); nothing is fitted."""
        if min(grid) < 1:  # no whole patch: the size checks refuse the image size itself
            return self, []
        for n in (self.vca_layers or {}).values():
            check_contrast_tokens(n, grid, "vca_layers")
        return self, []

    def r_for(self, layer_index: int) -> int:
        """Tokens merged after block `layer_index`'s attention."""
        if self.schedule is not None:
            return self.schedule[layer_index] if layer_index < len(self.schedule) else 0
        return self.r

    def first_merge(self) -> int | None:
        """The first block that merges, or None (when `schedule` merges nowhere)."""
        if self.schedule is None:
            return 0 if self.r > 0 else None
        return next((i for i, r in enumerate(self.schedule) if r > 0), None)

    def vca_config(self) -> VCAConfig:
        """The config of the VCA blocks (`vca_layers`, with the `vca` options)."""
        return VCAConfig(**self.vca, layer_contrast_tokens=self.vca_layers, seed=self.seed)

    def mano_config(self, window: int) -> MANOConfig:
        """The config of a MANO block with window `window` (the `mano` options)."""
        return MANOConfig(**self.mano, window=window, seed=self.seed)

    def grid_layers(self) -> dict[int, int]:
        """{block: n or k} of the blocks that run on the patch grid (VCA and MANO) instead of merging."""
        return {**(self.vca_layers or {}), **(self.mano_layers or {})}

    def check_model(self, depth: int | None, carried: CarriedAttention | None) -> None:
        """Refuse a model whose depth or (through `carried`) width and heads differ from `expect`, the model the
        plan was made for."""
        if self.expect is None:
            return
        found = {}
        if depth is not None:
            found["depth"] = depth
        if carried is not None:
            found |= {"dim": carried.dim, "num_heads": carried.num_heads}
        wrong = {k: v for k, v in found.items() if self.expect[k] != v}
        if wrong:
            raise ConfigError(
                f"this merge plan was made for a model with {self.expect}, not one with {found | {}} "
                f"(differs in {sorted(wrong)}): plan again for this model (vca-patch plan)"
            )
