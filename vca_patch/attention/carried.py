"""The pieces of a softmax self-attention module that a linear-attention replacement reuses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .layout import TokenLayout


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


class CarriedAttentionLayer(nn.Module):
    """Base of the replacement layers: softmax attention's q/k/v/proj, norms, gate and dropout, carried over.

    Subclasses add their own parameters (on `factory_kwargs`) and `forward`; adapters swap in the original
    modules through `from_carried`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        dim_out: int | None = None,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        proj_drop: float = 0.0,
        qkv: nn.Linear | None = None,
        proj: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
            head_dim = dim // num_heads
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_dim = attn_dim = num_heads * head_dim
        self.scale = head_dim**-0.5
        # Token layout for calls that do not pass one (set by model surgery).
        self.layout_source: Callable[[], TokenLayout] | None = None

        self.qkv = qkv if qkv is not None else nn.Linear(dim, 3 * attn_dim, bias=qkv_bias)
        self.q_norm: nn.Module = nn.Identity()
        self.k_norm: nn.Module = nn.Identity()
        self.norm: nn.Module = nn.Identity()  # optional norm before proj
        self.gate: nn.Module | None = None  # optional sigmoid output gate
        self.proj = proj if proj is not None else nn.Linear(attn_dim, dim_out or dim, bias=proj_bias)
        if self.qkv.out_features != 3 * attn_dim or self.proj.in_features != attn_dim:
            raise ValueError(f"qkv/proj shapes do not fit {num_heads} heads of width {head_dim}")
        self.proj_drop = nn.Dropout(proj_drop)

    @property
    def factory_kwargs(self) -> dict[str, Any]:
        """device and dtype of the carried weights, for the parameters a subclass adds."""
        return {"device": self.qkv.weight.device, "dtype": self.qkv.weight.dtype}

    @classmethod
    def from_carried(cls, carried: CarriedAttention, **kwargs) -> CarriedAttentionLayer:
        """The layer reusing an attention module's q/k/v/proj (and norms, gate, dropout) as they are."""
        return carried.instantiate(cls, **kwargs)
