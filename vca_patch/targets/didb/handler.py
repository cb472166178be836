"""`DIDBHandler`: what DIDB-ViT binarisation does with a `DIDBConfig` (its layers, block edits, recipe stages and
packed checkpoint form)."""

from __future__ import annotations

from typing import Any

from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.layers.carried import CarriedAttention
from vca_patch.targets.didb.attention import DIDBAttention
from vca_patch.targets.didb.binary import BinaryLinear
from vca_patch.targets.didb.block import find_mlp
from vca_patch.targets.didb.config import STAGE_KEYS, DIDBConfig
from vca_patch.targets.didb.model import set_binarization
from vca_patch.targets.didb.packed import is_packed, load_packed, pack_binary, packed_state_dict
from vca_patch.targets.didb.rprelu import ImprovedRPReLU
from vca_patch.targets.handler import TargetHandler, register_handler


@register_handler(DIDBConfig)
class DIDBHandler(TargetHandler):
    """DIDB's hooks: a `DIDBAttention` per site, `BinaryLinear` / `ImprovedRPReLU` block edits for the MLP, the
    weights / activations switch of recipe stages, and the packed form (`protocols.PackedForm`, didb/packed.py)."""

    def build_layer(self, config: DIDBConfig, carried: CarriedAttention, layer_index: int) -> DIDBAttention:
        return DIDBAttention.from_carried(
            carried,
            binary=tuple(name for name in ("qkv", "proj") if name in config.binarize),
            binarize_weights=config.weights,
            binarize_activations=config.activations,
            binarize_attention=config.binary_attention,
            hfsc=config.hfsc,
            local=config.local,
            normalize=config.normalize,
            act_clip_init=config.act_clip_init,
            band_init=tuple(config.band_init),
            threshold_init=config.threshold_init,
            local_init=config.local_init,
        )

    def block_edits(
        self, config: DIDBConfig, block: nn.Module, attention_name: str, layer_index: int
    ) -> dict[str, nn.Module]:
        """BinaryLinear for the binarised fc1/fc2, ImprovedRPReLU for the MLP activation."""
        wanted = [name for name in ("fc1", "fc2") if name in config.binarize]
        if not wanted and not config.rprelu:
            return {}
        mlp = find_mlp(block, attention_name)
        edits: dict[str, nn.Module] = {}
        for role in wanted:
            path = getattr(mlp, role)
            edits[path] = BinaryLinear.from_linear(
                block.get_submodule(path),
                binarize_weights=config.weights,
                binarize_activations=config.activations,
                act_clip_init=config.act_clip_init,
            )
        if config.rprelu:
            if mlp.act is None:
                raise ValueError(
                    f"the MLP activation of {type(block).__name__} is not a module (or not one module): set "
                    "DIDBConfig(rprelu=False)"
                )
            fc1 = block.get_submodule(mlp.fc1)
            dd = {"device": fc1.weight.device, "dtype": fc1.weight.dtype}
            edits[mlp.act] = ImprovedRPReLU(fc1.out_features, slope_init=config.rprelu_slope_init, **dd)
        return edits

    def layer_settings(self, config: DIDBConfig, layer: DIDBAttention) -> dict[str, Any]:
        return {
            "binarize": list(config.binarize),
            "binary_attention": layer.binarize_attention,
            "hfsc": layer.hfsc,
            "local": layer.local,
            "rprelu": config.rprelu,
        }

    def check_stage_state(self, config: DIDBConfig, state: dict[str, Any]) -> None:
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

    def apply_stage_state(self, config: DIDBConfig, model: nn.Module, state: dict[str, Any]) -> None:
        """Switch weight / activation binarisation (`set_binarization`) of `model` for a recipe stage."""
        self.check_stage_state(config, state)
        if state:
            set_binarization(model, **state)

    # ---- The packed checkpoint form (checkpoint/folder.py `save_pretrained(..., packed=True)`): didb/packed.py ----
    def pack(self, config: DIDBConfig, model: nn.Module) -> nn.Module:
        """Hold `model`'s binarised Linears packed, in place (`vca_patch.targets.didb.pack_binary`); PatchError
        without binarised weights."""
        return pack_binary(model)

    def is_packed(self, config: DIDBConfig, model: nn.Module) -> bool:
        """Whether `model` holds its binarised Linears as packed bits (it then saves packed only)."""
        return is_packed(model)

    def packed_state_dict(self, config: DIDBConfig, model: nn.Module) -> dict[str, Any]:
        """`model`'s state dict with the binarised Linears as sign bits + scales (the model is not changed)."""
        return packed_state_dict(model)

    def load_packed(self, config: DIDBConfig, model: nn.Module, state_dict: dict[str, Any], source: str) -> None:
        """Put a freshly built model into the packed form of `state_dict` (ValueError when it does not fit)."""
        load_packed(model, state_dict, source)
