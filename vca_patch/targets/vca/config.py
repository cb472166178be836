"""`VCAConfig`: the Visual-Contrast Attention target (`target = "vca"`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from vca_patch.core.errors import ConfigError
from vca_patch.core.sizes import check_contrast_tokens
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.staged_carry import StagedCarriedAttention
from vca_patch.targets.base import RecipeOptions, TargetConfig, is_int, register_target
from vca_patch.targets.vca import card
from vca_patch.targets.vca import recipe as recipe_keys
from vca_patch.targets.vca.calibrate import VCACalibration
from vca_patch.targets.vca.neighbourhood import is_local_window

# VCA's contrast tokens per stage of a hierarchical model (PVT, Swin) where `stage_contrast_tokens` gives none: the
# paper's lab (Agent Attention) uses n = 3², 4², 7², 7² in stages 1-4; later stages take the last entry.
DEFAULT_STAGE_CONTRAST_TOKENS = (9, 16, 49, 49)


def default_stage_contrast_tokens(stage: int) -> int:
    """n for 0-based `stage` of a hierarchical model (`DEFAULT_STAGE_CONTRAST_TOKENS`, the last beyond it)."""
    return DEFAULT_STAGE_CONTRAST_TOKENS[min(stage, len(DEFAULT_STAGE_CONTRAST_TOKENS) - 1)]


@register_target
@dataclass
class VCAConfig(TargetConfig):
    """Configuration of a Visual-Contrast Attention patch.

    Attributes:
        contrast_tokens: n, the number of pooled contrast tokens; a perfect square (h = w = √n).
        softmax: Stage-II softmax, "joint" (official code) or "separate" (paper text).
        init: "preserve" (carry q/k/v/proj, function-preserving new parameters) or "paper"
            (the paper's from-scratch init of the new parameters).
        rms_eps: epsilon of the two sub-layer RMSNorms.
        prefix_readout: "exact" (default: prefix tokens such as CLS and registers read all N keys with plain
            softmax attention, O(N·P), still linear in N; measured best for converting pretrained models) or
            "contrast" (the paper: prefix tokens read only the contrast tokens).
        stage2_temperature: add a learnable per-head Stage-II temperature (init 1 = the paper form; on by
            default, since calibration tunes it). False: exactly the paper's parameters.
        token_magnitude: add a per-token, per-head output gain exp(W·x + b) to each layer (zero-initialised: the
            layer is unchanged until `calibrate` fits it to the original attention's per-token output magnitude,
            which RMSNorm₂ erases). Costs a C×M projection per layer. None (default): on for single-grid layers
            under init "preserve" (measured on real DINOv2 weights, calibrated: CLS cosine 0.870 -> 0.892, patch
            tokens 0.824 -> 0.852), off for hierarchical stages (PVT, Swin) and the paper's from-scratch init.
        local_window: k > 0 (odd: 3, 5, 7) adds a local term to each layer: every patch also attends to its k×k
            patch neighbours and the prefix tokens (neighbourhood attention, O(N·k²·C)), mixed in per channel
            (init: off; `calibrate` fits the mix with the depthwise conv). Measured on real DINOv2 weights at 224 px,
            calibrated: CLS cosine 0.903 -> 0.960, patch tokens 0.866 -> 0.928 at k = 7. 0 (default): the layer
            without it. Single-grid ViTs only.
        layer_contrast_tokens: per-block overrides of contrast_tokens, {block index: n}.
        stage_contrast_tokens: n per stage of a hierarchical model (PVT, Swin), [stage 1, stage 2, ...]; None: the
            default 9/16/49/49 (the paper's lab, `DEFAULT_STAGE_CONTRAST_TOKENS`). contrast_tokens applies to
            single-grid ViTs only.
        swin_mode: how Swin/SwinV2 window attention converts: "residual" (window attention kept, its bias/CPB and
            shift mask included, plus a zero-gated global VCA branch; exact at init) or "global" (global VCA on the
            stage's grid; approximate). SwinV2's cosine attention stays cosine (normalised queries pooled).
        pvt_mode: how PVT spatial-reduction attention converts: "carry" (the reduction kept, Stage I over the
            reduced keys; exact carry) or "paper" (the reduction dropped: global VCA over full-resolution keys, the
            paper's placement; approximate, for fine-tuning).
        rope_contrast: how contrast tokens of rotary-embedded joint attention (Flux) get their rotation: "pooled"
            (pooled from the rotated queries; measured marginally closer to the unconverted model) or "centre" (pooled
            before rotation, then rotated at their cell's centre).
        layers: 0-based block indices to patch; None patches every attention block.
        seed: seed of the random parts of the init (λ vectors; e± and DWC in "paper" mode).
    """

    target: ClassVar[str] = "vca"
    display_name: ClassVar[str] = card.DISPLAY_NAME
    tags: ClassVar[tuple[str, ...]] = card.TAGS
    citation: ClassVar[str] = card.CITATION
    calibration_options: ClassVar[type] = VCACalibration  # `vca_patch.calibrate`'s keywords for VCA layers
    recipe_options: ClassVar[RecipeOptions] = recipe_keys.RECIPE_OPTIONS  # lambda_lr, lambda_guard, lambda_max

    contrast_tokens: int = dataclasses.field(
        default=49, metadata={"cli": "--contrast-tokens", "help": "Pooled contrast tokens n (a perfect square)"}
    )
    softmax: str = dataclasses.field(
        default="joint", metadata={"cli": "--softmax", "help": "Stage-II softmax: joint or separate"}
    )
    init: str = dataclasses.field(
        default="preserve", metadata={"cli": "--init", "help": "preserve (function-preserving) or paper (from scratch)"}
    )
    rms_eps: float = 1e-5
    prefix_readout: str = dataclasses.field(
        default="exact",
        metadata={
            "cli": "--prefix-readout",
            "help": "Prefix tokens read all keys (exact) or only the contrast tokens (contrast, paper)",
        },
    )
    stage2_temperature: bool = dataclasses.field(
        default=True,
        metadata={
            "cli": "--stage2-temperature/--no-stage2-temperature",
            "help": "Per-head Stage-II temperature (init 1)",
        },
    )
    token_magnitude: bool | None = dataclasses.field(
        default=None,
        metadata={
            "cli": "--token-magnitude/--no-token-magnitude",
            "help": "Per-token output gain that calibration fits (default: on for single-grid ViTs)",
        },
    )
    local_window: int = dataclasses.field(
        default=0,
        metadata={
            "cli": "--local-window",
            "help": "Each patch also attends to its K x K neighbours (odd K, e.g. 7; calibration fits it; 0: off)",
        },
    )
    layer_contrast_tokens: dict[int, int] | None = None
    stage_contrast_tokens: list[int] | None = dataclasses.field(
        default=None,
        metadata={
            "cli": "--stage-contrast-tokens",
            "help": "On PVT/Swin: contrast tokens per stage, e.g. 9,16,49,49 (default: the paper's 9/16/49/49)",
        },
    )
    swin_mode: str = dataclasses.field(
        default="residual",
        metadata={
            "cli": "--swin-mode",
            "help": "On Swin/SwinV2: residual (window attention kept + zero-gated global VCA: exact) or global",
        },
    )
    pvt_mode: str = dataclasses.field(
        default="carry",
        metadata={
            "cli": "--pvt-mode",
            "help": "On PVT: carry (spatial reduction kept: exact carry) or paper (reduction dropped: approximate)",
        },
    )
    rope_contrast: str = "pooled"

    def fit_grid(self, grid: tuple[int, int]) -> tuple[VCAConfig, list[str]]:
        """The default contrast tokens shrunk to the largest square `grid` holds where they do not fit (a small
        image), said in a note; a count the user chose past the grid is refused (`check_contrast_tokens`): more
        contrast tokens than patches would repeat patches instead of summarising them, and cost more than they
        save. A hierarchical model's stages are checked at their own grids when their layers are built
        (`contrast_grid_for`): `grid` is the first stage's."""
        config, notes = self, []
        default, side = type(self).__dataclass_fields__["contrast_tokens"].default, min(grid)
        if side < 1:  # no whole patch: the size checks refuse the image size itself
            return config, notes
        if self.contrast_tokens == default and side * side < default:
            config = dataclasses.replace(self, contrast_tokens=side * side)
            notes.append(f"the default {default} contrast tokens do not fit the {grid[0]}×{grid[1]} patch grid; "
                         f"using {side * side}")  # fmt: skip
        check_contrast_tokens(config.contrast_tokens, grid)
        for n in (config.layer_contrast_tokens or {}).values():
            check_contrast_tokens(n, grid, "layer_contrast_tokens")
        return config, notes

    @property
    def contrast_grid(self) -> tuple[int, int]:
        side = math.isqrt(self.contrast_tokens)
        return side, side

    def contrast_grid_for(self, layer_index: int, carried: CarriedAttention | None = None) -> tuple[int, int]:
        """(h, w) of block `layer_index`'s contrast tokens: layer_contrast_tokens, else (a hierarchical stage's
        `carried`) stage_contrast_tokens or VCA's default for the stage, else contrast_tokens.

        A stage whose token grid the family gives (`StagedCarriedAttention.grid`) is held to the rule `fit_grid`
        applies to a single grid: a chosen count past the stage's patches is refused (`check_contrast_tokens`), the
        stage default shrinks to the largest square the grid holds (the report shows the grid used)."""
        n, option = self._contrast_tokens_for(layer_index, carried)
        grid = carried.grid if isinstance(carried, StagedCarriedAttention) else None
        if grid is not None and min(grid) >= 1:
            if option is None:  # the stage default: fitted, as fit_grid fits the default of a single grid
                n = min(n, min(grid) ** 2)
            else:
                check_contrast_tokens(n, grid, f"{option} (stage {carried.stage + 1}, block {layer_index})")
        side = math.isqrt(n)
        return side, side

    def _contrast_tokens_for(self, layer_index: int, carried: CarriedAttention | None) -> tuple[int, str | None]:
        """(n, the option that chose it; None for a hierarchical stage's default)."""
        chosen = (self.layer_contrast_tokens or {}).get(layer_index)
        if chosen is not None:
            return chosen, "layer_contrast_tokens"
        if not isinstance(carried, StagedCarriedAttention):
            return self.contrast_tokens, "contrast_tokens"
        stages = self.stage_contrast_tokens
        if stages is None:
            return default_stage_contrast_tokens(carried.stage), None
        if carried.stage >= len(stages):
            raise ConfigError(
                f"stage_contrast_tokens {stages} has no entry for stage {carried.stage + 1}: give one per stage"
            )
        return stages[carried.stage], "stage_contrast_tokens"

    def uses_token_magnitude(self, carried: CarriedAttention) -> bool:
        """Whether the layer built for `carried` gets the per-token output gain (see `token_magnitude`)."""
        staged = isinstance(carried, StagedCarriedAttention)
        if self.token_magnitude is None:
            return not staged and self.init == "preserve"
        if self.token_magnitude and staged:
            raise ConfigError("token_magnitude applies to single-grid ViTs, not hierarchical stages (PVT, Swin)")
        return self.token_magnitude

    def validate(self) -> None:
        super().validate()
        n = self.contrast_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1 or math.isqrt(n) ** 2 != n:
            raise ConfigError(f"contrast_tokens must be a positive perfect square (4, 16, 49, ...), got {n!r}")
        if self.softmax not in ("joint", "separate"):
            raise ConfigError(f"softmax must be 'joint' or 'separate', got {self.softmax!r}")
        if self.init not in ("preserve", "paper"):
            raise ConfigError(f"init must be 'preserve' or 'paper', got {self.init!r}")
        if isinstance(self.rms_eps, bool) or not isinstance(self.rms_eps, (int, float)) or not self.rms_eps > 0:
            raise ConfigError(f"rms_eps must be a positive number, got {self.rms_eps!r}")
        if self.prefix_readout not in ("contrast", "exact"):
            raise ConfigError(f"prefix_readout must be 'contrast' or 'exact', got {self.prefix_readout!r}")
        if not isinstance(self.stage2_temperature, bool):
            raise ConfigError(f"stage2_temperature must be true or false, got {self.stage2_temperature!r}")
        if self.token_magnitude is not None and not isinstance(self.token_magnitude, bool):
            raise ConfigError(f"token_magnitude must be true, false or null (auto), got {self.token_magnitude!r}")
        if not is_local_window(self.local_window):
            raise ConfigError(
                f"local_window must be 0 (off) or an odd kernel size (3, 5, 7, ...), got {self.local_window!r}"
            )
        if self.layer_contrast_tokens is not None:
            if not isinstance(self.layer_contrast_tokens, dict):
                raise ConfigError(f"layer_contrast_tokens must map block -> n, got {self.layer_contrast_tokens!r}")
            overrides: dict[int, int] = {}
            for key, value in self.layer_contrast_tokens.items():  # JSON turns the int keys into strings
                try:
                    index = int(key)
                except (TypeError, ValueError):
                    raise ConfigError(f"layer_contrast_tokens key {key!r} is not a block index") from None
                valid = isinstance(value, int) and not isinstance(value, bool) and value >= 1
                if not valid or math.isqrt(value) ** 2 != value:
                    raise ConfigError(f"layer_contrast_tokens[{key}] must be a positive perfect square, got {value!r}")
                overrides[index] = value
            self.layer_contrast_tokens = overrides or None
        if self.stage_contrast_tokens is not None:
            stages = self.stage_contrast_tokens
            squares = isinstance(stages, (list, tuple)) and all(is_int(n) and n >= 1 for n in stages)
            if not stages or not squares or any(math.isqrt(n) ** 2 != n for n in stages):
                raise ConfigError(f"stage_contrast_tokens must be a list of positive perfect squares, got {stages!r}")
            self.stage_contrast_tokens = list(stages)
        if self.swin_mode not in ("residual", "global"):
            raise ConfigError(f"swin_mode must be 'residual' or 'global', got {self.swin_mode!r}")
        if self.pvt_mode not in ("carry", "paper"):
            raise ConfigError(f"pvt_mode must be 'carry' or 'paper', got {self.pvt_mode!r}")
        if self.rope_contrast not in ("pooled", "centre"):
            raise ConfigError(f"rope_contrast must be 'pooled' or 'centre', got {self.rope_contrast!r}")
