"""Switching binarisation of a DIDB-patched model between training stages (activations first, then weights)."""

from __future__ import annotations

from torch import nn

from vca_patch.core.errors import PatchError
from vca_patch.core.patch_state import get_patch_state
from vca_patch.targets.didb.attention import DIDBAttention
from vca_patch.targets.didb.binary import BinaryLinear
from vca_patch.targets.didb.packed import PackedBinaryLinear, is_packed


def set_binarization(model: nn.Module, *, weights: bool | None = None, activations: bool | None = None) -> None:
    """Turn weight / activation binarisation of every binarised Linear on or off (None: leave as is).

    Updates the patch's DIDBConfig too, so a checkpoint saved afterwards reloads in the same state. A packed model
    (didb/packed.py) keeps binary weights: unpack it (`unpack_binary`) before turning them off.
    """
    state = get_patch_state(model)
    if state is None or getattr(state.config, "target", None) != "didb":
        raise PatchError("set_binarization needs a model patched with vca_patch.DIDBConfig")
    if weights is False and is_packed(model):
        raise PatchError(
            "the model's binary weights are packed sign bits: call vca_patch.targets.didb.unpack_binary first"
        )
    for module in model.modules():
        if isinstance(module, PackedBinaryLinear) and activations is not None:
            module.binarize_activations = activations
        if isinstance(module, (DIDBAttention, BinaryLinear)):
            if weights is not None:
                module.binarize_weights = weights
            if activations is not None:
                module.binarize_activations = activations
    if weights is not None:
        state.config.weights = weights
    if activations is not None:
        state.config.activations = activations
