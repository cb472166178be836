"""`VCAHandler`: what Visual-Contrast Attention does with a `VCAConfig` (its layers, calibration, training hooks)."""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.joint_carry import CarriedJointAttention, CarriedSingleStreamAttention
from vca_patch.layers.staged_carry import StagedCarriedAttention
from vca_patch.targets.handler import TargetHandler, register_handler
from vca_patch.targets.vca import calibrate as calibration
from vca_patch.targets.vca import card, fused_cpu, training
from vca_patch.targets.vca.builders import build_vca, builds_variant, mode_field
from vca_patch.targets.vca.config import VCAConfig
from vca_patch.targets.vca.layer import VisualContrastAttention


@register_handler(VCAConfig)
class VCAHandler(TargetHandler):
    """VCA's hooks: layers built per carried kind (`builders.build_vca`), the closed-form calibration
    (`targets/vca/calibrate.py`), the λ group, guard and trace (`targets/vca/training.py`), the fused CPU kernel."""

    def build_layer(self, config: VCAConfig, carried: CarriedAttention, layer_index: int) -> VisualContrastAttention:
        settings = {
            "contrast_grid": config.contrast_grid_for(layer_index, carried),
            "layer_index": layer_index,
            "softmax": config.softmax,
            "rms_eps": config.rms_eps,
            "prefix_readout": config.prefix_readout,
            "stage2_temperature": config.stage2_temperature,
        }
        if config.uses_token_magnitude(carried):  # only then: the hierarchical variants' builders need not know it
            settings["token_magnitude"] = True
        if config.local_window:
            if isinstance(carried, (StagedCarriedAttention, CarriedJointAttention, CarriedSingleStreamAttention)):
                raise ConfigError(
                    "local_window applies to single-grid ViTs, not hierarchical stages (PVT, Swin) or joint "
                    "image + text attention (SD3, Flux)"
                )
            settings["local_window"] = config.local_window
        option = mode_field(carried)  # the field picking a hierarchical stage's conversion mode: pvt_mode, swin_mode
        vca = build_vca(carried, getattr(config, option) if option else None, **settings)
        vca.reset_vca_parameters(config.init)
        if hasattr(vca, "rope_contrast"):  # joint attention that may get a rotary embedding (Flux)
            vca.rope_contrast = config.rope_contrast
        return vca

    def builds_variant(self, config_cls: type[VCAConfig], carried: CarriedAttention) -> bool:
        """VCA builds a variant for every carry class it has a builder for (`builders.VCA_BUILDERS`)."""
        return builds_variant(carried)

    def layer_settings(self, config: VCAConfig, layer: VisualContrastAttention) -> dict[str, Any]:
        settings = {"contrast_tokens": layer.num_contrast_tokens, "lambda_init": layer.lambda_init}
        return {**settings, **getattr(layer, "hierarchical_settings", {})}  # stage, mode, grid of PVT/Swin layers

    def as_built(self, config: VCAConfig, model: nn.Module) -> VCAConfig:
        """`token_magnitude` as the layers got it, where it was left automatic (None) and they all agree."""
        if config.token_magnitude is not None:
            return config
        gains = {
            getattr(layer, "token_gain", None) is not None
            for layer in model.modules()
            if isinstance(layer, VisualContrastAttention)
        }
        return dataclasses.replace(config, token_magnitude=gains.pop()) if len(gains) == 1 else config

    def card_section(self, config_cls: type[VCAConfig], data: dict[str, Any]) -> tuple[str, str, str]:
        return card.card_section(data)

    # ---- Calibration and compute kernel (the fits live in targets/vca/calibrate.py) ----
    def calibrates(self, config: VCAConfig, layer: nn.Module) -> bool:
        return calibration.calibrates(layer)

    def calibrate_layer(
        self, config: VCAConfig, layer: nn.Module, capture: Any, teacher: Any, measure: Any, options: Any
    ) -> dict:
        return calibration.calibrate_layer(layer, capture, teacher, measure, options)

    def grown_tokens(self, config: VCAConfig, tokens: int, num_patches: int) -> int:
        return calibration.grown_tokens(tokens, num_patches)

    def with_more_tokens(self, config: VCAConfig, grow: dict[int, int]) -> VCAConfig:
        """More contrast tokens in the blocks of `grow` (over `layer_contrast_tokens`)."""
        overrides = {**(config.layer_contrast_tokens or {}), **grow}
        return dataclasses.replace(config, layer_contrast_tokens=overrides)

    def cpu_kernel(self, config_cls: type[VCAConfig]) -> fused_cpu.CpuKernel:
        return fused_cpu.CPU_KERNEL

    # ---- Recovery training (the λ group and guard live in targets/vca/training.py) ----
    def parameter_groups(self, config: VCAConfig, model: nn.Module) -> dict[str, list[nn.Parameter]]:
        return {"lambda": training.lambda_parameters(model)}

    def guard_parameters(self, config: VCAConfig, model: nn.Module, options: Any) -> int:
        return training.guard_lambdas(model, options.lambda_max) if options.lambda_guard == "clamp" else 0

    def parameter_trace(self, config: VCAConfig, model: nn.Module) -> dict[str, Any]:
        return {"lambda": training.lambda_trace(model)}
