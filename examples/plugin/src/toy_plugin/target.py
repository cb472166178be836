"""The target `temp-softmax`: softmax attention whose logits are divided by a learned per-head temperature.

At its initial temperature 1.0 the layer computes exactly the attention it replaces; recovery training can then
sharpen or flatten each head. A toy: it shows every piece a target gives, not a method worth using."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vca_patch.core.errors import ConfigError
from vca_patch.layers.carried import CarriedAttention, CarriedAttentionLayer
from vca_patch.layers.layout import TokenLayout
from vca_patch.layers.macs import AttentionShape, register_attention_macs
from vca_patch.targets import TargetConfig, TargetHandler, register_handler, register_target

TARGET = "temp-softmax"


class TempSoftmaxAttention(CarriedAttentionLayer):
    """The carried q/k/v/proj, with softmax(q·kᵀ / (√d · t_h)) per head h; `temperature` [M] is learned."""

    def __init__(self, dim: int, num_heads: int, *, temperature: float = 1.0, **carried: Any) -> None:
        super().__init__(dim, num_heads, **carried)
        self.initial_temperature = float(temperature)  # a plain float: `layer_settings` also runs on meta layers
        self.temperature = nn.Parameter(torch.full((num_heads,), float(temperature), **self.factory_kwargs))

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        q, k, v = self._qkv_heads(x)  # [B, M, N, d] each
        q = self.q_norm(q) / self.temperature.view(1, -1, 1, 1)
        o = F.scaled_dot_product_attention(q, self.k_norm(k), v, scale=self.scale)
        return self.proj_drop(self.proj(self.norm_and_gate(x, self._merge_heads(o))))


@register_target  # also found through the entry point; registering the same class twice is a no-op
@dataclass
class TempSoftmaxConfig(TargetConfig):
    """Softmax attention with a learned per-head temperature."""

    target: ClassVar[str] = TARGET
    display_name: ClassVar[str] = "temperature softmax"
    tags: ClassVar[tuple[str, ...]] = ("temp-softmax",)

    temperature: float = field(
        default=1.0, metadata={"cli": "--temperature", "help": "initial temperature of every head (1.0: unchanged)"}
    )

    def validate(self) -> None:
        super().validate()  # layers, include, exclude, seed
        value = self.temperature
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"temperature must be a positive number, got {value!r}")


# The config above is the target's settings, plain data; what a conversion does with them is its handler, registered
# here for the config class, so loading the entry point (this module) registers both.
@register_handler(TempSoftmaxConfig)
class TempSoftmaxHandler(TargetHandler):
    """The target's behaviour: each hook takes the config first (`vca_patch.targets.protocols` lists them all)."""

    def build_layer(self, config: TempSoftmaxConfig, carried: CarriedAttention, layer_index: int) -> nn.Module:
        return TempSoftmaxAttention.from_carried(carried, temperature=config.temperature)

    def layer_settings(self, config: TempSoftmaxConfig, layer: nn.Module) -> dict[str, Any]:
        return {"temperature": layer.initial_temperature}


@register_attention_macs(TARGET)
def temp_softmax_macs(shape: AttentionShape, config: Any = None) -> float:
    """The same count as softmax attention: 2·N²·C (the division by the temperature is O(N·C))."""
    return 2.0 * shape.num_tokens**2 * shape.dim
