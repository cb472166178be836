"""The pieces of a softmax self-attention module that a linear-attention replacement reuses."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict

import torch
from torch import nn

from vca_patch.layers.fused_qkv import FusedQKVView, Member
from vca_patch.layers.layout import TokenLayout, record_layout, resolve_layout


@dataclass
class CarriedAttention:
    """Library-neutral view of one attention module's weights (the modules themselves, not copies).

    `qkv` is fused, output channels ordered (q | k | v), each as (head, head_dim): the module's `qkv` Linear, or
    a `FusedQKVView` over its own members (q_proj/k_proj/v_proj, qkv + q_bias/v_bias, ...). `proj_name` is the
    name the module holds `proj` under (o_proj, out_proj, ...). A replacement registers every carried module and
    parameter under these original names, so the carried weights keep their state-dict keys.
    """

    qkv: nn.Module | FusedQKVView
    proj: nn.Linear
    num_heads: int
    head_dim: int
    q_norm: nn.Module = field(default_factory=nn.Identity)  # per head, on [.., head_dim]
    k_norm: nn.Module = field(default_factory=nn.Identity)
    norm: nn.Module = field(default_factory=nn.Identity)  # on merged heads, before proj
    gate: nn.Module | None = None  # sigmoid output gate computed from the block input
    proj_drop: nn.Module = field(default_factory=nn.Identity)
    proj_name: str = "proj"

    @property
    def dim(self) -> int:
        return self.qkv.in_features

    def instantiate(self, layer_cls: type[nn.Module], **kwargs) -> nn.Module:
        """A replacement layer built around these q/k/v/proj modules, with the original norms, gate and dropout."""
        layer = layer_cls(self.dim, self.num_heads, head_dim=self.head_dim, qkv=self.qkv, proj=self.proj, **kwargs)
        layer.rename_output(self.proj_name)
        self.attach_extras(layer)
        return layer

    def attach_extras(self, layer: nn.Module) -> None:
        """Give a replacement layer the original norms, output gate and dropout (it already holds qkv/proj)."""
        layer.q_norm, layer.k_norm, layer.norm = self.q_norm, self.k_norm, self.norm
        layer.gate, layer.proj_drop = self.gate, self.proj_drop


class VariantRequired(TypeError):
    """A carry refused a generic replacement built around it (`CarriedAttention.instantiate`): its attention (a
    PVT spatial reduction, Swin windows, joint image + text streams) is not plain softmax attention over one token
    grid, so only a target that builds its own variant for it takes it. `carried` is the carry that refused, so
    that the caller can name the targets that build one (surgery asks the registered targets' handlers)."""

    def __init__(self, kind: str, layer_cls: type, carried: CarriedAttention) -> None:
        super().__init__(
            f"{kind} attention is not plain softmax attention over one token grid: only a target that builds a "
            f"variant for it takes it, not {layer_cls.__name__}"
        )
        self.carried = carried


class CarriedLayerOptions(TypedDict, total=False):
    """The keyword arguments of `CarriedAttentionLayer` after dim and num_heads, which every replacement layer
    passes through unchanged (`**carried: Unpack[CarriedLayerOptions]`)."""

    head_dim: int | None
    dim_out: int | None
    qkv_bias: bool
    proj_bias: bool
    proj_drop: float
    qkv: nn.Module | FusedQKVView | None
    proj: nn.Linear | None


class CarriedAttentionLayer(nn.Module):
    """Base of the replacement layers: softmax attention's q/k/v/proj, norms, gate and dropout, carried over.

    The carried modules and parameters are registered under the names the original module used (HF
    `q_proj`/`k_proj`/`v_proj`/`o_proj`, timm `qkv` with BEiT's `q_bias`/`v_bias`, ...): `layer.qkv` and
    `layer.proj` are properties that read them, `qkv` as the fused projection (the Linear itself, or an
    unregistered `FusedQKVView` of this layer). Subclasses take the arguments below as `CarriedLayerOptions`,
    add their own parameters (on `factory_kwargs`) and `forward_tokens` (or their own `forward`); adapters swap in
    the original modules through `from_carried`.

    Args:
        dim: input channels C.
        num_heads: heads M.
        head_dim: per-head width d (default dim // num_heads).
        dim_out: output channels C' (default dim).
        qkv_bias, proj_bias: biases of the q/k/v and output projections built fresh (ignored for carried ones).
        proj_drop: dropout after the output projection.
        qkv, proj: existing fused q/k/v (a Linear or a `FusedQKVView`) and output projections to reuse (built fresh
            when None); registered under their own names.
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
        qkv: nn.Module | FusedQKVView | None = None,
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

        qkv = qkv if qkv is not None else nn.Linear(dim, 3 * attn_dim, bias=qkv_bias)
        if isinstance(qkv, FusedQKVView):
            self._qkv_layout: tuple[type[FusedQKVView] | None, tuple[str, ...]] = (type(qkv), qkv.names)
            members = qkv.members()
        elif isinstance(qkv, nn.Module):
            self._qkv_layout, members = (None, ("qkv",)), [("qkv", qkv)]
        else:
            raise TypeError(f"qkv must be an nn.Module or a FusedQKVView, got {type(qkv).__name__}")
        for name, member in members:
            self._carry(name, member)
        self.q_norm: nn.Module = nn.Identity()
        self.k_norm: nn.Module = nn.Identity()
        self.norm: nn.Module = nn.Identity()  # optional norm before proj
        self.gate: nn.Module | None = None  # optional sigmoid output gate
        self._proj_name = "proj"
        self._carry("proj", proj if proj is not None else nn.Linear(attn_dim, dim_out or dim, bias=proj_bias))
        if self.qkv.out_features != 3 * attn_dim or self.proj.in_features != attn_dim:
            raise ValueError(f"qkv/proj shapes do not fit {num_heads} heads of width {head_dim}")
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(
        self,
        x: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        *,
        layout: TokenLayout | None = None,
    ) -> torch.Tensor:
        """x: [B, N, C] with N = prefix + H·W tokens -> [B, N, C'] (`forward_tokens`), on `layout` (default: the
        call's, from `layout_source`), checked against N. Masks and causal attention are refused."""
        owner = type(self).__name__
        layout = resolve_layout(owner, x.shape[1], layout, self.layout_source, attn_mask, is_causal)
        return record_layout(self.forward_tokens(x, layout), layout)  # for a recomputation under checkpointing

    def forward_tokens(self, x: torch.Tensor, layout: TokenLayout) -> torch.Tensor:
        """The layer's output for x [B, N, C] on its resolved, checked token layout: [B, N, C']."""
        raise NotImplementedError(f"{type(self).__name__} defines neither forward_tokens nor forward")

    def _carry(self, name: str, member: Member) -> None:
        """Register a carried module or parameter under its original name (straight into the registry, so a
        name that is also a method here, e.g. `output`, still gets its original state-dict key)."""
        if name in self._modules or name in self._parameters or name in self._buffers:
            raise ValueError(f"{type(self).__name__} already has a member {name!r}; cannot carry another one")
        if isinstance(member, nn.Module):
            self._modules[name] = member
        elif member is None or isinstance(member, nn.Parameter):
            self._parameters[name] = member
        else:
            raise TypeError(f"carried {name!r} must be a module or a parameter, got {type(member).__name__}")

    def _qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection of x [B, N, C], split per head: q, k, v [B, M, N, d] each (no norms applied)."""
        B, N, _ = x.shape
        return self.qkv(x).view(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)

    def _heads(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, N, M·d] -> [B, M, N, d] (a view)."""
        B, N, _ = tokens.shape
        return tokens.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)

    def _merge_heads(self, o: torch.Tensor) -> torch.Tensor:
        """[B, M, N, d] per-head outputs -> [B, N, M·d]."""
        B, _, N, _ = o.shape
        return o.transpose(1, 2).reshape(B, N, self.attn_dim)

    def norm_and_gate(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """The carried path between the merged heads o [B, N, M·d] and the output projection: norm(o), times
        sigmoid(gate(x)) of the layer input x [B, N, C] where the original gates its output."""
        o = self.norm(o)
        if self.gate is not None:
            o = o * self.gate(x).sigmoid()
        return o

    @property
    def qkv(self) -> nn.Module | FusedQKVView:
        """The fused q/k/v projection: the carried `qkv` module, or a view over the carried members."""
        view, names = self._qkv_layout
        return self._modules[names[0]] if view is None else view(self, names, check=False)

    @property
    def proj(self) -> nn.Linear:
        """The carried output projection (registered under its original name)."""
        return self._modules[self._proj_name]

    def rename_output(self, name: str) -> None:
        """Hold the output projection under `name` (the original module's, e.g. o_proj), at the same place."""
        old = self._proj_name
        if name == old:
            return
        if name in self._modules or name in self._parameters or name in self._buffers:
            raise ValueError(f"{type(self).__name__} already has a member {name!r}")
        items = list(self._modules.items())
        self._modules.clear()
        self._modules.update((name if key == old else key, module) for key, module in items)
        self._proj_name = name

    def carried_members(self) -> dict[str, Member]:
        """The carried q/k/v/proj modules and parameters, by their original names, as this layer holds them now."""
        outside = getattr(self.proj, "stays_outside", False)  # an identity: the original's projection is elsewhere
        names = (*self._qkv_layout[1], *(() if outside else (self._proj_name,)))
        return {name: self._modules[name] if name in self._modules else self._parameters[name] for name in names}

    def restore_into(self, original: nn.Module) -> None:
        """Put this layer's carried members back on `original` under the same names, where they are other
        objects (a parameter replaced by `load_state_dict(assign=True)` or on dtype conversion)."""
        for name, member in self.carried_members().items():
            if getattr(original, name, None) is not member:
                setattr(original, name, member)

    def keep_original(self, original: nn.Module) -> None:
        """Keep the replaced module (for `unpatch_model`) outside the module tree: not in the state dict or
        `parameters()`, yet moved and cast with this layer by `.to()`, `.cuda()`, `.half()`, ..."""
        self.__dict__["original_module"] = original

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        original = self.__dict__.get("original_module")
        if original is not None:
            self.restore_into(original)  # the carried members, already converted (a second conversion is a no-op)
            original._apply(fn, recurse)  # its own tensors, e.g. a relative-position bias table the layer dropped
        return self

    @property
    def factory_kwargs(self) -> dict[str, Any]:
        """device and dtype of the carried weights, for the parameters a subclass adds."""
        weight = next(iter(self.qkv.parameters()))
        return {"device": weight.device, "dtype": weight.dtype}

    @classmethod
    def from_carried(cls, carried: CarriedAttention, **kwargs) -> CarriedAttentionLayer:
        """The layer reusing an attention module's q/k/v/proj (and norms, gate, dropout) as they are."""
        return carried.instantiate(cls, **kwargs)
