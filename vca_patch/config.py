"""Target configurations: what to patch and with which attention, as JSON-round-tripping dataclasses."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from .attention import CarriedAttention, MultipoleAttention, VisualContrastAttention
from .attention.joint_vca import CarriedJointAttention, CarriedSingleStreamAttention
from .attention.neighbourhood import is_local_window
from .attention.staged_carry import CarriedWindowAttention, StagedCarriedAttention, default_stage_contrast_tokens
from .attention.window_mano import build_window_mano


class ConfigError(ValueError):
    """A configuration value or key is invalid."""


CONFIG_TYPES: dict[str, type[TargetConfig]] = {}


@dataclass
class TargetConfig:
    """Base of every target attention's config: layer selection, seed, JSON round trip.

    Subclasses set `target`, add their fields, and implement `build_layer` / `layer_settings`.
    """

    target: ClassVar[str] = ""

    layers: list[int] | None = field(default=None, kw_only=True)
    include: str | None = field(default=None, kw_only=True)  # regex: patch only matching module paths
    exclude: str | None = field(default=None, kw_only=True)  # regex: never patch matching module paths
    seed: int = field(default=0, kw_only=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.target:
            CONFIG_TYPES[cls.target] = cls

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.layers is not None:
            if not isinstance(self.layers, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layers
            ):
                raise ConfigError(f"layers must be a list of non-negative block indices or None, got {self.layers!r}")
            self.layers = sorted(set(self.layers))
        for name in ("include", "exclude"):
            pattern = getattr(self, name)
            if pattern is not None:
                try:
                    re.compile(pattern)
                except (re.error, TypeError) as exc:
                    raise ConfigError(
                        f"{name} must be a regular expression on module paths, got {pattern!r}: {exc}"
                    ) from None
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")

    def build_layer(self, carried: CarriedAttention, layer_index: int) -> nn.Module:
        """The replacement for one attention module, reusing `carried` and initialised."""
        raise NotImplementedError

    def layer_settings(self, layer: nn.Module) -> dict[str, Any]:
        """JSON-safe per-layer facts recorded in reports and checkpoints."""
        return {}

    def as_built(self, model: nn.Module) -> TargetConfig:
        """This config with its automatic choices replaced by what `model`'s patched layers got, as saved in a
        checkpoint: reloading then rebuilds the same layers whatever a later version's automatic rule picks.
        Default: the config itself (no automatic choices)."""
        return self

    def block_edits(self, block: nn.Module, attention_name: str, layer_index: int) -> dict[str, nn.Module]:
        """Replacements for other modules of the site's block (the module holding the attention, under
        `attention_name`): {path inside `block`: new module}, built without changing `block`. Surgery swaps them
        in with the attention and `unpatch_model` restores the originals (see attention/carried_module.py).
        Default: none."""
        return {}

    def block_forwards(self, blocks: dict[int, tuple[nn.Module, str]]) -> dict[int, Any]:
        """Replacement forwards for whole blocks, {block index: callable}, given every patched site's
        {block index: (block, attention name)}: surgery sets each as its block's `forward` (an instance attribute,
        no module or state-dict key changes) and `unpatch_model` removes it. Default: none (token merging uses it)."""
        return {}

    def check_stage_state(self, state: dict[str, Any]) -> None:
        """Refuse a recipe stage's `target_state` this target cannot apply (default: any non-empty one)."""
        if state:
            raise ConfigError(
                f"target {self.target!r} ({type(self).__name__}) has no per-stage state to switch; a recipe stage's "
                f"target_state must be empty for it, got keys {sorted(state)}"
            )

    def apply_stage_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Put `model` (patched with this config) into `state` at a recipe stage's start (the recipe engine calls
        this with the stage's `target_state`, merged over the earlier stages'). Default: only an empty state."""
        self.check_stage_state(state)

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetConfig:
        """Build the config named by data["target"] (or this class's), rejecting unknown keys."""
        data = dict(data)
        target = data.pop("target", cls.target)
        config_cls = CONFIG_TYPES.get(target)
        if config_cls is None:
            raise ConfigError(f"unknown target {target!r}; known: {sorted(CONFIG_TYPES)}")
        if cls.target and config_cls is not cls:
            raise ConfigError(f"config is for target {target!r}, not {cls.target!r}")
        known = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown {config_cls.__name__} keys {unknown}; valid keys: {sorted(known)}")
        return config_cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> TargetConfig:
        return cls.from_dict(json.loads(text))


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
            family default 9/16/49/49 (the paper's lab). contrast_tokens applies to single-grid ViTs only.
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

    contrast_tokens: int = 49
    softmax: str = "joint"
    init: str = "preserve"
    rms_eps: float = 1e-5
    prefix_readout: str = "exact"
    stage2_temperature: bool = True
    token_magnitude: bool | None = None
    local_window: int = 0
    layer_contrast_tokens: dict[int, int] | None = None
    stage_contrast_tokens: list[int] | None = None
    swin_mode: str = "residual"
    pvt_mode: str = "carry"
    rope_contrast: str = "pooled"

    @property
    def contrast_grid(self) -> tuple[int, int]:
        side = math.isqrt(self.contrast_tokens)
        return side, side

    def contrast_grid_for(self, layer_index: int, carried: CarriedAttention | None = None) -> tuple[int, int]:
        """(h, w) of block `layer_index`'s contrast tokens: layer_contrast_tokens, else (a hierarchical stage's
        `carried`) stage_contrast_tokens or the family's default for the stage, else contrast_tokens."""
        n = self.contrast_tokens
        if isinstance(carried, StagedCarriedAttention):
            stages = self.stage_contrast_tokens
            if stages is not None and carried.stage >= len(stages):
                raise ConfigError(
                    f"stage_contrast_tokens {stages} has no entry for stage {carried.stage + 1}: give one per stage"
                )
            n = stages[carried.stage] if stages is not None else default_stage_contrast_tokens(carried.stage)
        side = math.isqrt((self.layer_contrast_tokens or {}).get(layer_index, n))
        return side, side

    def uses_token_magnitude(self, carried: CarriedAttention) -> bool:
        """Whether the layer built for `carried` gets the per-token output gain (see `token_magnitude`)."""
        staged = isinstance(carried, StagedCarriedAttention)
        if self.token_magnitude is None:
            return not staged and self.init == "preserve"
        if self.token_magnitude and staged:
            raise ConfigError("token_magnitude applies to single-grid ViTs, not hierarchical stages (PVT, Swin)")
        return self.token_magnitude

    def as_built(self, model: nn.Module) -> VCAConfig:
        if self.token_magnitude is not None:
            return self
        gains = {
            getattr(layer, "token_gain", None) is not None
            for layer in model.modules()
            if isinstance(layer, VisualContrastAttention)
        }
        return dataclasses.replace(self, token_magnitude=gains.pop()) if len(gains) == 1 else self

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
            squares = isinstance(stages, (list, tuple)) and all(_is_int(n) and n >= 1 for n in stages)
            if not stages or not squares or any(math.isqrt(n) ** 2 != n for n in stages):
                raise ConfigError(f"stage_contrast_tokens must be a list of positive perfect squares, got {stages!r}")
            self.stage_contrast_tokens = list(stages)
        if self.swin_mode not in ("residual", "global"):
            raise ConfigError(f"swin_mode must be 'residual' or 'global', got {self.swin_mode!r}")
        if self.pvt_mode not in ("carry", "paper"):
            raise ConfigError(f"pvt_mode must be 'carry' or 'paper', got {self.pvt_mode!r}")
        if self.rope_contrast not in ("pooled", "centre"):
            raise ConfigError(f"rope_contrast must be 'pooled' or 'centre', got {self.rope_contrast!r}")

    def build_layer(self, carried: CarriedAttention, layer_index: int) -> VisualContrastAttention:
        settings = {
            "contrast_grid": self.contrast_grid_for(layer_index, carried),
            "layer_index": layer_index,
            "softmax": self.softmax,
            "rms_eps": self.rms_eps,
            "prefix_readout": self.prefix_readout,
            "stage2_temperature": self.stage2_temperature,
        }
        if self.uses_token_magnitude(carried):  # only then: the hierarchical variants' builders need not know it
            settings["token_magnitude"] = True
        if self.local_window:
            if isinstance(carried, (StagedCarriedAttention, CarriedJointAttention, CarriedSingleStreamAttention)):
                raise ConfigError(
                    "local_window applies to single-grid ViTs, not hierarchical stages (PVT, Swin) or joint "
                    "image + text attention (SD3, Flux)"
                )
            settings["local_window"] = self.local_window
        if isinstance(carried, StagedCarriedAttention):  # a hierarchical stage builds its own VCA variant
            mode = getattr(self, carried.mode_option) if carried.mode_option else None
            vca = carried.build_vca(mode, **settings)
        else:
            vca = VisualContrastAttention.from_carried(carried, **settings)
        vca.reset_vca_parameters(self.init)
        if hasattr(vca, "rope_contrast"):  # joint attention that may get a rotary embedding (Flux)
            vca.rope_contrast = self.rope_contrast
        return vca

    def layer_settings(self, layer: VisualContrastAttention) -> dict[str, Any]:
        settings = {"contrast_tokens": layer.num_contrast_tokens, "lambda_init": layer.lambda_init}
        return {**settings, **getattr(layer, "hierarchical_settings", {})}  # stage, mode, grid of PVT/Swin layers


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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

    window: int = 7
    rate: int = 2
    levels: int | None = None
    down: str = "conv"
    up: str = "conv"
    init: str = "preserve"
    prefix: str = "global"
    pad: bool = True

    def validate(self) -> None:
        super().validate()
        if not _is_int(self.window) or self.window < 1:
            raise ConfigError(f"window must be a positive integer, got {self.window!r}")
        if not _is_int(self.rate) or self.rate < 2:
            raise ConfigError(f"rate must be an integer ≥ 2, got {self.rate!r}")
        if self.levels is not None and (not _is_int(self.levels) or self.levels < 1):
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

    def build_layer(self, carried: CarriedAttention, layer_index: int) -> MultipoleAttention:
        options = {"rate": self.rate, "levels": self.levels, "down": self.down, "up": self.up, "prefix": self.prefix}
        if isinstance(carried, CarriedWindowAttention):  # Swin: level 0 is the block's window attention (its window)
            mano = build_window_mano(carried, pad=self.pad, **options)
        else:
            mano = MultipoleAttention.from_carried(carried, window=self.window, pad=self.pad, **options)
        mano.reset_mano_parameters(self.init)
        return mano

    def layer_settings(self, layer: MultipoleAttention) -> dict[str, Any]:
        settings = {
            "window": layer.window,
            "rate": layer.rate,
            "levels": "auto" if layer.levels is None else layer.levels,
            "down": layer.down_mode,
            "up": layer.up_mode,
        }
        return {**settings, **getattr(layer, "hierarchical_settings", {})}  # stage, grid of Swin layers


from .didb.config import DIDBConfig  # noqa: E402, F401  (registers target "didb"; imports this module's classes)
from .merging.config import MergeConfig  # noqa: E402, F401  (registers target "merge")
