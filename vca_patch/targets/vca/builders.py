"""How VCA is built from each kind of carried attention: one builder per carry class, found along its MRO.

The carries (`vca_patch.layers`) know no target; this table is VCA's knowledge of them. A carry class without a
builder here gets the plain single-grid `VisualContrastAttention`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from vca_patch.layers.carried import CarriedAttention
from vca_patch.layers.cosine_window_carry import CarriedCosineWindowAttention
from vca_patch.layers.joint_carry import CarriedJointAttention, CarriedSingleStreamAttention
from vca_patch.layers.staged_carry import CarriedReductionAttention, CarriedWindowAttention
from vca_patch.targets.vca.joint import (
    DEFAULT_ROPE_CONTRAST,
    JointVisualContrastAttention,
    SingleStreamVisualContrastAttention,
)
from vca_patch.targets.vca.layer import VisualContrastAttention
from vca_patch.targets.vca.reduced import SpatialReductionVCA
from vca_patch.targets.vca.windowed import WindowedVCA

T = TypeVar("T")
VCABuilder = Callable[..., nn.Module]  # (carried, mode, **layer settings) -> the VCA layer
VCA_BUILDERS: dict[type[CarriedAttention], VCABuilder] = {}
# The VCAConfig field that picks the conversion mode of a carry class (and its subclasses): PVT's spatial reduction
# kept or dropped, Swin's windows kept beside a global branch or replaced. Carries not named here have one mode.
MODE_FIELDS: dict[type[CarriedAttention], str] = {
    CarriedReductionAttention: "pvt_mode",
    CarriedWindowAttention: "swin_mode",
}


def register_vca_builder(carry_cls: type[CarriedAttention]) -> Callable[[VCABuilder], VCABuilder]:
    """Decorator: build VCA for `carry_cls` (and its subclasses without a builder of their own)."""

    def wrap(fn: VCABuilder) -> VCABuilder:
        VCA_BUILDERS[carry_cls] = fn
        return fn

    return wrap


def _nearest(table: dict[type[CarriedAttention], T], carried: CarriedAttention) -> T | None:
    """`table`'s entry for `carried`'s class or the nearest base along its MRO, else None."""
    return next((table[cls] for cls in type(carried).__mro__ if cls in table), None)


def builds_variant(carried: CarriedAttention) -> bool:
    """Whether VCA has a builder of its own for `carried`'s class (along its MRO): a variant for an attention that
    is not plain softmax attention over one token grid (hierarchical stages, joint image + text streams)."""
    return _nearest(VCA_BUILDERS, carried) is not None


def mode_field(carried: CarriedAttention) -> str | None:
    """The VCAConfig field that picks `carried`'s conversion mode (`MODE_FIELDS`, along its MRO), else None."""
    return _nearest(MODE_FIELDS, carried)


def build_vca(carried: CarriedAttention, mode: str | None, **settings: Any) -> nn.Module:
    """The VCA layer for `carried`: its class's builder (nearest along the MRO), else plain single-grid VCA."""
    builder = _nearest(VCA_BUILDERS, carried)
    if builder is not None:
        return builder(carried, mode, **settings)
    return VisualContrastAttention.from_carried(carried, **settings)


@register_vca_builder(CarriedReductionAttention)
def _build_reduction(carried: CarriedReductionAttention, mode: str | None, **kwargs: Any) -> SpatialReductionVCA:
    """`pvt_mode` "carry" keeps the reduction (exact carry: Stage I over the reduced keys); "paper" drops it (the
    paper's placement: global VCA over the full-resolution keys, `kv` then reads the block input instead of the
    reduced grid it was trained on: approximate, the family notes it)."""
    if mode not in (None, "carry", "paper"):
        raise ValueError(f"pvt_mode must be 'carry' or 'paper', got {mode!r}")
    layer = carried.instantiate_staged(SpatialReductionVCA, **kwargs)
    if mode == "paper" and carried.sr is not None:
        layer.hierarchical_settings["mode"] = "reduction-dropped"
        grid = layer.hierarchical_settings.get("grid", "").split(",")[0]  # "56x56, keys 7x7 (sr 8)" -> "56x56"
        layer.hierarchical_settings["grid"] = f"{grid}, keys {grid} (sr dropped)"
        return layer
    layer.carry_reduction(carried.sr, carried.reduction_norm, carried.reduction_names)
    layer.hierarchical_settings["mode"] = "reduction-kept"
    return layer


@register_vca_builder(CarriedWindowAttention)
def _build_window(carried: CarriedWindowAttention, mode: str | None, **kwargs: Any) -> WindowedVCA:
    layer = carried.instantiate_staged(WindowedVCA, mode=mode or "residual", **kwargs)
    if layer.mode == "residual" and carried.bias_module is not None:
        layer.carry_window_bias_module(carried.bias_module_name, carried.bias_module)
    elif layer.mode == "residual":
        layer.carry_window_bias(carried.bias_table, carried.bias_index)
    layer.hierarchical_settings["mode"] = layer.mode
    grid = carried.settings.get("grid")
    window = carried.settings.get("window")
    if grid is not None:
        text = f"global {grid[0]}x{grid[1]}"
        layer.hierarchical_settings["grid"] = (
            f"window {window[0]}x{window[1]} + {text}" if layer.mode == "residual" and window else text
        )
    layer.hierarchical_settings.pop("window", None)
    return layer


@register_vca_builder(CarriedCosineWindowAttention)
def _build_cosine_window(carried: CarriedCosineWindowAttention, mode: str | None, **kwargs: Any) -> WindowedVCA:
    layer = carried.instantiate_staged(WindowedVCA, mode=mode or "residual", **kwargs)
    layer.carry_cosine(
        carried.logit_scale,
        carried.position_mlp,
        carried.coords_table,
        carried.position_index,
        names=carried.cosine_names,
    )
    layer.hierarchical_settings.update(mode=layer.mode, attention="cosine")
    grid, window = carried.settings.get("grid"), layer.hierarchical_settings.pop("window", None)
    if grid is not None:
        text = f"global {grid[0]}x{grid[1]}"
        residual = layer.mode == "residual" and window
        layer.hierarchical_settings["grid"] = f"window {window[0]}x{window[1]} + {text}" if residual else text
    return layer


@register_vca_builder(CarriedJointAttention)
def _build_joint(carried: CarriedJointAttention, mode: str | None, **kwargs: Any) -> nn.Module:
    """Joint VCA: the text tokens are exact prefix tokens, the text stream stays the original's."""
    kwargs["prefix_readout"] = "exact"  # text tokens read all keys exactly: the text stream stays the original's
    layer = CarriedAttention.instantiate(carried, JointVisualContrastAttention, **kwargs)
    layer.carry_text(carried)
    return layer


@register_vca_builder(CarriedSingleStreamAttention)
def _build_single_stream(carried: CarriedSingleStreamAttention, mode: str | None, **kwargs: Any) -> nn.Module:
    """Single-stream joint VCA, with the text tokens as exact prefix tokens."""
    kwargs["prefix_readout"] = "exact"
    norms = {"norm_q": carried.q_norm, "norm_k": carried.k_norm}
    plain = CarriedAttention(
        carried.qkv, carried.proj, carried.num_heads, carried.head_dim, proj_drop=carried.proj_drop
    )
    layer = CarriedAttention.instantiate(plain, SingleStreamVisualContrastAttention, **kwargs)
    for name, module in norms.items():
        if not isinstance(module, nn.Identity):
            layer._carry(name, module)
    layer.prefix_readout = "exact"
    layer.rope_contrast = DEFAULT_ROPE_CONTRAST
    return layer
