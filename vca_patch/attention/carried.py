"""The pieces of a softmax self-attention module that a linear-attention replacement reuses."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn


@dataclass
class CarriedAttention:
    """Library-neutral view of one attention module's weights (the modules themselves, not copies).

    `qkv` is fused (an nn.Linear, or a SplitQKV over separate projections): output channels ordered
    (q | k | v), each as (head, head_dim).
    """

    qkv: nn.Module
    proj: nn.Linear
    num_heads: int
    head_dim: int
    q_norm: nn.Module = field(default_factory=nn.Identity)  # per head, on [.., head_dim]
    k_norm: nn.Module = field(default_factory=nn.Identity)
    norm: nn.Module = field(default_factory=nn.Identity)  # on merged heads, before proj
    gate: nn.Module | None = None  # sigmoid output gate computed from the block input
    proj_drop: nn.Module = field(default_factory=nn.Identity)

    @property
    def dim(self) -> int:
        return self.qkv.in_features

    def instantiate(self, layer_cls: type[nn.Module], **kwargs) -> nn.Module:
        """A replacement layer built around these q/k/v/proj modules, with the original norms, gate and dropout."""
        layer = layer_cls(self.dim, self.num_heads, head_dim=self.head_dim, qkv=self.qkv, proj=self.proj, **kwargs)
        self.attach_extras(layer)
        return layer

    def attach_extras(self, layer: nn.Module) -> None:
        """Give a replacement layer the original norms, output gate and dropout (it already holds qkv/proj)."""
        layer.q_norm, layer.k_norm, layer.norm = self.q_norm, self.k_norm, self.norm
        layer.gate, layer.proj_drop = self.gate, self.proj_drop
