"""`MergeHandler`: what token merging does with a `MergeConfig`. Its VCA and MANO blocks (before the first merge)
are built, calibrated and trained by VCA's and MANO's own handlers, reached through `handler_for` on the configs
`MergeConfig.vca_config()` / `mano_config(window)` give."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.layers.carried import CarriedAttention
from vca_patch.targets.handler import TargetHandler, handler_for, register_handler
from vca_patch.targets.mano.layer import MultipoleAttention
from vca_patch.targets.merge.attention import MergingAttention
from vca_patch.targets.merge.block import MergeState, MergingForward, block_family
from vca_patch.targets.merge.config import MergeConfig


@register_handler(MergeConfig)
class MergeHandler(TargetHandler):
    """Merging's hooks: proportional softmax attention and merging block forwards; VCA's hooks for its VCA blocks
    (calibration, λ group, guard, trace), MANO's for its MANO blocks."""

    def build_layer(self, config: MergeConfig, carried: CarriedAttention, layer_index: int) -> nn.Module:
        config.check_model(None, carried)
        if layer_index in (config.vca_layers or {}):
            vca = config.vca_config()
            return handler_for(vca).build_layer(vca, carried, layer_index)
        if layer_index in (config.mano_layers or {}):
            mano = config.mano_config(config.mano_layers[layer_index])
            return handler_for(mano).build_layer(mano, carried, layer_index)
        return MergingAttention.from_carried(carried)

    def as_built(self, config: MergeConfig, model: nn.Module) -> MergeConfig:
        """The VCA blocks' automatic choices as their layers got them (VCA's `as_built`), in `vca`."""
        if not config.vca_layers:
            return config
        vca = config.vca_config()
        built = handler_for(vca).as_built(vca, model).token_magnitude
        if built is None or config.vca.get("token_magnitude") == built:
            return config
        return replace(config, vca={**config.vca, "token_magnitude": built})

    def block_forwards(
        self, config: MergeConfig, blocks: dict[int, tuple[nn.Module, str]]
    ) -> dict[int, MergingForward]:
        """The merging forwards of the softmax blocks ({block index: (block, attention name)} of every patched site);
        the VCA and MANO blocks run as they are. One `MergeState` is shared by this model's blocks."""
        indices = sorted(blocks)
        config.check_model(len(indices), None)
        if config.schedule is not None and len(config.schedule) > indices[-1] + 1:
            raise ConfigError(f"schedule gives r for {len(config.schedule)} blocks; this model has {indices[-1] + 1}")
        for name, layers in (("vca_layers", config.vca_layers), ("mano_layers", config.mano_layers)):
            outside = sorted(set(layers or {}) - set(indices))
            if outside:
                raise ConfigError(f"{name} names blocks {outside}, which are not patched attention blocks here")
        grid = config.grid_layers()
        if indices != list(range(indices[0], indices[-1] + 1)):
            raise ConfigError(f"token merging converts a run of consecutive blocks; got blocks {indices}")
        merging = [i for i in indices if i not in grid]
        if not merging:
            return {}
        families = {i: block_family(*blocks[i]) for i in merging}  # refuses unknown blocks before building any
        state = MergeState()
        return {
            i: MergingForward(
                blocks[i][0],
                families[i],
                config.r_for(i),
                first=i == merging[0],
                last=i == indices[-1],
                state=state,
                residual=config.unmerge == "residual",
            )
            for i in merging
        }

    def layer_settings(self, config: MergeConfig, layer: nn.Module) -> dict[str, Any]:
        if isinstance(layer, MergingAttention):
            return {"attention": "softmax (proportional)"}
        if isinstance(layer, MultipoleAttention):
            mano = config.mano_config(layer.window)
            return {"attention": "mano", **handler_for(mano).layer_settings(mano, layer)}
        return {"attention": "vca", "contrast_tokens": layer.num_contrast_tokens}

    # ---- Calibration: the VCA blocks calibrate as VCA's ----
    def calibrates(self, config: MergeConfig, layer: nn.Module) -> bool:
        vca = config.vca_config()
        return handler_for(vca).calibrates(vca, layer)

    def calibrate_layer(
        self, config: MergeConfig, layer: nn.Module, capture: Any, teacher: Any, measure: Any, options: Any
    ) -> dict:
        vca = config.vca_config()
        return handler_for(vca).calibrate_layer(vca, layer, capture, teacher, measure, options)

    def grown_tokens(self, config: MergeConfig, tokens: int, num_patches: int) -> int:
        vca = config.vca_config()
        return handler_for(vca).grown_tokens(vca, tokens, num_patches)  # with_more_tokens then refuses (ConfigError)

    # ---- Recovery training: the VCA blocks' λ group, guard and trace are VCA's ----
    def parameter_groups(self, config: MergeConfig, model: nn.Module) -> dict[str, list[nn.Parameter]]:
        if not config.vca_layers:
            return {}
        vca = config.vca_config()
        return handler_for(vca).parameter_groups(vca, model)

    def guard_parameters(self, config: MergeConfig, model: nn.Module, options: Any) -> int:
        if not config.vca_layers:
            return 0
        vca = config.vca_config()
        return handler_for(vca).guard_parameters(vca, model, options)

    def parameter_trace(self, config: MergeConfig, model: nn.Module) -> dict[str, Any]:
        if not config.vca_layers:
            return {}
        vca = config.vca_config()
        return handler_for(vca).parameter_trace(vca, model)
